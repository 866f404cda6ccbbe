"""The prefill pool's fair queue over fake engines (router.fairqueue, prefill_fair_tokens): a light tenant's request
goes to the engines while a heavy tenant's wait in the router, and nothing stays held when a waiting client goes
away or the engines fail."""

from __future__ import annotations

import asyncio

from router.app import FLOW, METRICS
from router.auth import ApiKeys, parse_keys
from tests.router.conftest import engines, router_over
from tests.router.test_flow_fake import MSGS, chat
from turnkv import params

KEYS = '{"tenants": {"light": "light-key-0001", "heavy": "heavy-key-0001"}}'
LIGHT = {"Authorization": "Bearer light-key-0001"}
HEAVY = {"Authorization": "Bearer heavy-key-0001"}
#: MSGS is about 325 tokens by the router's estimate (body bytes / 4): six fit in 2,000
FAIR = {"prefill_fair_tokens": 2000}


def ask(s, headers, i: int):
    return asyncio.create_task(chat(s, [{"role": "user", "content": f"{i} " + MSGS[0]["content"]}], conversation=None,
                                    headers=headers))


async def _burst(fair_tokens: int) -> tuple[int, int, list[int], float, tuple[float, float]]:
    """A light request in flight, a heavy burst of 8, then a second light request: the prefill engine's requests in
    flight and the router's waiters just after, every status, and the second light request's seconds."""
    p, d = engines(1, "prefill"), engines(1, "decode")
    keys = ApiKeys(parse_keys(KEYS))
    async with router_over(p, d, keys=keys, tunables={"prefill_fair_tokens": fair_tokens}) as (s, app):
        p[0].fault = {"delay": 0.6}
        first = ask(s, LIGHT, 0)
        await asyncio.sleep(0.1)
        heavy = [ask(s, HEAVY, i) for i in range(8)]
        await asyncio.sleep(0.15)
        t0 = asyncio.get_running_loop().time()
        second = ask(s, LIGHT, 99)
        await asyncio.sleep(0.15)
        running, waiting = p[0].stats["running"], app[FLOW].engine_gate.queue.waiting
        sample = app[METRICS].registry.get_sample_value
        metrics = (sample("turnkv_router_fair_queue_waiting"), sample("turnkv_router_fair_queue_waits_total"))
        second_status = (await second)["status"]
        light_seconds = asyncio.get_running_loop().time() - t0
        statuses = [second_status, (await first)["status"], *[(await h)["status"] for h in heavy]]
        gate = app[FLOW].engine_gate.queue
        assert gate.total == 0 and gate.waiting == 0, "every slot came back"
        return running, waiting, statuses, light_seconds, metrics


async def test_a_light_tenant_goes_ahead_of_a_heavy_tenants_burst():
    running, waiting, statuses, light_seconds, metrics = await _burst(2000)
    # light 2 + heavy 6 (the sixth took heavy from under its level, 1,675 tokens, to 1,950); its other 2 wait
    assert (running, waiting) == (8, 2)
    assert metrics == (2, 2)  # turnkv_router_fair_queue_waiting, turnkv_router_fair_queue_waits_total
    assert statuses == [200] * 10
    assert light_seconds < 1.0, "the second light request went at once, not after the heavy burst"


async def test_with_the_queue_off_the_burst_goes_to_the_engine_first_come():
    off = params.get("prefill_fair_tokens").maximum
    running, waiting, statuses, _, metrics = await _burst(int(off))
    assert (running, waiting) == (10, 0) and statuses == [200] * 10 and metrics == (0, 0)


async def test_a_lone_tenant_is_never_queued():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d, tunables={"prefill_fair_tokens": 64}) as (s, app):
        p[0].fault = {"delay": 0.3}
        burst = [ask(s, {}, i) for i in range(6)]
        await asyncio.sleep(0.15)
        assert p[0].stats["running"] == 6 and app[FLOW].engine_gate.waits == 0
        assert [(await b)["status"] for b in burst] == [200] * 6


async def test_a_waiting_client_that_goes_away_and_failing_engines_leave_nothing_held():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d, keys=ApiKeys(parse_keys(KEYS)), tunables=FAIR) as (s, app):
        gate = app[FLOW].engine_gate.queue
        p[0].fault = {"delay": 0.5}
        light = ask(s, LIGHT, 0)
        await asyncio.sleep(0.1)
        heavy = [ask(s, HEAVY, i) for i in range(8)]
        await asyncio.sleep(0.15)
        assert gate.waiting == 2
        for h in heavy[6:]:  # the waiting clients hang up
            h.cancel()
        await asyncio.gather(*heavy[6:], return_exceptions=True)
        for _ in range(50):
            if gate.waiting == 0:
                break
            await asyncio.sleep(0.02)
        assert gate.waiting == 0
        assert [(await h)["status"] for h in [light, *heavy[:6]]] == [200] * 7
        assert gate.total == 0 and gate._tenants == {}
        p[0].fault = {"status": 500}  # every prefill fails (retried, then 502): each request's slot comes back
        failed = await asyncio.gather(*(ask(s, HEAVY if i % 2 else LIGHT, i) for i in range(6)))
        assert {f["status"] for f in failed} == {502}
        assert gate.total == 0 and gate.waiting == 0 and gate._tenants == {}
