"""The lease and evictions routes share their collective_rpc calls (issue 26, item 7).

Each ``collective_rpc`` reaches every TP worker and, with async scheduling, waits behind the running batch on
each decode engine. Routers poll the feed every second and renew leases: concurrent calls now share one RPC,
and the feed is served from a short cache to callers whose cursor it covers, without acknowledging a renewal
before every rank made it, and without a feed read missing an eviction.
"""

from __future__ import annotations

import asyncio
import time
import types

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("vllm")

import httpx
from fastapi import FastAPI

from connector import leases
from connector.leases import EngineRpcs, LeaseEndpoints, RpcBatcher
from router.engines.evictions import EvictionFeed
from turnkv import wire

SECRET = b"s" * 32
MODEL = "model-x"


class Rank:
    """One TP worker: retained requests and an evictions feed (announcement numbers, as the connector's)."""

    def __init__(self) -> None:
        self._reqs_to_send: dict[str, float] = {}
        self.announced: list[tuple[int, str, float]] = []

    def announce(self, request_id: str, until: float) -> None:
        self.announced.append((len(self.announced) + 1, request_id, until))

    def turnkv_evictions(self, since: int) -> dict:
        events = [e for e in self.announced if e[0] > since]
        return {"epoch": "e", "seq": events[-1][0] if events else len(self.announced),
                "evicted": [[rid, until] for _, rid, until in events]}


class FakeClient:
    """vLLM's engine client as the routes use it: ``collective_rpc`` runs the worker method on every rank (the
    real ``renew_on_worker`` / ``evictions_on_worker``) after ``latency`` (the batch it waits behind)."""

    def __init__(self, monkeypatch, tp: int = 2, latency: float = 0.02) -> None:
        import vllm.distributed.kv_transfer as kv_transfer

        self.ranks = [Rank() for _ in range(tp)]
        self.latency = latency
        self.calls: list[tuple[str, tuple]] = []
        self.gate: asyncio.Event | None = None  # when set by a test, the RPC waits for it after it started
        self.started = asyncio.Event()
        self._current: Rank | None = None
        monkeypatch.setattr(kv_transfer, "get_kv_transfer_group",
                            lambda: types.SimpleNamespace(connector_worker=self._current))
        monkeypatch.setattr(leases.time, "perf_counter", lambda: 1000.0)

    async def collective_rpc(self, method: str, args: tuple = ()) -> list:
        self.calls.append((method, args))
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        await asyncio.sleep(self.latency)
        fn = {leases.WORKER_METHOD: leases.renew_on_worker, leases.FEED_METHOD: leases.evictions_on_worker}[method]
        out = []
        for rank in self.ranks:  # each rank runs it when the call reaches it, not when it was submitted
            self._current = rank
            out.append(fn(None, *args))
        return out

    def count(self, method: str) -> int:
        return sum(m == method for m, _ in self.calls)


def run(coro):
    return asyncio.run(coro)


# --- the batcher --------------------------------------------------------------------------------------------


def test_calls_that_arrive_while_one_is_in_flight_share_the_next_one():
    async def main():
        runs: list[list[int]] = []
        gate = asyncio.Event()

        async def work(items):
            runs.append(items)
            await gate.wait()
            return sum(items)

        batcher = RpcBatcher(work)
        first = asyncio.ensure_future(batcher.submit(1))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        later = [asyncio.ensure_future(batcher.submit(n)) for n in (2, 3, 4)]
        await asyncio.sleep(0)
        assert runs == [[1]]  # the later ones did not join the call already in flight
        gate.set()
        assert await first == 1 and await asyncio.gather(*later) == [9, 9, 9]
        assert runs == [[1], [2, 3, 4]] and (batcher.runs, batcher.items) == (2, 4)

    run(main())


def test_an_error_reaches_every_caller_of_that_run_and_the_next_run_works():
    async def main():
        calls = []

        async def work(items):
            calls.append(items)
            if len(calls) == 1:
                raise RuntimeError("engine dead")
            return len(items)

        batcher = RpcBatcher(work)
        results = await asyncio.gather(batcher.submit("a"), batcher.submit("b"), return_exceptions=True)
        assert [type(r) for r in results] == [RuntimeError, RuntimeError]
        assert await batcher.submit("c") == 1

    run(main())


# --- renewals ------------------------------------------------------------------------------------------------


def test_concurrent_renewals_take_one_rpc_and_each_gets_its_own_answer(monkeypatch):
    async def main():
        client = FakeClient(monkeypatch, tp=4)
        for rank in client.ranks:
            rank._reqs_to_send.update(a=1010.0, b=1010.0, c=1010.0)
        rpcs = EngineRpcs(client, cache_seconds=0)
        answers = await asyncio.gather(rpcs.renew(["a"], 60), rpcs.renew(["b"], 120), rpcs.renew(["a", "c"], 30),
                                       rpcs.renew(["nope"], 60))
        assert client.count(leases.WORKER_METHOD) == 1  # before: one per call (4)
        [(_, (ids, ttls, boots))] = client.calls
        assert sorted(ids) == ["a", "b", "c", "nope"] and ttls == {"a": 60, "b": 120, "c": 30, "nope": 60}
        assert boots == {}
        for per_worker in answers:
            assert len(per_worker) == 4 and all(w == {"a": 1060.0, "b": 1120.0, "c": 1030.0} for w in per_worker)

    run(main())


def test_renewals_a_little_apart_share_the_batching_window(monkeypatch):
    async def main():
        async def three_apart(batch_seconds):
            client = FakeClient(monkeypatch, tp=2, latency=0)
            rpcs = EngineRpcs(client, cache_seconds=0, batch_seconds=batch_seconds)
            calls = []
            for rid in ("a", "b", "c"):
                calls.append(asyncio.ensure_future(rpcs.renew([rid], 60)))
                await asyncio.sleep(0.02)
            await asyncio.gather(*calls)
            return client.count(leases.WORKER_METHOD)

        assert await three_apart(0) == 3 and await three_apart(0.2) == 1

    run(main())


def test_a_renewal_is_acknowledged_only_after_every_rank_renewed_it(monkeypatch):
    """A renewal arriving while another is in flight is not answered by that one: its own RPC must reach every
    rank first."""
    async def main():
        client = FakeClient(monkeypatch, tp=2)
        for rank in client.ranks:
            rank._reqs_to_send.update(a=1010.0, b=1010.0)
        client.gate = asyncio.Event()
        rpcs = EngineRpcs(client, cache_seconds=0)
        first = asyncio.ensure_future(rpcs.renew(["a"], 60))
        await client.started.wait()
        second = asyncio.ensure_future(rpcs.renew(["b"], 60))
        await asyncio.sleep(0.01)
        assert not second.done() and all(r._reqs_to_send["b"] == 1010.0 for r in client.ranks)
        client.gate.set()
        await first
        per_worker = await second
        assert all(r._reqs_to_send["b"] == 1060.0 for r in client.ranks) and all(w["b"] == 1060.0 for w in per_worker)
        assert [args[0] for _, args in client.calls] == [["a"], ["b"]]

    run(main())


# --- the evictions feed --------------------------------------------------------------------------------------


def test_concurrent_feed_polls_take_one_rpc(monkeypatch):
    async def main():
        client = FakeClient(monkeypatch, tp=8)
        for rank in client.ranks:
            rank.announce("x", 5e9)
        rpcs = EngineRpcs(client, cache_seconds=0)
        answers = await asyncio.gather(*(rpcs.evictions(0) for _ in range(16)))
        assert client.count(leases.FEED_METHOD) == 1  # before: 16
        assert all(a["evicted"] == [["x", 5e9]] and a["seq"] == 1 and a["age"] == 0.0 for a in answers)

    run(main())


def test_a_poll_during_a_read_waits_for_the_next_read_and_sees_what_was_announced_meanwhile(monkeypatch):
    async def main():
        client = FakeClient(monkeypatch, tp=2)
        client.gate = asyncio.Event()
        rpcs = EngineRpcs(client, cache_seconds=0)
        first = asyncio.ensure_future(rpcs.evictions(0))
        await client.started.wait()
        for rank in client.ranks:  # announced after the first read was sent
            rank.announce("late", 5e9)
        second = asyncio.ensure_future(rpcs.evictions(0))
        client.gate.set()
        assert (await first)["evicted"] in ([], [["late", 5e9]])
        assert (await second)["evicted"] == [["late", 5e9]]

    run(main())


def test_the_cached_feed_serves_only_cursors_it_covers_and_says_how_old_it_is(monkeypatch):
    async def main():
        now = [100.0]
        client = FakeClient(monkeypatch, tp=2, latency=0)
        for rank in client.ranks:
            rank.announce("a", 5e9)
            rank.announce("b", 5e9)
        rpcs = EngineRpcs(client, cache_seconds=0.5, clock=lambda: now[0])
        assert (await rpcs.evictions(1))["evicted"] == [["b", 5e9]]
        now[0] = 100.3
        hit = await rpcs.evictions(2)  # a router further along: the cached read covers it (b repeated, harmless)
        assert client.count(leases.FEED_METHOD) == 1 and hit["age"] == pytest.approx(0.3) and hit["seq"] == 2
        fresh = await rpcs.evictions(0)  # a router from the start: the cache lacks "a", read again
        assert client.count(leases.FEED_METHOD) == 2 and fresh["evicted"] == [["a", 5e9], ["b", 5e9]]
        assert fresh["age"] == 0.0
        for rank in client.ranks:
            rank.announce("c", 5e9)
        now[0] = 100.9  # past the cache: a new read, which has "c"
        assert (await rpcs.evictions(2))["evicted"] == [["c", 5e9]] and client.count(leases.FEED_METHOD) == 3

    run(main())


def test_the_router_counts_a_cached_feed_as_read_when_the_engine_read_it():
    feed = EvictionFeed()
    feed.apply({"epoch": "e", "seq": 0, "evicted": [], "age": 0.4}, sent_at=100.0)
    assert feed.read_at == pytest.approx(99.6)
    for odd in (-1, "x", True, None):
        feed.apply({"epoch": "e", "seq": 0, "evicted": [], "age": odd}, sent_at=200.0)
        assert feed.read_at == 200.0


# --- through the routes, as routers call them -------------------------------------------------------------


def app_with(client) -> FastAPI:
    app = FastAPI()
    LeaseEndpoints().attach_router(app)
    app.state.turnkv_engine_client = client
    app.state.turnkv_offer_secret = SECRET
    app.state.turnkv_model = MODEL
    app.state.turnkv_engine_id = "decode-0"
    return app


def signed(request_id: str, engine_id: str = "decode-0", boot: str | None = None) -> dict:
    params = {"remote_request_id": request_id, "remote_blocks_expiry_time": 1010.0, "remote_engine_id": engine_id}
    if boot is not None:
        params[wire.BOOT] = boot
    return wire.sign_offer(SECRET, params, time.time() + 100, MODEL)


def test_routers_polling_and_renewing_at_once_share_rpcs(monkeypatch):
    async def main():
        client = FakeClient(monkeypatch, tp=8)
        for rank in client.ranks:
            rank._reqs_to_send.update({f"r{i}": 1010.0 for i in range(6)})
        transport = httpx.ASGITransport(app=app_with(client))
        async with httpx.AsyncClient(transport=transport, base_url="http://decode") as http:
            polls = [http.get(f"{wire.EVICTIONS_ROUTE}?since=0") for _ in range(6)]
            renews = [http.post(wire.LEASE_ROUTE, json={"offers": [signed(f"r{i}")], "ttl": 60}) for i in range(6)]
            answers = await asyncio.gather(*polls, *renews)
        assert all(a.status_code == 200 for a in answers)
        assert client.count(leases.FEED_METHOD) == 1 and client.count(leases.WORKER_METHOD) == 1  # before: 6 and 6
        for i, answer in enumerate(answers[6:]):
            body = answer.json()
            assert list(body["renewed"]) == [f"r{i}"] and body["missing"] == []
            assert body["renewed"][f"r{i}"]["remote_blocks_expiry_time"] == 1060.0

    run(main())


def test_the_lease_route_renews_only_offers_of_this_engine_and_this_boot(monkeypatch):
    """Every engine of a deployment signs with the same secret: a validly signed offer of another engine, or of an
    earlier process of this one (request ids may repeat after a restart), names no lease here."""

    async def main():
        client = FakeClient(monkeypatch, tp=2)
        for i, rank in enumerate(client.ranks):
            rank._reqs_to_send.update(r1=1010.0, r2=1010.0, r3=1010.0)
            rank.turnkv_own_boot = lambda stamp, i=i: stamp is None or stamp.split(".")[i] == f"now{i}"
        transport = httpx.ASGITransport(app=app_with(client))
        async with httpx.AsyncClient(transport=transport, base_url="http://decode") as http:
            other_engine = await http.post(wire.LEASE_ROUTE, json={"offers": [signed("r1", "decode-1")], "ttl": 60})
            answer = await http.post(wire.LEASE_ROUTE, json={"offers": [
                signed("r2", boot="now0.now1"), signed("r3", boot="old0.old1")], "ttl": 60})
        assert other_engine.status_code == 403
        body = answer.json()
        assert list(body["renewed"]) == ["r2"] and body["missing"] == ["r3"]
        assert all(rank._reqs_to_send["r3"] == 1010.0 and rank._reqs_to_send["r1"] == 1010.0
                   for rank in client.ranks)

    run(main())
