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
from turnkv.wire import OUTCOME_DOCS

REPO = Path(__file__).resolve().parents[2]
#: The values clients read in ``X-TurnKV-Reuse-Outcome`` (README.md "Reuse outcomes"), in label order.
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


def test_dispatch_is_typed():
    d = Dispatch(RequestKind.CHAT, "/v1/chat/completions", {}, "r", None, None)
    assert d.outcome is ReuseOutcome.NONE and d.avoid_decode == []
    assert not hasattr(d, "extra")


def outcome_table() -> str:
    """README.md's outcome table as ``turnkv.wire.OUTCOME_DOCS`` renders it."""
    rows = ["| outcome | what it means | healthy |", "|---|---|---|"]
    rows += [f"| `{o}` | {meaning} | {healthy} |" for o, (meaning, healthy, _) in OUTCOME_DOCS.items()]
    return "\n".join(rows)


def test_the_readme_documents_every_outcome_and_whether_it_is_healthy():
    """Issue #49: the README listed 6 of the 10 outcomes and the troubleshooting page called a healthy `recompute` a
    failure. Every outcome has its meaning, health and (where unhealthy) advice in one place, which the README's
    table and `turnkv smoke` read."""
    assert set(OUTCOME_DOCS) == set(ReuseOutcome)
    for o, (meaning, healthy, advice) in OUTCOME_DOCS.items():
        assert meaning and healthy and (advice or healthy == "yes"), o
    readme = (REPO / "README.md").read_text()
    assert outcome_table() in readme, "README.md's outcome table: regenerate it from OUTCOME_DOCS"
    assert "X-TurnKV-Prefill-Cached-Tokens" in readme
    assert "(../README.md#reuse-outcomes)" in (REPO / "docs" / "router.md").read_text()  # one table, not two
