"""The engine pools' fair queues over fake engines (router.fairqueue): prefill's (prefill_fair_tokens), where a light
tenant's request goes to the engines while a heavy tenant's wait in the router, and nothing stays held when a waiting
client goes away or the engines fail; decode's (decode_fair_sequences), where a light request is not queued at the
engine behind a heavy tenant's long generations."""

from __future__ import annotations

import asyncio

from bench.engine_clock import ComputeModel
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
        p[0].fault = {"delay": 1.0}
        burst = [ask(s, {}, i) for i in range(6)]
        # all six at the prefill engine at once (each held there 1 s): none waited for another's room. A new router's
        # first requests take 0.15-0.2 s to get there on this machine: polled, not a fixed sleep
        for _ in range(40):
            if p[0].stats["running"] == 6:
                break
            await asyncio.sleep(0.02)
        assert p[0].stats["running"] == 6 and app[FLOW].engine_gate.waits == 0
        assert [(await b)["status"] for b in burst] == [200] * 6


async def test_an_unstreamed_answer_gives_its_prefill_share_back_when_prefill_has_answered():
    """A unary answer shows no first token: its share of the prefill pool goes back when prefill has answered, not
    when decode has generated it all, so a tenant's long unary generations do not hold prefill (idle here) from it."""
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d, keys=ApiKeys(parse_keys(KEYS)), tunables=FAIR) as (s, app):
        d[0].fault = {"delay": 1.0}  # every generation takes a second
        light = ask(s, LIGHT, 0)  # the heavy tenant is not alone
        await asyncio.sleep(0.05)
        heavy = [ask(s, HEAVY, i) for i in range(10)]  # 3,250 tokens: more than the pool's 2,000 at once
        for _ in range(40):
            if p[0].stats["requests"] == 11:
                break
            await asyncio.sleep(0.02)
        # within 0.8 s, while the first generations still run: some of the burst waited for room, only for prefill
        assert p[0].stats["requests"] == 11, "all prefilled while the first ones decode"
        assert [(await r)["status"] for r in [light, *heavy]] == [200] * 11
        assert app[FLOW].engine_gate.queue.total == 0


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


# -- the decode pool's fair queue (decode_fair_sequences) -------------------------------------------------------------

PREFILL_OFF = int(params.get("prefill_fair_tokens").maximum)
#: decode steps of 10 ms plus 1 ms per sequence; prefill answers at once (no prefill clock)
DECODE_TIME = ComputeModel("test-decode", (0, 1000), (0.0, 0.0), 8192, 0.010, 0.001)


async def _long_generations(decode_fair_sequences: int) -> tuple[list[str], float | None]:
    """A tenant's six 40-token generations on a decode engine that runs two sequences at once, then another
    tenant's 4-token request: the order the answers end in, and the decode pool's waits."""
    p = engines(1, "prefill")
    d = engines(1, "decode", compute=DECODE_TIME, max_num_seqs=2)
    keys = ApiKeys(parse_keys(KEYS))
    tunables = {"decode_fair_sequences": decode_fair_sequences, "prefill_fair_tokens": PREFILL_OFF}
    async with router_over(p, d, keys=keys, tunables=tunables) as (s, app):
        ended: list[str] = []

        async def one(name: str, headers: dict[str, str], tokens: int) -> None:
            body = [{"role": "user", "content": f"{name} " + MSGS[0]["content"]}]
            assert (await chat(s, body, conversation=None, headers=headers, max_tokens=tokens))["status"] == 200
            ended.append(name)

        heavy = [asyncio.create_task(one(f"heavy{i}", HEAVY, 40)) for i in range(6)]
        await asyncio.sleep(0.1)  # heavy's first two generating
        await one("light", LIGHT, 4)
        await asyncio.gather(*heavy)
        gate = app[FLOW].decode_gate.queue
        assert gate.total == 0 and gate.waiting == 0 and gate._tenants == {}, "every slot came back"
        return ended, app[METRICS].registry.get_sample_value("turnkv_router_decode_queue_waits_total")



async def test_a_light_tenant_is_not_queued_behind_a_heavy_tenants_long_generations():
    """With the decode pool's fair queue the heavy tenant's surplus (4 of 6, past the engine's 2 sequences) waits in
    the router, and the light request goes to decode ahead of it: it ends right after the first two generations."""
    ended, waits = await _long_generations(2)
    assert ended.index("light") <= 2, ended
    assert waits == 4


async def test_without_it_the_light_request_waits_behind_every_generation_first_come():
    """Off (the maximum), all six go to decode at once and its first-come queue puts the light request last."""
    ended, waits = await _long_generations(int(params.get("decode_fair_sequences").maximum))
    assert ended[-1] == "light", ended
    assert waits == 0
