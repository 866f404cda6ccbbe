"""The admission record (connector.admission): decided once at the first look, read by every later step, handed to
the workers once, forgotten in one place."""

from __future__ import annotations

import pytest

from connector.admission import Admission, Admissions, ReadPlan, Verdict
from connector.retention import Tier


def _pull(deadline: float | None = 100.0, host=None) -> Admission:
    return Admission(Verdict.PULL, "ok", ReadPlan(deadline=deadline, boot="b0", host=host))


def test_a_request_is_decided_once():
    ledger = Admissions()
    ledger.decide("r", _pull())
    with pytest.raises(RuntimeError, match="already admitted"):
        ledger.decide("r", Admission(Verdict.RECOMPUTE, "slower"))
    assert ledger.get("r").verdict is Verdict.PULL


def test_a_pull_past_its_deadline_before_it_is_handed_over_is_refused_with_its_plan_gone():
    ledger = Admissions()
    ledger.decide("r", _pull(deadline=100.0, host=((0x1000,), 8)))
    assert not ledger.past_deadline("r", 99.9) and ledger.past_deadline("r", 100.0)
    refused = ledger.refuse("r", "late")
    assert refused.verdict is Verdict.REFUSED and refused.plan == ReadPlan()
    ledger.allocated("r", 300)
    assert ledger.for_workers(["r"]) == {}  # nothing for the workers to read


def test_only_allocated_pulls_are_handed_to_the_workers_and_only_once():
    ledger = Admissions()
    ledger.decide("pull", _pull(host=((0x1000,), 8)))
    ledger.decide("declined", Admission(Verdict.RECOMPUTE, "slower"))
    ledger.decide("covered", _pull())  # allocated for nothing: prefill's own cache covered the offer by then
    ledger.decide("waiting", _pull())  # not allocated yet
    ledger.set_inline("pull", True)
    ledger.set_inline("declined", True)  # a declined offer is never inline (nor read)
    for request_id, tokens in (("pull", 300), ("declined", 0), ("covered", 0)):
        ledger.allocated(request_id, tokens)
    plans = ledger.for_workers(["pull", "declined", "covered", "waiting", "unknown"])
    assert list(plans) == ["pull"] and plans["pull"].inline and plans["pull"].tier is Tier.HOST
    assert ledger.for_workers(["pull"]) == {}
    assert not ledger.past_deadline("pull", 1e12)  # handed over: the workers check the deadline from now on
    assert ledger.get("declined").plan == ReadPlan()


def test_a_record_is_forgotten_in_one_place():
    ledger = Admissions()
    ledger.decide("r", _pull())
    assert ledger.drop("r").verdict is Verdict.PULL
    assert "r" not in ledger and len(ledger) == 0 and ledger.drop("r") is None
    assert ledger.refuse("r", "late") is None
