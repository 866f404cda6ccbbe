"""Lease renewal for retained turns: ``POST /turnkv/v1/leases`` on the engine's API server.

A decode engine keeps a finished conversation turn's blocks for ``decoder_kv_blocks_ttl`` after the
turn ended. An agent that thinks or runs tools for longer loses its reuse. The router renews the
lease: this route extends the expiry of retained requests, held by the NIXL worker, to ``ttl``
seconds from now (never shortens it), and answers each one's offer re-signed with its new expiry.

The route is authenticated by the offers themselves (``turnkv.wire``): a caller names what to renew
by sending decode's signed offers, and only offers this engine signed, still live, are renewed. At
most ``wire.LEASE_MAX_OFFERS`` offers per call, leases of at most ``wire.LEASE_MAX_TTL`` seconds.

The same plugin serves decode's evictions feed (``GET`` ``wire.EVICTIONS_ROUTE``): the retained turns it
evicted to stay under ``retained_kv_share`` (``connector.retention``), read by routers so they never replay
them. An evicted turn is not renewed.

vLLM loads the route as the endpoint plugin ``turnkv-leases`` (endpoint plugins must be allow-listed
in ``VLLM_PLUGINS``; ``turnkv.engine_args.serve_env`` does). The general plugin installs the worker
method ``turnkv_renew_leases`` that the route reaches through ``collective_rpc`` by name; it runs
between engine steps, on the worker's own thread.
"""

# No `from __future__ import annotations` here: FastAPI reads the route's annotations at runtime.
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from turnkv import wire

ROUTE = wire.LEASE_ROUTE
MAX_TTL = wire.LEASE_MAX_TTL


WORKER_METHOD = "turnkv_renew_leases"
FEED_METHOD = "turnkv_evictions"


def renew_on_worker(worker: Any, request_ids: list[str], ttl: float) -> dict[str, float]:
    """Runs in each worker process: extend the expiry of retained requests.

    Returns each renewed request's new expiry on this host's monotonic clock (``time.perf_counter``,
    the clock ``remote_blocks_expiry_time`` is stamped with), so prefill's expiry check agrees.
    """
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    holder = get_kv_transfer_group().connector_worker
    held: dict[str, float] = getattr(holder, "_reqs_to_send", {})
    evicted = getattr(holder, "turnkv_evicted", lambda _rid: False)
    now = time.perf_counter()
    renewed = {}
    for request_id in request_ids:
        if request_id in held and not evicted(request_id):  # an evicted turn's blocks are about to be freed
            held[request_id] = max(held[request_id], now + ttl)
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
    hosted only once every rank has copied its share to the host tier."""
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
            "hosted": [[rid, until] for rid, until in (hosted or {}).items() if rid not in evicted]}


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
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl <= MAX_TTL:
        raise ValueError(f"'ttl' must be seconds in (0, {MAX_TTL}]")
    return offers, float(ttl)


def renewed_offer(secret: bytes, offer: dict[str, Any], mono_expiry: float, model: str,
                  mono_now: float, wall_now: float) -> dict[str, Any]:
    """``offer`` with its new expiry on both clocks, signed again (pure)."""
    out = dict(offer)
    out["remote_blocks_expiry_time"] = mono_expiry
    return wire.sign_offer(secret, out, wall_now + (mono_expiry - mono_now), model)


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
            now = time.time()
            valid = {}
            for offer in offers:
                if wire.check_offer(secret, offer, model, now, 0.0) == "ok" and offer.get("remote_request_id"):
                    valid[str(offer["remote_request_id"])] = offer
            if not valid:
                return _error(403, "no live offer signed by this engine")
            ids = list(valid)
            per_worker = await client.collective_rpc(WORKER_METHOD, args=(ids, ttl))
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
            return JSONResponse(merge_feeds(await client.collective_rpc(FEED_METHOD, args=(since,))))

        app.add_api_route(ROUTE, renew, methods=["POST"])
        app.add_api_route(wire.EVICTIONS_ROUTE, evictions, methods=["GET"])

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        from connector.offers import model_fields

        state.turnkv_engine_client = engine_client
        state.turnkv_offer_secret = wire.offer_secret()
        state.turnkv_model = wire.model_fingerprint(model_fields(getattr(engine_client, "vllm_config", None)))
