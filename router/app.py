"""HTTP surface of the router: OpenAI-compatible routes, health and Prometheus metrics (aiohttp)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from router import guard
from router.config import RouterConfig
from router.engines import EnginePool
from router.flow import Flow, error_response
from router.state import ConversationStore
from router.state.memory import MemoryStore
from router.telemetry import Metrics

log = logging.getLogger("turnkv.router")

ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}

FLOW = web.AppKey("flow", Flow)
CONFIG = web.AppKey("config", RouterConfig)
METRICS = web.AppKey("metrics", Metrics)


async def _read_json(request: web.Request) -> Any:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise
    if not raw:
        raise guard.RequestError("the request body is empty; send a JSON object")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise guard.RequestError(f"the request body is not valid JSON: {exc}") from None


def _completion_handler(path: str, kind: str):
    async def handler(request: web.Request) -> web.StreamResponse:
        flow = request.app[FLOW]
        metrics = request.app[METRICS]
        status = 500
        try:
            body = await _read_json(request)
            dispatch = flow.prepare(kind, path, request, body)
            response = await flow.run(dispatch, request)
            status = response.status
            return response
        except guard.RequestError as exc:
            status = 400
            return error_response(400, str(exc))
        except web.HTTPRequestEntityTooLarge:
            status = 413
            return error_response(413, f"the request body is larger than max_body_bytes "
                                       f"({request.app[CONFIG].max_body_bytes} bytes)")
        finally:
            metrics.requests.labels(path, str(status)).inc()

    return handler


async def lease(request: web.Request) -> web.Response:
    from router.lease import renew

    try:
        return await renew(request.app[FLOW], request, await _read_json(request))
    except guard.RequestError as exc:
        return error_response(400, str(exc))


async def health(request: web.Request) -> web.Response:
    pool = request.app[FLOW].pool
    engines = [{"url": e.url, "role": e.role, "healthy": e.healthy, "outstanding": e.outstanding} for e in pool.all]
    ok = any(e.healthy for e in pool.prefill) and any(e.healthy for e in pool.decode)
    return web.json_response({"status": "ok" if ok else "degraded", "engines": engines}, status=200 if ok else 503)


async def models(request: web.Request) -> web.StreamResponse:
    flow = request.app[FLOW]
    engine = flow.pool.pick("decode")
    try:
        async with flow.session.get(engine.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            return web.Response(status=resp.status, body=await resp.read(), content_type="application/json")
    except (aiohttp.ClientError, TimeoutError) as exc:
        return error_response(502, f"decode engine {engine.name} did not list models: {exc!r}", "upstream_error")


async def metrics_endpoint(request: web.Request) -> web.Response:
    metrics = request.app[METRICS]
    store = request.app[FLOW].store
    if isinstance(store, MemoryStore):
        metrics.conversations.set(len(store))
    return web.Response(body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _health_loop(app: web.Application) -> None:
    """Probe every engine's /health; an engine that fails is skipped until it answers again."""
    flow, config, metrics = app[FLOW], app[CONFIG], app[METRICS]
    timeout = aiohttp.ClientTimeout(total=max(1.0, config.health_interval))

    async def probe(engine) -> None:
        try:
            async with flow.session.get(engine.url + "/health", timeout=timeout) as resp:
                healthy = resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            healthy = False
        if healthy != engine.healthy:
            log.warning("engine %s (%s) is now %s", engine.name, engine.role, "healthy" if healthy else "unhealthy")
        engine.healthy = healthy
        metrics.engine_healthy.labels(engine.role, engine.name).set(1 if healthy else 0)

    while True:
        await asyncio.gather(*(probe(e) for e in flow.pool.all))
        if isinstance(flow.store, MemoryStore):
            flow.store.purge_expired()
        await asyncio.sleep(config.health_interval)


def build_app(config: RouterConfig, store: ConversationStore | None = None) -> web.Application:
    app = web.Application(client_max_size=int(config.max_body_bytes))
    metrics = Metrics()
    pool = EnginePool(config.prefill, config.decode)
    store = store or MemoryStore(int(config.max_conversations))
    app[CONFIG] = config
    app[METRICS] = metrics

    async def lifecycle(app: web.Application):
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60)
        session = aiohttp.ClientSession(connector=connector, json_serialize=lambda o: orjson.dumps(o).decode(),
                                        auto_decompress=False)
        app[FLOW] = Flow(config, pool, store, metrics, session)
        task = asyncio.create_task(_health_loop(app))
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await session.close()
        await store.close()

    app.cleanup_ctx.append(lifecycle)
    for path, kind in ROUTES.items():
        app.router.add_post(path, _completion_handler(path, kind))
    app.router.add_post("/v1/conversations/lease", lease)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics_endpoint)
    return app


def serve(config: RouterConfig) -> None:
    """Run the router until SIGINT/SIGTERM (uvloop when available)."""
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    started = time.time()
    log.info("turnkv router on http://%s:%d prefill=%s decode=%s", config.host, config.port, config.prefill,
             config.decode)
    web.run_app(build_app(config), host=config.host, port=config.port, print=None, access_log=None,
                handler_cancellation=True, shutdown_timeout=5)
    log.info("router stopped after %.0f s", time.time() - started)
