"""Store operations on the request path: a network store is bounded by ``store_timeout_ms`` (a store that stops
answering costs reuse, never the answer); the in-process store is awaited as it is (no task, no timer)."""

from __future__ import annotations

import asyncio
import time

from router.app import FLOW, METRICS
from router.state.memory import MemoryStore
from tests.router.conftest import engines, router_over
from tests.router.test_flow_fake import MSGS, chat, next_turn


class HangingStore(MemoryStore):
    """A network store that stopped answering: every operation waits forever."""

    does_io = True

    async def take(self, key):
        await asyncio.Event().wait()

    async def get(self, key):
        await asyncio.Event().wait()

    async def put(self, key, entry):
        await asyncio.Event().wait()


async def test_a_network_store_that_hangs_costs_reuse_within_store_timeout():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d, store=HangingStore(100), tunables={"store_timeout_ms": 100}) as (s, app):
        first = await chat(s, conversation="h")
        t0 = time.perf_counter()
        second = await chat(s, next_turn(MSGS, first["text"]), conversation="h")
        elapsed = time.perf_counter() - t0
        assert second["status"] == 200 and second["text"]
        assert second["headers"]["X-TurnKV-Reuse-Outcome"] == "store_error"
        assert elapsed < 1.5  # two bounded operations (take, put) of 0.1 s each, not a hang
        reg = app[METRICS].registry
        assert reg.get_sample_value("turnkv_router_store_errors_total", {"op": "take"}) >= 1
        assert reg.get_sample_value("turnkv_router_store_errors_total", {"op": "put"}) >= 2


async def test_the_in_process_store_is_awaited_without_a_task_and_a_network_one_is_bounded():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, app):
        flow = app[FLOW]
        assert isinstance(flow.store, MemoryStore)
        op = flow.store.take("absent")
        assert flow._bounded(op) is op  # the coroutine itself: no wait_for task, no timer
        assert await op is None
        first = await chat(s, conversation="m")
        second = await chat(s, next_turn(MSGS, first["text"]), conversation="m")
        assert second["headers"]["X-TurnKV-Reuse-Outcome"] == "hit"
        flow.store = HangingStore(10)
        op = flow.store.take("absent")
        bounded = flow._bounded(op)
        assert bounded is not op
        t0 = time.perf_counter()
        try:
            await bounded
        except TimeoutError:
            pass
        else:
            raise AssertionError("a hanging network store was not bounded")
        assert time.perf_counter() - t0 < 1.0
