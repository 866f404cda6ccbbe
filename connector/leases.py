"""Lease renewal for retained turns: ``POST /turnkv/v1/leases`` on the engine's API server.

A decode engine keeps a finished conversation turn's blocks for ``decoder_kv_blocks_ttl`` after the
turn ended. An agent that thinks or runs tools for longer loses its reuse. The router renews the
lease: this route extends the expiry of retained requests, held by the NIXL worker, to ``ttl``
seconds from now (never shortens it), and answers each one's offer re-signed with its new expiry.

The route is authenticated by the offers themselves (``turnkv.wire``): a caller names what to renew
by sending decode's signed offers, and only offers this engine signed, still live, are renewed: every engine of a
deployment signs with the same secret, so an offer must also name this engine (``wire.lease_offer_ok``) and this
process (its boot stamp names each worker rank's NIXL agent; an earlier boot's request id is not renewed). At
most ``wire.LEASE_MAX_OFFERS`` offers per call, leases of at most ``wire.LEASE_MAX_TTL`` seconds.

The same plugin serves decode's evictions feed (``GET`` ``wire.EVICTIONS_ROUTE``): the retained turns it
evicted to stay under ``retained_kv_share`` (``connector.retention``), read by routers so they never replay
them. An evicted turn is not renewed.

vLLM loads the route as the endpoint plugin ``turnkv-leases`` (endpoint plugins must be allow-listed
in ``VLLM_PLUGINS``; ``turnkv.engine_args.serve_env`` does). The general plugin installs the worker
method ``turnkv_renew_leases`` that the route reaches through ``collective_rpc`` by name; it runs
between engine steps, on the worker's own thread.

Each ``collective_rpc`` reaches every TP worker and, with async scheduling, waits behind the running batch, so
the routes share them (:class:`RpcBatcher`): at most one call per method is in flight, and the HTTP calls that
arrive meanwhile share the next one; a lease call that finds none in flight waits ``TURNKV_LEASE_BATCH_MS``
(default 200) for others. A call is answered only from a ``collective_rpc`` that started after it arrived, so a
renewal has reached every rank before it is acknowledged. The evictions feed is also kept for
``TURNKV_EVICTIONS_CACHE_MS`` (default 500, 0 = off) and served to callers whose cursor it covers, with its
``age`` (seconds between the cached read and this call), which the router subtracts from when it sent the read.
"""

# No `from __future__ import annotations` here: FastAPI reads the route's annotations at runtime.
import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse

from turnkv import lifetime, wire

ROUTE = wire.LEASE_ROUTE
MAX_TTL = wire.LEASE_MAX_TTL


WORKER_METHOD = "turnkv_renew_leases"
FEED_METHOD = "turnkv_evictions"


def renew_on_worker(worker: Any, request_ids: list[str], ttl: float | Mapping[str, float],
                    boots: Mapping[str, str | None] | None = None) -> dict[str, float]:
    """Runs in each worker process: extend the expiry of retained requests by ``ttl`` (one for all, or by id:
    several lease calls share one ``collective_rpc``). ``boots``: each offer's boot stamp; a request whose offer
    names another boot of this engine (a restart: request ids may repeat) is not renewed.

    Returns each renewed request's new expiry on this host's monotonic clock (``time.perf_counter``,
    the clock ``remote_blocks_expiry_time`` is stamped with), so prefill's expiry check agrees.
    """
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    holder = get_kv_transfer_group().connector_worker
    held: dict[str, float] = getattr(holder, "_reqs_to_send", {})
    evicted = getattr(holder, "turnkv_evicted", lambda _rid: False)
    own_boot = getattr(holder, "turnkv_own_boot", lambda _stamp: True)
    now = time.perf_counter()
    renewed = {}
    for request_id in request_ids:
        if boots is not None and not own_boot(boots.get(request_id)):
            continue  # an offer of another process of this engine
        if request_id in held and not evicted(request_id):  # an evicted turn's blocks are about to be freed
            asked = float(ttl[request_id] if isinstance(ttl, Mapping) else ttl)
            held[request_id] = lifetime.renewed_until(held[request_id], now, asked)
            renewed[request_id] = held[request_id]
    if renewed and hasattr(holder, "turnkv_renewed"):
        holder.turnkv_renewed(list(renewed))  # wanted again: not idle (connector.retention)
    return renewed


def evictions_on_worker(worker: Any, since: int) -> dict[str, Any]:
    """Runs in each worker process: the retained turns it evicted after announcement ``since``."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    holder = get_kv_transfer_group().connector_worker
    feed = getattr(holder, "turnkv_evictions", None)
    return feed(since) if feed is not None else {"epoch": "", "seq": 0, "evicted": []}


def merge_feeds(per_worker: list[dict[str, Any]]) -> dict[str, Any]:
    """One feed from every rank's (pure). Ranks announce the same evictions in the same order but may be a step
    apart: every announcement any rank made, and the lowest ``seq``, so the next call misses none. A turn is
    hosted only once every rank has copied its share to the host tier. Each rank's seals (``connector.seals``) are
    listed as that rank made them; the engine seals only if every rank does."""
    evicted: dict[str, float] = {}
    for feed in per_worker:
        for request_id, until in feed.get("evicted") or ():
            evicted[request_id] = max(float(until), evicted.get(request_id, 0.0))
    hosted: dict[str, float] | None = None
    for feed in per_worker:
        mine = {str(rid): float(until) for rid, until in feed.get("hosted") or ()}
        hosted = mine if hosted is None else {rid: min(until, mine[rid]) for rid, until in hosted.items()
                                              if rid in mine}
    return {"epoch": "-".join(str(f.get("epoch", "")) for f in per_worker),
            "seq": min((int(f.get("seq", 0)) for f in per_worker), default=0),
            "evicted": [[rid, until] for rid, until in evicted.items()],
            "hosted": [[rid, until] for rid, until in (hosted or {}).items() if rid not in evicted],
            "seals": bool(per_worker) and all(bool(f.get("seals")) for f in per_worker),
            "sealed": [e for f in per_worker for e in f.get("sealed") or () if e and e[0] not in evicted]}


T = TypeVar("T")
R = TypeVar("R")


class RpcBatcher(Generic[T, R]):
    """At most one ``run`` in flight; the items submitted meanwhile go together into the next one.

    ``submit`` returns the result of a ``run`` that started after the item was submitted and includes it (never
    one already in flight when it arrived). An item that finds nothing in flight waits ``window`` seconds for
    others to join it (0: runs at once); under concurrent calls one ``run`` per in-flight duration serves them
    all. Counted in ``runs`` and ``items``.
    """

    def __init__(self, run: Callable[[list[T]], Awaitable[R]], window: float = 0.0) -> None:
        self._run = run
        self.window = window
        self._pending: list[T] = []
        self._next: asyncio.Future[R] | None = None
        self._drainer: asyncio.Task[None] | None = None
        self.runs = 0
        self.items = 0

    async def submit(self, item: T) -> R:
        self._pending.append(item)
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
            self._next.add_done_callback(_retrieve)
        shared = self._next
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.ensure_future(self._drain())
        return await asyncio.shield(shared)  # a caller that goes away leaves the shared call to the others

    async def _drain(self) -> None:
        if self.window > 0:
            await asyncio.sleep(self.window)
        while self._next is not None:
            items, shared = self._pending, self._next
            self._pending, self._next = [], None
            self.runs += 1
            self.items += len(items)
            try:
                result = await self._run(items)
            except asyncio.CancelledError:  # the server is stopping: so are its callers
                shared.cancel()
                raise
            except Exception as exc:  # every caller of this run gets the error, as it would have alone
                shared.set_exception(exc)
            else:
                shared.set_result(result)


def _retrieve(future: "asyncio.Future[Any]") -> None:
    if not future.cancelled():
        future.exception()  # seen here: no "never retrieved" warning when every caller went away


def _ms_setting(name: str, default_ms: float) -> float:
    try:
        return max(0.0, float(os.environ.get(name, str(default_ms))) / 1000)
    except ValueError:
        return default_ms / 1000


def feed_cache_seconds() -> float:
    """How long a read of the evictions feed serves other callers (``TURNKV_EVICTIONS_CACHE_MS``, default 500)."""
    return _ms_setting("TURNKV_EVICTIONS_CACHE_MS", 500)


def lease_batch_seconds() -> float:
    """How long a lease call waits for others to share its collective_rpc (``TURNKV_LEASE_BATCH_MS``, default
    200; a call arriving while one is in flight waits for that one to end instead)."""
    return _ms_setting("TURNKV_LEASE_BATCH_MS", 200)


@dataclass(frozen=True)
class _FeedRead:
    since: int
    started: float  # monotonic, when its collective_rpc was sent
    feed: dict[str, Any]


class EngineRpcs:
    """The lease and evictions routes' ``collective_rpc`` calls to one engine, shared (see the module's doc)."""

    def __init__(self, client: Any, cache_seconds: float | None = None, batch_seconds: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client
        self._clock = clock
        self.cache_seconds = feed_cache_seconds() if cache_seconds is None else cache_seconds
        self._last: _FeedRead | None = None
        self.renewals: RpcBatcher[tuple[list[str], float, dict[str, str | None]], list[dict[str, float]]] = RpcBatcher(
            self._renew, lease_batch_seconds() if batch_seconds is None else batch_seconds)
        self.feeds: RpcBatcher[int, _FeedRead] = RpcBatcher(self._read_feed)

    async def renew(self, request_ids: list[str], ttl: float,
                    boots: Mapping[str, str | None] | None = None) -> list[dict[str, float]]:
        """Every rank's renewed expiries (each rank's answer covers at least ``request_ids``); ``boots``: each
        request's offer's boot stamp (checked by every rank against its own agent)."""
        return await self.renewals.submit((request_ids, ttl, dict(boots or {})))

    async def evictions(self, since: int, fresh: bool = False) -> dict[str, Any]:
        """The merged feed after ``since``, with ``age``: 0 when read after this call arrived, else how long
        before it the cached read was sent. It may hold announcements at or before ``since`` (repeated, harmless);
        it misses none after it: a cached read is used only when its cursor is at most ``since``. ``fresh``: never
        from the cache (a router waiting for a turn's host copy or seal, done at the step after the turn ended)."""
        now = self._clock()
        last = self._last
        if not fresh and last is not None and last.since <= since and now - last.started <= self.cache_seconds:
            return {**last.feed, "age": round(now - last.started, 6)}
        read = await self.feeds.submit(since)
        return {**read.feed, "age": 0.0}

    async def _renew(self, items: list[tuple[list[str], float, dict[str, str | None]]]) -> list[dict[str, float]]:
        ttls: dict[str, float] = {}
        boots: dict[str, str | None] = {}
        for request_ids, ttl, stamps in items:
            for request_id in request_ids:
                ttls[request_id] = max(ttl, ttls.get(request_id, 0.0))  # a lease is never shortened anyway
                if request_id in stamps:
                    boots[request_id] = stamps[request_id]
        return await self._client.collective_rpc(WORKER_METHOD, args=(list(ttls), ttls, boots))

    async def _read_feed(self, cursors: list[int]) -> _FeedRead:
        since, started = min(cursors), self._clock()
        read = _FeedRead(since, started, merge_feeds(await self._client.collective_rpc(FEED_METHOD, args=(since,))))
        if self._last is None or started >= self._last.started:
            self._last = read
        return read


def apply() -> list[str]:
    """General-plugin side: give vLLM's workers the methods the routes call."""
    from vllm.v1.worker.worker_base import WorkerBase

    if getattr(WorkerBase, WORKER_METHOD, None) is renew_on_worker:
        return []
    setattr(WorkerBase, WORKER_METHOD, renew_on_worker)
    setattr(WorkerBase, FEED_METHOD, evictions_on_worker)
    return ["lease-renewal", "evictions-feed"]


def parse_request(body: Any) -> tuple[list[dict[str, Any]], float]:
    """The offers and TTL of a lease call; ValueError names what is wrong (pure)."""
    if not isinstance(body, dict):
        raise ValueError("expected a JSON object")
    offers = body.get("offers")
    if not isinstance(offers, list) or not offers or not all(isinstance(o, dict) for o in offers):
        raise ValueError("'offers' must be a non-empty list of decode's signed kv_transfer_params")
    if len(offers) > wire.LEASE_MAX_OFFERS:
        raise ValueError(f"at most {wire.LEASE_MAX_OFFERS} offers per call")
    ttl = body.get("ttl")
    if not lifetime.lease_ttl_ok(ttl, MAX_TTL):
        raise ValueError(f"'ttl' must be seconds in (0, {MAX_TTL}]")
    return offers, float(ttl)


def renewed_offer(secret: bytes, offer: dict[str, Any], mono_expiry: float, model: str,
                  mono_now: float, wall_now: float) -> dict[str, Any]:
    """``offer`` with its new expiry on both clocks, signed again (pure)."""
    out = dict(offer)
    out[wire.REMOTE_BLOCKS_EXPIRY_TIME] = mono_expiry
    return wire.sign_offer(secret, out, lifetime.wall_from_monotonic(mono_expiry, mono_now, wall_now), model)


def _rpcs(state: Any, client: Any) -> EngineRpcs:
    rpcs = getattr(state, "turnkv_rpcs", None)
    if rpcs is None or rpcs._client is not client:
        rpcs = state.turnkv_rpcs = EngineRpcs(client)
    return rpcs


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


class LeaseEndpoints:
    name = "turnkv-leases"
    required_tasks = None

    def attach_router(self, app: Any) -> None:
        async def renew(request: Request) -> JSONResponse:
            state = request.app.state
            secret = getattr(state, "turnkv_offer_secret", None)
            client = getattr(state, "turnkv_engine_client", None)
            if secret is None or client is None:
                return _error(503, "leases need the deployment's offer secret (TURNKV_OFFER_SECRET_FILE)")
            try:
                offers, ttl = parse_request(await request.json())
            except ValueError as exc:
                return _error(400, str(exc))
            model = state.turnkv_model
            engine_id = getattr(state, "turnkv_engine_id", None)
            now = time.time()
            valid = {}
            for offer in offers:
                if wire.check_offer(secret, offer, model, now, 0.0) == "ok" and offer.get(wire.REMOTE_REQUEST_ID) \
                        and wire.lease_offer_ok(offer, engine_id):
                    valid[str(offer[wire.REMOTE_REQUEST_ID])] = offer
            if not valid:
                return _error(403, "no live offer signed by this engine")
            ids = list(valid)
            boots = {rid: offer.get(wire.BOOT) for rid, offer in valid.items()}
            per_worker = await _rpcs(state, client).renew(ids, ttl, boots)
            mono_now, wall_now = time.perf_counter(), time.time()
            # Every rank holds the request; the earliest expiry is the truthful one.
            expiry = {rid: min(w[rid] for w in per_worker) for rid in ids if all(rid in w for w in per_worker)}
            return JSONResponse({
                "renewed": {rid: renewed_offer(secret, valid[rid], at, model, mono_now, wall_now)
                            for rid, at in expiry.items()},
                "missing": [rid for rid in ids if rid not in expiry],
            })

        async def evictions(request: Request) -> JSONResponse:
            client = getattr(request.app.state, "turnkv_engine_client", None)
            if client is None:
                return _error(503, "the engine is not ready")
            try:
                since = int(request.query_params.get("since", "0"))
            except ValueError:
                return _error(400, "'since' must be an integer")
            fresh = request.query_params.get("fresh") == "1"
            return JSONResponse(await _rpcs(request.app.state, client).evictions(since, fresh))

        app.add_api_route(ROUTE, renew, methods=["POST"])
        app.add_api_route(wire.EVICTIONS_ROUTE, evictions, methods=["GET"])

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        from connector.offers import model_fields

        state.turnkv_engine_client = engine_client
        state.turnkv_rpcs = EngineRpcs(engine_client)
        transfer = getattr(getattr(engine_client, "vllm_config", None), "kv_transfer_config", None)
        engine_id = getattr(transfer, "engine_id", None)
        state.turnkv_engine_id = str(engine_id) if engine_id is not None else None
        state.turnkv_offer_secret = wire.offer_secret()
        state.turnkv_model = wire.model_fingerprint(model_fields(getattr(engine_client, "vllm_config", None)))
