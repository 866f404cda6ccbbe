"""The typed request vocabulary (``router.outcomes``) stays byte-identical on the wire and in step with the docs."""

from __future__ import annotations

import re
from pathlib import Path

import orjson
from prometheus_client import generate_latest

from router import telemetry
from router.app import ROUTES
from router.dispatch import Dispatch
from router.outcomes import RequestKind, ReuseOutcome

REPO = Path(__file__).resolve().parents[2]
#: The values clients read in ``X-TurnKV-Reuse-Outcome`` (docs/router.md "Reuse outcomes"), in label order.
DOCUMENTED = ("hit", "miss", "mismatch", "expired", "refused", "recompute", "token_mismatch", "disabled",
              "store_error", "none")


def test_values_are_the_documented_header_values():
    assert tuple(o.value for o in ReuseOutcome) == DOCUMENTED
    for o in ReuseOutcome:  # every way a member leaves the process gives its value
        assert str(o) == f"{o}" == o.value and o == o.value and hash(o) == hash(o.value)
        assert f": turnkv reuse_outcome={o} ".encode() == f": turnkv reuse_outcome={o.value} ".encode()
    assert {k.value for k in RequestKind} == {"chat", "completion"}
    assert ROUTES == {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


def test_prometheus_labels_come_from_the_enum():
    assert telemetry.OUTCOMES == tuple(ReuseOutcome) == DOCUMENTED
    metrics = telemetry.Metrics()
    for o in telemetry.OUTCOMES:
        metrics.reuse.labels(o).inc()
        metrics.ttft.labels(o).observe(0.1)
    text = generate_latest(metrics.registry).decode()
    assert set(re.findall(r'turnkv_router_reuse_decisions_total\{reuse="([^"]*)"\}', text)) == set(DOCUMENTED)
    assert "ReuseOutcome." not in text


def test_emf_field_is_the_value():
    for o in ReuseOutcome:
        record = telemetry.emf_record(namespace="ns", deployment="d", outcome=o, prompt_tokens=10, ttft_ms=None,
                                      error=False, reused_tokens=0, prefill_ms=None, saved_ms=None, fields={},
                                      timestamp_ms=0)
        line = orjson.loads(orjson.dumps(record))
        assert line["ReuseOutcome"] == o.value and line["ReuseHit"] == (1 if o.value == "hit" else 0)


def test_every_outcome_is_documented():
    text = (REPO / "docs" / "router.md").read_text()
    section = text.split("## Reuse outcomes", 1)[1].split("\n## ", 1)[0]
    missing = [o.value for o in ReuseOutcome if f"`{o.value}`" not in section]
    assert not missing, f"docs/router.md 'Reuse outcomes' does not list {missing}"


def test_dispatch_is_typed():
    d = Dispatch(RequestKind.CHAT, "/v1/chat/completions", {}, "r", None, None)
    assert d.outcome is ReuseOutcome.NONE and d.avoid_decode == []
    assert not hasattr(d, "extra")
