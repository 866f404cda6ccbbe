"""collective_rpc calls per second that routers' feed polls and lease renewals cost one decode engine.

Each of ``--routers`` routers reads the engine's evictions feed every ``--interval`` seconds (its own phase, as
``router.engines.evictions.evictions_loop`` does) and renews ``--renewals`` leases per second (Poisson), through
the real routes (``connector.leases``, in-process over ASGI). The engine client is a fake whose
``collective_rpc`` takes ``--latency`` seconds (the running batch it waits behind on every TP worker) and counts
calls. Variants: ``direct`` (one collective_rpc per HTTP call: the routes before issue 26 item 7), ``shared``
(concurrent calls share one; no feed cache, no lease batching window) and ``shared+cache`` (as deployed: the
feed cache ``--cache-ms`` and the lease window ``--batch-ms``).

    python -m bench.lease_rpcs --routers 4 --seconds 20
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

import httpx
from fastapi import FastAPI

from connector import leases
from turnkv import wire

SECRET = b"b" * 32
MODEL = "bench-model"


class CountingClient:
    def __init__(self, tp: int, latency: float) -> None:
        self.tp, self.latency = tp, latency
        self.calls: dict[str, int] = {leases.WORKER_METHOD: 0, leases.FEED_METHOD: 0}

    async def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        self.calls[method] += 1
        await asyncio.sleep(self.latency)
        if method == leases.WORKER_METHOD:
            ids, ttl = args
            now = time.perf_counter()
            return [{rid: now + float(ttl[rid] if isinstance(ttl, dict) else ttl) for rid in ids}] * self.tp
        return [{"epoch": "e", "seq": 0, "evicted": [], "hosted": []}] * self.tp


class DirectRpcs:
    """The routes before item 7: one collective_rpc per HTTP call."""

    def __init__(self, client: CountingClient) -> None:
        self._client = client

    async def renew(self, request_ids: list[str], ttl: float) -> list[dict[str, float]]:
        return await self._client.collective_rpc(leases.WORKER_METHOD, args=(request_ids, ttl))

    async def evictions(self, since: int) -> dict[str, Any]:
        return leases.merge_feeds(await self._client.collective_rpc(leases.FEED_METHOD, args=(since,)))


async def play(variant: str, routers: int, interval: float, renewals: float, seconds: float, tp: int,
               latency: float, cache_ms: float, batch_ms: float, seed: int) -> dict[str, float]:
    client = CountingClient(tp, latency)
    app = FastAPI()
    leases.LeaseEndpoints().attach_router(app)
    app.state.turnkv_engine_client, app.state.turnkv_offer_secret, app.state.turnkv_model = client, SECRET, MODEL
    if variant == "direct":
        app.state.turnkv_rpcs = DirectRpcs(client)
    else:
        cached = "cache" in variant
        app.state.turnkv_rpcs = leases.EngineRpcs(client, cache_seconds=cache_ms / 1000 if cached else 0,
                                                  batch_seconds=batch_ms / 1000 if cached else 0)
    rng = random.Random(seed)
    deadline = time.monotonic() + seconds
    answered = {"feed": 0, "lease": 0}
    lease_seconds: list[float] = []

    async def poller(http: httpx.AsyncClient) -> None:
        await asyncio.sleep(rng.uniform(0, interval))
        seq = 0
        while time.monotonic() < deadline:
            body = (await http.get(f"{wire.EVICTIONS_ROUTE}?since={seq}")).json()
            seq = body["seq"]
            answered["feed"] += 1
            await asyncio.sleep(interval)

    async def renew_one(http: httpx.AsyncClient, request_id: str) -> None:
        offer = wire.sign_offer(SECRET, {wire.REMOTE_REQUEST_ID: request_id, wire.REMOTE_BLOCKS_EXPIRY_TIME: 1.0},
                                time.time() + 100, MODEL)
        sent = time.monotonic()
        answer = await http.post(wire.LEASE_ROUTE, json={"offers": [offer], "ttl": 60})
        lease_seconds.append(time.monotonic() - sent)
        assert answer.status_code == 200 and answer.json()["renewed"], answer.text
        answered["lease"] += 1

    async def renewer(http: httpx.AsyncClient, n: int) -> None:
        """Renewals arrive at their own times (agents' calls), whether or not earlier ones were answered."""
        calls, i = [], 0
        while True:
            await asyncio.sleep(rng.expovariate(renewals))
            if time.monotonic() >= deadline:
                break
            calls.append(asyncio.ensure_future(renew_one(http, f"r{n}-{i}")))
            i += 1
        await asyncio.gather(*calls)

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://decode") as http:
        tasks = [poller(http) for _ in range(routers)]
        if renewals > 0:
            tasks += [renewer(http, n) for n in range(routers)]
        started = time.monotonic()
        await asyncio.gather(*tasks)
        took = time.monotonic() - started
    return {"feed_calls": answered["feed"] / took, "feed_rpcs": client.calls[leases.FEED_METHOD] / took,
            "lease_calls": answered["lease"] / took, "lease_rpcs": client.calls[leases.WORKER_METHOD] / took,
            "lease_ms": 1000 * sum(lease_seconds) / max(1, len(lease_seconds))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--routers", type=int, default=4)
    parser.add_argument("--interval", type=float, default=1.0, help="feed poll interval per router (s)")
    parser.add_argument("--renewals", type=float, default=2.0, help="lease renewals per second per router")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--latency", type=float, default=0.05, help="seconds each collective_rpc takes")
    parser.add_argument("--cache-ms", type=float, default=500.0)
    parser.add_argument("--batch-ms", type=float, default=200.0)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    print(f"{args.routers} routers, feed every {args.interval:g} s, {args.renewals:g} renewals/s each, "
          f"collective_rpc {args.latency * 1000:.0f} ms, TP {args.tp}, {args.seconds:g} s per variant")
    print("| variant | feed polls/s | feed RPCs/s | renewals/s | renewal RPCs/s | renewal latency | "
          "worker calls/s (RPCs x TP) |")
    print("|---|---|---|---|---|---|---|")
    for variant in ("direct", "shared", "shared+cache"):
        r = asyncio.run(play(variant, args.routers, args.interval, args.renewals, args.seconds, args.tp,
                             args.latency, args.cache_ms, args.batch_ms, args.seed))
        print(f"| {variant} | {r['feed_calls']:.2f} | {r['feed_rpcs']:.2f} | {r['lease_calls']:.2f} | "
              f"{r['lease_rpcs']:.2f} | {r['lease_ms']:.0f} ms | {(r['feed_rpcs'] + r['lease_rpcs']) * args.tp:.1f} |")


if __name__ == "__main__":
    main()
