"""HTTP surface of the router: OpenAI-compatible routes, health and Prometheus metrics (aiohttp).

Ops routes (``/health``, ``/ready``, ``/metrics``) answer only requests that did not come through a proxy:
the ALB adds ``X-Forwarded-For`` to every request it forwards (clients cannot remove it), and its own
health checks carry none, so clients on the internet get 404 while the ALB and scrapers inside the VPC
still reach them (``ops_behind_proxy`` switches the check off for a proxy that strips the header).

Background tasks (started with the app, ``router.lifecycle``): engine health probes, Cloud Map discovery
refresh, the SSM re-read of the tunables, and the in-memory store's expiry purge.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ipaddress
import logging
import math
import time
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from router import apis, encoded, guard, intake, limits, telemetry
from router.apis import stored
from router.apis.messages import MessagesTranslation
from router.apis.responses import ResponsesTranslation
from router.auth import ApiKeys, AuthError, parse_keys
from router.body import charge_messages, close_unread, limit_response, read_json
from router.config import RouterConfig
from router.engines import EnginePool
from router.engines.policy import POLICIES
from router.flow import Flow, error_response
from router.intake import LimitError
from router.lifecycle import RouterRuntime
from router.models import ModelList
from router.outcomes import RequestKind
from router.state import ConversationStore
from router.state.memory import MemoryStore
from router.telemetry import Metrics
from turnkv import params, wire

log = logging.getLogger("turnkv.router")

ROUTES = {"/v1/chat/completions": RequestKind.CHAT, "/v1/completions": RequestKind.COMPLETION}
#: Other APIs, translated to chat completions at the router (``router.apis``, docs/router.md "Other APIs").
TRANSLATED = {"/v1/responses": ResponsesTranslation, "/v1/messages": MessagesTranslation}
CHAT_PATH = "/v1/chat/completions"
#: Added by the ALB (and every common reverse proxy) to forwarded requests.
FORWARDED_HEADERS = ("X-Forwarded-For", "Forwarded")
#: Parts of those APIs that need state the router does not keep: a clear 501 naming them, not a bare 404.
NOT_ROUTED = {
    "/v1/responses/{tail:.+}": "retrieving stored responses (the router keeps a response only to continue it by "
                               "previous_response_id)",
    "/v1/messages/{tail:.+}": "this part of the Anthropic Messages API (only POST /v1/messages is served)",
}

FLOW = web.AppKey("flow", Flow)
CONFIG = web.AppKey("config", RouterConfig)
METRICS = web.AppKey("metrics", Metrics)
POOL = web.AppKey("pool", EnginePool)
KEYS = web.AppKey("keys", ApiKeys)
ADMISSION = web.AppKey("admission", limits.Admission)
BODY_BUDGET = web.AppKey("body_budget", limits.ByteBudget)
REQUEST_RATE = web.AppKey("request_rate", limits.FairRate)
BODY_RATE = web.AppKey("body_rate", limits.FairRate)
MESSAGE_RATE = web.AppKey("message_rate", limits.TokenBucket)
LOOP_SHARE = web.AppKey("loop_share", limits.LoopShare)
MODELS = web.AppKey("models", ModelList)


def _ops(handler):
    """An ops route: 404 to anything that came through a proxy (clients via the ALB), as if it did not exist."""
    async def guarded(request: web.Request) -> web.StreamResponse:
        if any(h in request.headers for h in FORWARDED_HEADERS):
            return error_response(404, "not found", "not_found")
        return await handler(request)

    guarded.__name__ = handler.__name__
    return guarded


def _authorization(request: web.Request, path: str) -> str | None:
    """The API key header: ``Authorization: Bearer KEY``, or Anthropic SDKs' ``x-api-key: KEY`` on /v1/messages."""
    auth = request.headers.get("Authorization")
    if auth is None and path == "/v1/messages" and request.headers.get("x-api-key"):
        auth = "Bearer " + request.headers["x-api-key"]
    return auth


def _in_format(response: web.StreamResponse, path: str) -> web.StreamResponse:
    """An error answer in the client API's own shape (Anthropic's ``{"type": "error", ...}`` on /v1/messages)."""
    if path != "/v1/messages" or response.status < 400 or not isinstance(response, web.Response):
        return response
    try:
        error = orjson.loads(response.body or b"{}").get("error") or {}  # type: ignore[arg-type]
    except (orjson.JSONDecodeError, AttributeError):
        return response
    response.body = MessagesTranslation.error_shape(response.status, str(error.get("message") or "error"))
    return response


def ceiling(config: RouterConfig, name: str) -> float:
    """A tenant's own ceiling from the catalog: ``math.inf`` at its maximum (the default: none)."""
    value = float(getattr(config, name))
    return math.inf if value >= params.get(name).maximum else value


def charge_budgets(app: web.Application, tenant: str) -> None:
    """Every tenant route's first step once the tenant is known: LimitError (429) when the tenant is over its
    max-min share of the router's event loop (``tenant_loop_share``) or of its request rate
    (``router_request_rate``, under the tenant's own ceiling ``tenant_request_rate``); the request is counted."""
    config = app[CONFIG]
    share = float(config.tenant_loop_share)
    wait = app[LOOP_SHARE].refuse(tenant, share)
    if wait is not None:
        raise LimitError(429, "tenant_loop_share", "this API key's requests took more than its fair share of the "
                         f"router's event loop (at least tenant_loop_share, {share:g}) while others waited; slow down",
                         retry_after=wait)
    rates = app[REQUEST_RATE]
    capacity, cap = float(config.router_request_rate), ceiling(config, "tenant_request_rate")
    if not rates.allow(tenant, capacity, cap):
        allowed = rates.rate(tenant, capacity, cap)
        why = (f"tenant_request_rate {cap:g}/s" if allowed >= cap else
               f"its fair share now, {allowed:.4g}/s of router_request_rate {capacity:g}/s among the keys asking")
        raise LimitError(429, "tenant_request_rate", f"too many requests per second for this API key ({why}); "
                         "slow down", retry_after=max(1, math.ceil(1 / allowed)))


def _completion_handler(path: str, kind: RequestKind, translation: type[apis.Translation] | None = None):
    async def handler(request: web.Request) -> web.StreamResponse:
        # every step of the request is timed and charged to its tenant's share of the loop (tenant_loop_share)
        meter = limits.Meter(request.app[LOOP_SHARE])
        return await close_unread(request, _in_format(await limits.Metered(_serve(request, meter), meter), path))

    async def _serve(request: web.Request, meter: limits.Meter) -> web.StreamResponse:
        app = request.app
        metrics = app[METRICS]
        status = 500
        timed: int | None = None  # the status the duration's outcome reads, when not the one sent
        started = time.perf_counter()
        try:
            try:
                tenant = app[KEYS].tenant(_authorization(request, path))
            except AuthError as exc:
                metrics.auth_failures.inc()
                status = 401
                return error_response(401, str(exc), "authentication_error",
                                      headers={"WWW-Authenticate": 'Bearer realm="turnkv"'})
            meter.known(tenant)
            config = app[CONFIG]
            charge_budgets(app, tenant)  # before anything is read or parsed: a refusal costs the loop ~0.1 ms
            refused = app[ADMISSION].try_enter(tenant, int(config.max_inflight), int(config.tenant_max_inflight))
            if refused is not None:
                metrics.admission_refused.labels(refused).inc()
                status = 429
                who = "this router" if refused == "router" else "this API key"
                return error_response(429, f"too many requests in flight for {who}; retry shortly",
                                      "rate_limit_exceeded", headers={"Retry-After": "1"})
            try:
                body, size, nesting = await read_json(request, tenant, app[BODY_BUDGET], config, app[BODY_RATE])
                if isinstance(body, dict):
                    intake.check_messages(body, int(config.max_messages))  # before translating or hashing them
                charge_messages(body, tenant, app[MESSAGE_RATE], config)
                flow = app[FLOW]
                if translation is None:
                    dispatch = flow.prepare(kind, path, request, body, tenant, size, nesting=nesting)
                else:
                    if nesting > encoded.MAX_DEPTH:  # the depth check (400) before a translation serialises a part
                        encoded.dumps(body)
                    if translation is ResponsesTranslation and isinstance(body, dict) \
                            and body.get("previous_response_id"):
                        prior = await flow.responses.load(tenant, body["previous_response_id"])
                        api: apis.Translation = ResponsesTranslation(body, prior)
                    else:
                        api = translation(body)
                    dispatch = flow.prepare(RequestKind.CHAT, CHAT_PATH, request, api.chat_body, tenant, size, api=api)
                response = await flow.run(dispatch, request)
            finally:
                app[ADMISSION].leave(tenant)
            status = response.status
            # a stream the client stopped reading (or left) mid-way went out as 200: timed as a disconnect
            timed = 499 if dispatch.status == 499 else status
            return response
        except guard.RequestError as exc:
            status = 400
            return error_response(400, str(exc))
        except LimitError as exc:
            metrics.admission_refused.labels(exc.limit).inc()
            status = exc.status
            return limit_response(exc)
        except stored.StoreUnavailable as exc:
            status = 503
            return error_response(503, str(exc), "service_unavailable", headers={"Retry-After": "1"})
        except web.HTTPRequestEntityTooLarge:
            status = 413
            return error_response(413, f"the request body is larger than max_body_bytes "
                                       f"({app[CONFIG].max_body_bytes} bytes)")
        except asyncio.CancelledError:
            status = 499
            raise
        finally:
            metrics.requests.labels(path, str(status)).inc()
            metrics.request_duration.labels(path, telemetry.duration_outcome(status if timed is None else timed)
                                            ).observe(time.perf_counter() - started)

    return handler


async def lease(request: web.Request) -> web.StreamResponse:
    """Extend a conversation's retained KV on its decode engine (router/lease.py)."""
    meter = limits.Meter(request.app[LOOP_SHARE])
    return await close_unread(request, await limits.Metered(_lease(request, meter), meter))


async def _lease(request: web.Request, meter: limits.Meter) -> web.Response:
    from router.lease import renew

    try:
        tenant = request.app[KEYS].tenant(request.headers.get("Authorization"))
        meter.known(tenant)
        flow = request.app[FLOW]
        rate = float(flow.config.tenant_lease_rate)
        if not flow.lease_rate.allow(tenant, rate, max(1.0, rate * 10)):  # before any parsing or hashing
            raise LimitError(429, "tenant_lease_rate", "too many lease renewals for this API key; slow down",
                             retry_after=flow.lease_rate.retry_after(rate))
        charge_budgets(request.app, tenant)  # and the loop and request rate shares, as every tenant route
        body, _, nesting = await read_json(request, tenant, request.app[BODY_BUDGET], flow.config)
        intake.check_messages(body if isinstance(body, dict) else {}, int(flow.config.max_messages))
        if nesting > encoded.MAX_DEPTH:  # the depth check (400) before its messages are hashed
            encoded.dumps(body)
        return await renew(flow, request, body, tenant)
    except LimitError as exc:
        request.app[METRICS].admission_refused.labels(exc.limit).inc()
        return limit_response(exc)
    except AuthError as exc:
        return error_response(401, str(exc), "authentication_error",
                              headers={"WWW-Authenticate": 'Bearer realm="turnkv"'})
    except guard.RequestError as exc:
        return error_response(400, str(exc))
    except stored.StoreUnavailable as exc:
        return error_response(503, str(exc), "service_unavailable", headers={"Retry-After": "1"})


def _not_routed(path: str, name: str):
    async def handler(request: web.Request) -> web.StreamResponse:
        app = request.app
        try:  # a tenant's route like the others: its key, its budgets, then the answer
            charge_budgets(app, app[KEYS].tenant(_authorization(request, path.split("/{")[0])))
        except AuthError as exc:
            response = error_response(401, str(exc), "authentication_error",
                                      headers={"WWW-Authenticate": 'Bearer realm="turnkv"'})
        except LimitError as exc:
            app[METRICS].admission_refused.labels(exc.limit).inc()
            response = limit_response(exc)
        else:
            response = error_response(501, f"{request.method} {request.path}: {name} is not served by the turnkv "
                                           "router", "not_implemented")
        return _in_format(response, path.split("/{")[0])

    return handler


def _engines_status(pool: EnginePool) -> tuple[bool, dict[str, Any]]:
    engines = [{"url": e.url, "name": e.name, "role": e.role, "healthy": e.healthy, "outstanding": e.outstanding}
               for e in pool.all]
    ok = any(e.healthy for e in pool.prefill) and any(e.healthy for e in pool.decode)
    return ok, {"status": "ok" if ok else "degraded", "engines": engines}


async def health(request: web.Request) -> web.Response:
    """Liveness: 200 while the router serves, whatever its engines do (restarting it would not help);
    the body says "degraded" when a role has no healthy engine."""
    _, body = _engines_status(request.app[POOL])
    return web.json_response(body)


async def ready(request: web.Request) -> web.Response:
    """Readiness: 503 unless at least one prefill and one decode engine are healthy."""
    ok, body = _engines_status(request.app[POOL])
    return web.json_response(body, status=200 if ok else 503)


async def models(request: web.Request) -> web.StreamResponse:
    """The served model names (``router.models``: redacted, cached), under the tenant's budgets like every route."""
    meter = limits.Meter(request.app[LOOP_SHARE])
    return await limits.Metered(_models(request, meter), meter)


async def _models(request: web.Request, meter: limits.Meter) -> web.StreamResponse:
    app = request.app
    try:
        tenant = app[KEYS].tenant(request.headers.get("Authorization"))
        meter.known(tenant)
        charge_budgets(app, tenant)
    except AuthError as exc:
        app[METRICS].auth_failures.inc()
        return error_response(401, str(exc), "authentication_error",
                              headers={"WWW-Authenticate": 'Bearer realm="turnkv"'})
    except LimitError as exc:
        app[METRICS].admission_refused.labels(exc.limit).inc()
        return limit_response(exc)
    flow = app[FLOW]

    async def read() -> Any:
        engine = flow.pool.pick("decode")
        try:
            async with flow.session.get(engine.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                resp.raise_for_status()
                return await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.warning("decode engine %s did not list models: %r", engine.name, exc)
            raise

    listed = await app[MODELS].get(read)
    if listed is None:
        return error_response(503, "no model server listed its models; try again", "service_unavailable",
                              headers={"Retry-After": "1"})
    return web.json_response(listed)


async def metrics_endpoint(request: web.Request) -> web.Response:
    metrics = request.app[METRICS]
    store = request.app[FLOW].store
    if isinstance(store, MemoryStore):
        metrics.conversations.set(len(store))
    metrics.observe_pool(request.app[POOL].all)
    return web.Response(body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


def make_store(config: RouterConfig) -> ConversationStore:
    if config.store == "memory":
        return MemoryStore(int(config.max_conversations), max_bytes=int(config.max_store_bytes))
    from router.state.valkey import ValkeyStore

    return ValkeyStore(config.store, timeout=max(0.05, config.store_timeout_ms / 1000 * 2))


def load_keys(config: RouterConfig) -> ApiKeys:
    keys: dict[str, str] = {}
    for text in config.api_keys_text():
        keys.update(parse_keys(text))
    return ApiKeys(keys)


def build_app(config: RouterConfig, store: ConversationStore | None = None, *, keys: ApiKeys | None = None,
              discover=None, ssm_source=None) -> web.Application:
    app = web.Application(client_max_size=int(config.max_body_bytes))
    metrics = Metrics()
    pool = EnginePool(config.prefill, config.decode, policy=POLICIES[config.policy](), tunables=config.tunables,
                      require=config.discovery == "static")
    for host in config.side_channel_hosts:  # extra NIXL addresses a replay may name
        pool.extra_hosts.add(host)
    pool.on_change = lambda e: log.warning("engine %s (%s) is now %s", e.name, e.role,
                                           "in the pool" if e.healthy else "ejected")
    store = store if store is not None else make_store(config)
    keys = keys if keys is not None else load_keys(config)
    app[CONFIG], app[METRICS], app[POOL], app[KEYS] = config, metrics, pool, keys
    app[ADMISSION] = limits.Admission()
    app[BODY_BUDGET] = limits.ByteBudget()
    app[REQUEST_RATE], app[BODY_RATE], app[MESSAGE_RATE] = limits.FairRate(), limits.FairRate(), limits.TokenBucket()
    app[LOOP_SHARE] = limits.LoopShare()
    app[MODELS] = ModelList()
    if discover is None and config.discovery == "cloudmap":
        from router.engines.discovery import CloudMapDiscovery

        discover = CloudMapDiscovery(config.namespace, config.service, config.region,
                                     config.aws_endpoint_url).discover
    if ssm_source is None and config.ssm:
        from router.reload import SsmSource

        ssm_source = SsmSource(config.deployment, config.region, config.aws_endpoint_url)

    async def running(app: web.Application):
        """The app's start and stop (router.lifecycle): the flow is published before the loops start."""
        runtime = RouterRuntime(config, pool, store, metrics, forward_auth=keys.open, discover=discover,
                                ssm_source=ssm_source)
        app[FLOW] = await runtime.open()
        await runtime.start_background()
        yield
        await runtime.stop()

    app.cleanup_ctx.append(running)
    for path, kind in ROUTES.items():
        app.router.add_post(path, _completion_handler(path, kind))
    for path, translation in TRANSLATED.items():
        app.router.add_post(path, _completion_handler(path, RequestKind.CHAT, translation))
    for path, name in NOT_ROUTED.items():
        app.router.add_route("*", path, _not_routed(path, name))
    app.router.add_post("/v1/conversations/lease", lease)
    app.router.add_get("/health", _ops(health))
    app.router.add_get("/ready", _ops(ready))
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", _ops(metrics_endpoint))
    return app


def check_open_mode(config: RouterConfig, keys: ApiKeys) -> None:
    """Refuse to serve without API keys on an address other hosts can reach, unless asked to (ValueError)."""
    if not keys.open or config.allow_open:
        return
    try:
        loopback = ipaddress.ip_address(config.host.strip("[]")).is_loopback
    except ValueError:
        loopback = config.host == "localhost"
    if not loopback:
        raise ValueError(f"no API keys and listening on {config.host}: anyone who reaches the port is served, all as "
                         "one tenant. Give keys (--api-keys-file or TURNKV_API_KEYS), listen on 127.0.0.1, or pass "
                         "--allow-open")


#: Allocations between young cyclic-GC passes (CPython's default is 700).
GC_YOUNG_THRESHOLD = 20_000


def tune_gc() -> None:
    """Fewer cyclic-GC passes on the hot path. At CPython's defaults the few hundred containers of each request
    start a young pass every request or two and a full pass every hundred or so, and a full pass walks every object
    the imports left (aiohttp, prometheus_client, the catalog): 4% of the router's CPU at 16 reply tokens (py-spy
    --native). What exists at start is frozen out of the collector, and young passes wait for more allocations.
    Reference counting still frees a request's objects at once; only reference cycles wait for a pass."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)


def serve(config: RouterConfig) -> None:
    """Run the router until SIGINT/SIGTERM (uvloop when available)."""
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    telemetry.setup_logging()
    started = time.time()
    log.info("turnkv router on http://%s:%d mode=%s discovery=%s store=%s prefill=%s decode=%s", config.host,
             config.port, config.mode, config.discovery, config.store.split("@")[-1], config.prefill, config.decode)
    if config.offer_secret is None:
        log.warning("no offer secret (%s or %s, the file the engines read): replayed offers go uncleared, and "
                    "prefill engines recompute every turn unless they run with %s=0", wire.OFFER_SECRET_FILE_ENV,
                    wire.OFFER_SECRET_ENV, wire.REQUIRE_CLEARED_ENV)
    app = build_app(config)
    tune_gc()
    web.run_app(app, host=config.host, port=config.port, print=None, access_log=None,
                handler_cancellation=True, shutdown_timeout=5, keepalive_timeout=config.keepalive_timeout)
    log.info("router stopped after %.0f s", time.time() - started)
