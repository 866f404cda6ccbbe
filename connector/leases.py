"""Lease renewal for retained turns: ``POST /turnkv/v1/leases`` on the engine's API server.

A decode engine keeps a finished conversation turn's blocks for ``decoder_kv_blocks_ttl`` after the
turn ended. An agent that thinks or runs tools for longer loses its reuse. The router renews the
lease: this route extends the expiry of retained requests, held by the NIXL worker, to ``ttl``
seconds from now (never shortens it), and answers how long each one now lives.

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

ROUTE = "/turnkv/v1/leases"
MAX_TTL = 3600


WORKER_METHOD = "turnkv_renew_leases"


def renew_on_worker(worker: Any, request_ids: list[str], ttl: float) -> dict[str, float]:
    """Runs in each worker process: extend the expiry of retained requests.

    Returns each renewed request's new expiry on this host's monotonic clock (``time.perf_counter``,
    the clock ``remote_blocks_expiry_time`` is stamped with), so prefill's expiry check agrees.
    """
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    holder = get_kv_transfer_group().connector_worker
    held: dict[str, float] = getattr(holder, "_reqs_to_send", {})
    now = time.perf_counter()
    renewed = {}
    for request_id in request_ids:
        if request_id in held:
            held[request_id] = max(held[request_id], now + ttl)
            renewed[request_id] = held[request_id]
    return renewed


def apply() -> list[str]:
    """General-plugin side: give vLLM's workers the method the route calls."""
    from vllm.v1.worker.worker_base import WorkerBase

    if getattr(WorkerBase, WORKER_METHOD, None) is renew_on_worker:
        return []
    setattr(WorkerBase, WORKER_METHOD, renew_on_worker)
    return ["lease-renewal"]


class LeaseEndpoints:
    name = "turnkv-leases"
    required_tasks = None

    def attach_router(self, app: Any) -> None:
        async def renew(request: Request) -> JSONResponse:
            try:
                body = await request.json()
                ids = body["request_ids"]
                ttl = float(body.get("ttl", 0))
                if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids) or not 0 < ttl <= MAX_TTL:
                    raise ValueError
            except (ValueError, KeyError, TypeError):
                return JSONResponse({"error": {"message": f"expected {{'request_ids': [str, ...], 'ttl': "
                                                          f"seconds in (0, {MAX_TTL}]}}", "code": 400}},
                                    status_code=400)
            client = getattr(request.app.state, "turnkv_engine_client", None)
            if client is None:
                return JSONResponse({"error": {"message": "no engine behind this server", "code": 503}},
                                    status_code=503)
            per_worker = await client.collective_rpc(WORKER_METHOD, args=(ids, ttl))
            now = time.perf_counter()
            # Every rank holds the request; the earliest expiry is the truthful one.
            expiry = {rid: min(w[rid] for w in per_worker) for rid in ids if all(rid in w for w in per_worker)}
            return JSONResponse({
                "renewed": {rid: round(at - now, 3) for rid, at in expiry.items()},
                "remote_blocks_expiry_time": expiry,
                "missing": [rid for rid in ids if rid not in expiry],
            })

        app.add_api_route(ROUTE, renew, methods=["POST"])

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        state.turnkv_engine_client = engine_client
