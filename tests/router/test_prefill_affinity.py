"""Prefill affinity over fake engines: conversations sharing a system prompt go to one prefill engine (its prefix
cache), bounded by load, per tenant, in pull and push mode, with failover (router.engines.prefix)."""

from __future__ import annotations

import asyncio

from router.app import CONFIG, METRICS
from router.auth import ApiKeys, parse_keys
from tests.router.conftest import engines, router_over
from tests.router.test_flow_fake import chat

TENANTS = [f"tenant{i}" for i in range(16)]  # all 16 on one of two engines: 1 run in 32,768
KEYS = ApiKeys(parse_keys("\n".join(f"{t}:{t}-key-0123456789" for t in TENANTS)))


def system(name: str) -> dict:
    return {"role": "system", "content": f"You are agent {name}. Tools follow. " * 60}


def conversation(prompt: str, i: int) -> list[dict]:
    return [system(prompt), {"role": "user", "content": f"task {i}"}]


async def served_by(s, p, messages, headers=None) -> int:
    """Send one request and say which prefill engine took its prefill leg (requests one at a time)."""
    before = [e.stats["prefill"] for e in p]
    out = await chat(s, messages, conversation=None, headers=headers)
    assert out["status"] == 200, out
    changed = [i for i, e in enumerate(p) if e.stats["prefill"] != before[i]]
    assert len(changed) == 1
    return changed[0]


def choices(app, reason: str) -> float:
    return app[METRICS].registry.get_sample_value("turnkv_router_prefill_choices_total", {"reason": reason}) or 0.0


async def test_conversations_sharing_a_system_prompt_land_on_one_prefill_engine_and_are_counted():
    p, d = engines(2, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, app):
        served = {await served_by(s, p, conversation("coder", i)) for i in range(8)}
        assert len(served) == 1
        # requests without a shared prefix are chosen by load, as before (ties alternate)
        plain = {await served_by(s, p, [{"role": "user", "content": f"hi {i}"}]) for i in range(4)}
        assert plain == {0, 1}
        assert choices(app, "affinity") == 8 and choices(app, "no_key") == 4 and choices(app, "load") == 0


async def test_distinct_prefixes_spread_and_each_stays_on_its_engine():
    p, d = engines(2, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, _):
        homes = {}
        for name in (f"agent-{k}" for k in range(8)):
            first = await served_by(s, p, conversation(name, 0))
            assert await served_by(s, p, conversation(name, 1)) == first  # back to back: load alone would alternate
            homes[name] = first
        assert set(homes.values()) == {0, 1}


async def test_tenants_with_the_same_prompt_have_their_own_homes():
    p, d = engines(2, "prefill"), engines(1, "decode")
    async with router_over(p, d, keys=KEYS) as (s, _):
        homes = {}
        for tenant in TENANTS:
            headers = {"Authorization": f"Bearer {tenant}-key-0123456789"}
            first = await served_by(s, p, conversation("shared", 0), headers)
            assert await served_by(s, p, conversation("shared", 1), headers) == first
            homes[tenant] = first
        assert set(homes.values()) == {0, 1}  # not every tenant on one engine: their caches are apart anyway


async def test_a_load_burst_spills_past_the_slack_to_the_other_engine():
    p, d = engines(2, "prefill"), engines(1, "decode")
    for e in p:
        e.fault = {"delay": 0.4}  # prefill legs stay in flight while the burst arrives
    async with router_over(p, d, tunables={"prefill_affinity_slack": 2}) as (s, app):
        await asyncio.gather(*(chat(s, conversation("burst", i), conversation=None) for i in range(12)))
        counts = sorted(e.stats["prefill"] for e in p)
        assert counts[0] >= 2 and counts[1] > counts[0]  # the home takes the slack's worth more, the rest spills
        assert choices(app, "load") >= 2 and choices(app, "affinity") + choices(app, "load") == 12


async def test_slack_zero_turns_affinity_off_live():
    p, d = engines(2, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, app):
        assert len({await served_by(s, p, conversation("coder", i)) for i in range(4)}) == 1
        app[CONFIG].tunables["prefill_affinity_slack"] = 0  # as an SSM re-read applies it (router.reload)
        assert {await served_by(s, p, conversation("coder", i)) for i in range(4)} == {0, 1}
        assert choices(app, "no_key") == 4


async def test_a_failing_home_engine_fails_over_and_the_prefix_follows_to_the_next_home():
    p, d = engines(2, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, app):
        home = await served_by(s, p, conversation("coder", 0))
        p[home].fault = {"status": 500}
        for i in range(3):
            out = await chat(s, conversation("coder", i + 1), conversation=None)
            assert out["status"] == 200
        assert p[1 - home].stats["prefill"] == 3 and p[home].stats["errors"] == 3
        retries = app[METRICS].registry.get_sample_value("turnkv_router_retries_total",
                                                         {"leg": "prefill", "reason": "http_500"})
        assert retries == 3


async def test_push_mode_keeps_a_prefix_on_one_prefill_engine():
    p, d = engines(2, "prefill", mode="push"), engines(1, "decode", mode="push")
    async with router_over(p, d, mode="push", identity=True) as (s, app):
        assert len({await served_by(s, p, conversation("coder", i)) for i in range(6)}) == 1
        assert choices(app, "affinity") == 6
