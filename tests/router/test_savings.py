"""What reuse saved, per tenant, on the router's /metrics and in its EMF lines (router.savings)."""

from __future__ import annotations

import io

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router import savings
from router.app import FLOW
from router.auth import ApiKeys, parse_keys
from router.telemetry import EmfWriter
from tests.router.conftest import engines, router_over
from tests.router.test_flow_fake import MSGS, chat, next_turn
from turnkv import metric_names as mn
from turnkv import router_env


def _values(text: str) -> dict[tuple[str, str], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, s.labels.get("tenant", ""))] = s.value
    return out


def test_a_turn_saves_its_reused_tokens_at_the_measured_rate_and_the_engine_hour_price() -> None:
    s = savings.saved(1000, 0.002, 36.0)  # 2 s of prefill at $36 an engine-hour
    assert s is not None and s.seconds == pytest.approx(2.0) and s.dollars == pytest.approx(0.02)
    assert savings.saved(1000, 0.002, 0.0).dollars is None  # price unknown: seconds only
    assert savings.saved(0, 0.002, 36.0) is None and savings.saved(10, 0.0, 36.0) is None  # nothing / no rate yet


def test_the_ledger_gives_dollars_per_1k_turns_per_tenant_and_for_the_deployment() -> None:
    ledger = savings.Ledger()
    ledger.add("acme", savings.Saved(2.0, 0.02))
    ledger.add("acme", None)  # a first turn: counted, saved nothing
    ledger.add("", savings.Saved(1.0, 0.01))
    assert ledger.per_1k_turns("acme") == pytest.approx(10.0)  # $0.02 over 2 turns
    assert ledger.per_1k_turns("") == pytest.approx(10.0) and "default" in ledger.turns
    assert ledger.per_1k_turns() == pytest.approx(1000 * 0.03 / 3)
    assert savings.Ledger().per_1k_turns() == 0.0


def test_the_price_comes_from_the_environment_and_a_bad_one_is_refused(monkeypatch) -> None:
    from router.config import RouterConfig

    monkeypatch.setenv(router_env.PREFILL_PRICE, "7.9")
    assert RouterConfig(prefill=["http://p:1"], decode=["http://d:1"]).prefill_price_per_hour == 7.9
    monkeypatch.setenv(router_env.PREFILL_PRICE, "cheap")
    with pytest.raises(ValueError, match=router_env.PREFILL_PRICE):
        RouterConfig(prefill=["http://p:1"], decode=["http://d:1"])
    monkeypatch.delenv(router_env.PREFILL_PRICE)
    with pytest.raises(ValueError, match="prefill_price_per_hour"):
        RouterConfig(prefill=["http://p:1"], decode=["http://d:1"], prefill_price_per_hour=-1)


async def test_metrics_count_seconds_and_dollars_saved_per_tenant_and_per_1k_turns() -> None:
    keys = ApiKeys(parse_keys('{"tenants": {"acme": "acme-key-123", "globex": "globex-key-456"}}'))
    acme = {"Authorization": "Bearer acme-key-123"}
    globex = {"Authorization": "Bearer globex-key-456"}
    async with router_over(engines(1, "prefill"), engines(1, "decode"), keys=keys, prefill_price_per_hour=36.0,
                           emf=True) as (s, app):
        out = io.StringIO()
        app[FLOW].emf = EmfWriter(stream=out, max_lines=1)
        first = await chat(s, conversation="a", headers=acme)  # no reuse: the rate is measured here
        second = await chat(s, next_turn(MSGS, first["text"]), conversation="a", headers=acme)
        assert second["headers"]["X-TurnKV-Reuse-Outcome"] == "hit"
        reused = int(second["headers"]["X-TurnKV-Reused-Tokens"])
        await chat(s, conversation="g", headers=globex)
        async with s.get("/metrics") as r:
            v = _values(await r.text())
    rate = v[(mn.PROM_PREFILL_SECONDS_PER_TOKEN, "")]
    assert rate > 0
    assert v[(mn.PROM_TURNS + "_total", "acme")] == 2 and v[(mn.PROM_TURNS + "_total", "globex")] == 1
    seconds = v[(mn.PROM_PREFILL_SECONDS_SAVED + "_total", "acme")]
    assert seconds > 0 and (mn.PROM_PREFILL_SECONDS_SAVED + "_total", "globex") not in v
    assert reused > 100
    dollars = v[(mn.PROM_PREFILL_DOLLARS_SAVED + "_total", "acme")]
    assert dollars == pytest.approx(seconds * 36.0 / 3600)
    assert v[(mn.PROM_PREFILL_PRICE, "")] == 36.0
    assert v[(mn.PROM_TENANT_DOLLARS_PER_1K_TURNS, "acme")] == pytest.approx(1000 * dollars / 2)
    assert v[(mn.PROM_DOLLARS_PER_1K_TURNS, "")] == pytest.approx(1000 * dollars / 3)
    lines = [orjson.loads(line) for line in out.getvalue().splitlines()]
    [hit] = [x for x in lines if x.get(mn.PREFILL_TIME_SAVED)]
    assert hit[mn.TENANT] == "acme" and hit[mn.PREFILL_COST_SAVED] == pytest.approx(dollars)
    assert hit[mn.PREFILL_TIME_SAVED] == pytest.approx(seconds * 1000, rel=1e-3)
    [saved_directive] = [d for d in hit["_aws"]["CloudWatchMetrics"]
                         if any(m["Name"] == mn.PREFILL_COST_SAVED for m in d["Metrics"])]
    assert saved_directive["Dimensions"] == [[mn.DEPLOYMENT], [mn.DEPLOYMENT, mn.TENANT]]
    assert all(mn.TENANT not in x for x in lines if not x.get(mn.PREFILL_TIME_SAVED))  # dims only where used
