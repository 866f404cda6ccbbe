"""The engine legs of one dispatch: prefill (``max_tokens=1``), decode up to its first event, and the two together
as one attempt, pulled (serially) or pushed (concurrently when prefill's identity is known).

Every leg holds its engine's load through ``pool.lease`` (``router.engines``), so no way out of a leg, an error or
a cancellation, leaves load counted. A failure comes out as an ``UpstreamError`` saying which leg failed and
whether another engine may succeed; whether to try again is the flow's (``router.flow``, ``router.retry``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from router import encoded, guard, migrate, sse, telemetry, upstream
from router.config import RouterConfig
from router.dispatch import Dispatch
from router.engines import Engine, EnginePool, Lease, PushIdentity, prefix
from router.outcomes import ReuseOutcome
from router.telemetry import Metrics
from turnkv import wire

log = logging.getLogger("turnkv.router")

REQUEST_ID_HEADER = wire.REQUEST_ID_HEADER


class UpstreamError(Exception):
    """A leg failed. ``retryable``: another engine may succeed (5xx, connection, timeout)."""

    def __init__(self, status: int, message: str, body: bytes | None = None, *, leg: str = "prefill",
                 engine: Engine | None = None, retryable: bool = False, reason: str = "error",
                 connect: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.body = body
        self.leg = leg
        self.engine = engine
        self.retryable = retryable
        self.reason = reason
        self.connect = connect  # the engine was never reached: it did no work


class _LegIds:
    """Unique ids without a system call each: a random 64-bit prefix per process (drawn again in a forked child)
    and a counter."""

    def __init__(self) -> None:
        self.reseed()
        os.register_at_fork(after_in_child=self.reseed)

    def reseed(self) -> None:
        self.prefix = f"turnkv-{secrets.token_hex(8)}"
        self.counter = itertools.count(1)

    def __call__(self) -> str:
        return f"{self.prefix}{next(self.counter):016x}"


#: The request id both engines see for one dispatch: generated here, never the client's. Upstream's push mode
#: pairs decode's registration with prefill's blocks by this id, so a client-chosen one would let two requests
#: with the same id write into each other's KV. Unique per process and across processes and restarts.
new_leg_id = _LegIds()


def prefill_cached_tokens(kv: Mapping[str, Any]) -> int:
    """Prompt tokens prefill found in its own prefix cache, from its answer's params (turnkv's connector reports
    them apart; 0 from an engine that does not)."""
    value = kv.get(wire.PREFILL_LOCAL_TOKENS)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def reused_tokens(kv: Mapping[str, Any]) -> int:
    """Prompt tokens prefill pulled back from decode (bi-directional mode), from its answer's params: what it did
    not compute (``remote_prefill_cached_tokens``) less its own prefix-cache hits."""
    return max(0, wire.KVParams(kv).prefill_cached_tokens - prefill_cached_tokens(kv))


def push_identity(kv: Mapping[str, Any]) -> PushIdentity | None:
    """P's identity from a push-mode prefill answer (to dispatch the next ones concurrently)."""
    p = wire.KVParams(kv)
    if p.transfer_mode != "push" or not p.engine_id or not p.host:
        return None
    return PushIdentity(str(p.engine_id), str(p.host), p.port, p.tp_size, p.pp_size)


def bind_clearance(secret: bytes | None, params: Mapping[str, Any], target: str) -> Mapping[str, Any]:
    """A cleared replay made again for the prefill engine it is sent to (``turnkv.wire.CLEARED_FOR``: any other
    engine refuses it), same read-by instant, reader and tenant; unchanged when it carries no clearance (fresh, or
    no secret) or the engine's NIXL id is unknown."""
    if not target or secret is None or wire.CLEARANCE not in params or wire.READ_BY not in params:
        return params
    return wire.clear_offer(secret, params, float(params[wire.READ_BY]), params.get(wire.READER),
                            tenant=params.get(wire.CLEARED_TENANT), prefill=target)


def push_decode_params(p: PushIdentity, request_id: str, transfer_id: str) -> dict[str, Any]:
    """What decode is sent in push mode: P's identity, not P's output (no block ids)."""
    return {wire.DO_REMOTE_PREFILL: True, wire.DO_REMOTE_DECODE: False, wire.REMOTE_ENGINE_ID: p.engine_id,
            wire.REMOTE_HOST: p.host, wire.REMOTE_PORT: p.port, wire.TP_SIZE: p.tp_size, wire.PP_SIZE: p.pp_size,
            wire.REMOTE_REQUEST_ID: request_id, wire.TRANSFER_ID: transfer_id}


@dataclass
class Opened:
    """A decode leg that answered 200: the unary body, or the stream's first lines and the response."""

    engine: Engine
    resp: upstream.EngineResponse | None = None
    raw: bytes = b""
    first: bytes = b""
    lease: Lease | None = None  # a stream's load on its engine, held until the relay ends

    def close(self) -> None:
        """End the stream and give back its load: a stream read to its end gives its connection back for the next
        leg; one cut short closes it, which makes vLLM abort the request."""
        if self.resp is not None:
            self.resp.release()
        if self.lease is not None:
            self.lease.release()


def _shared(d: Dispatch) -> bytes | None:
    """The bytes a leg's body is spliced into (``router.encoded``); None: the legs serialise the body whole (the intake
    did not serialise it, or it is too small for splicing to pay)."""
    return d.encoded if d.encoded is not None and len(d.encoded) >= encoded.SPLICE_MIN else None


def prefill_body(d: Dispatch, params: Mapping[str, Any]) -> encoded.Parts:
    """The prefill leg's request: the client's, for one token and no stream, with the KV ``params``."""
    shared = _shared(d)
    if shared is None:  # the whole body, less what the leg must not send
        body = dict(d.body)
        body.pop("min_tokens", None)  # vLLM refuses min_tokens > max_tokens: the prefill leg makes one token
        body.pop("stream_options", None)
    else:  # the leg's fields only (the client's min_tokens and stream_options are left out)
        body = {"return_token_ids": d.body["return_token_ids"]} if "return_token_ids" in d.body else {}
    body["max_tokens"] = 1
    if "max_completion_tokens" in d.body:
        body["max_completion_tokens"] = 1
    if d.migrate:
        body["return_token_ids"] = True  # the rendered prompt, to continue the stream elsewhere if decode dies
    body["stream"] = False
    body["kv_transfer_params"] = params
    return orjson.dumps(body) if shared is None else encoded.splice(shared, body)


def decode_body(d: Dispatch, params: Mapping[str, Any] | None) -> encoded.Parts:
    """The decode leg's request: the client's, with prefill's (or push's) ``params``; None: decode alone, which
    computes the prompt itself (``router.choices``)."""
    shared = _shared(d)
    # the whole body, or the fields the shared bytes leave out: the client's own values of the legs' fields
    body = dict(d.body) if shared is None else {k: d.body[k] for k in encoded.LEG_FIELDS if k in d.body}
    if d.migrate:
        body["return_token_ids"] = True  # the relay counts the tokens sent, to continue right after them
    if params is not None:
        if d.retain:
            # A turn that can be continued: ask decode to keep its KV for the next turn (others pin nothing).
            params = {**params, wire.RETAIN: True}
            if d.tenant_tag:  # decode shares its retention among tenants by it and signs it into its offer
                params[wire.TENANT] = d.tenant_tag
        body["kv_transfer_params"] = params
    return orjson.dumps(body) if shared is None else encoded.splice(shared, body)


class Legs:
    """Sends the legs of one dispatch to the engines, on the router's pooled connections (``router.upstream``)."""

    def __init__(self, config: RouterConfig, pool: EnginePool, metrics: Metrics, client: upstream.LegClient,
                 prefill_rate: telemetry.PrefillRate, *, forward_auth: bool = True) -> None:
        self.config = config
        self.pool = pool
        self.metrics = metrics
        self.client = client
        self.prefill_rate = prefill_rate  # prefill's ms per token, from fresh prefills (the EMF's saved time)
        self.forward_auth = forward_auth
        self._leg = {leg: metrics.leg.labels(leg) for leg in ("prefill", "decode")}
        self._prefill_choices = {r: metrics.prefill_choices.labels(r) for r in prefix.REASONS}
        self._refusals_logged: set[str] = set()  # prefill's offer refusal reasons already logged

    def _headers(self, d: Dispatch, request: web.Request) -> dict[str, str]:
        """Both legs' headers: the router's leg id, never the client's, and the client's key if it is forwarded."""
        headers = {REQUEST_ID_HEADER: d.leg_request_id, "Content-Type": "application/json"}
        if self.forward_auth:
            auth = request.headers.get("Authorization")
            if auth:
                headers["Authorization"] = auth
        return headers

    def _fail(self, leg: str, engine: Engine, exc: BaseException) -> UpstreamError:
        """A network error or timeout of a leg, as the retryable failure it is (counted, and logged by the flow)."""
        kind = type(exc).__name__
        if isinstance(exc, upstream.RouterResourceError):  # the router's own shortage: the engine is not at fault
            self.metrics.router_errors.labels(leg).inc()
            log.error("%s", exc)
            return UpstreamError(503, str(exc), leg=leg, engine=engine, reason="router_resources")
        self.metrics.engine_errors.labels(leg, kind).inc()
        connect = isinstance(exc, (upstream.EngineConnectError, aiohttp.ClientConnectorError))
        if connect:  # only an engine that cannot be reached is ejected; a slow or failing request proves nothing
            self.pool.report_failure(engine)
        status = 504 if isinstance(exc, TimeoutError) else 502
        return UpstreamError(status, f"{leg} engine {engine.name} failed: {str(exc) or kind}", leg=leg, engine=engine,
                             retryable=True, reason="timeout" if status == 504 else "connect" if connect else "error",
                             connect=connect)

    def _http_error(self, leg: str, engine: Engine, status: int, raw: bytes) -> UpstreamError:
        """An engine's non-200 answer: a 4xx is the request's fault (passed on), a 5xx another engine may not have."""
        self.metrics.engine_errors.labels(leg, f"http_{status}").inc()
        return UpstreamError(status if status < 500 else 502, f"{leg} engine {engine.name} answered HTTP {status}",
                             raw, leg=leg, engine=engine, retryable=status >= 500, reason=f"http_{status}")

    async def prefill(self, d: Dispatch, request: web.Request, engine: Engine,
                      params: Mapping[str, Any]) -> dict[str, Any]:
        """The prefill leg on ``engine``: its answer's ``kv_transfer_params`` (what decode is sent in pull mode)."""
        t0 = time.perf_counter()
        d.prefill_engine = engine.name
        params = bind_clearance(self.config.offer_secret, params, engine.nixl_id)
        try:
            with self.pool.lease(engine, d.tokens):
                resp = await self.client.post(engine.url, d.path, prefill_body(d, params), self._headers(d, request),
                                              total_timeout=float(self.config.prefill_timeout))
                try:
                    raw = await resp.read()
                finally:
                    resp.release()
                if resp.status != 200:
                    raise self._http_error("prefill", engine, resp.status, raw)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._fail("prefill", engine, exc) from exc
        elapsed = time.perf_counter() - t0
        self._leg["prefill"].observe(elapsed)
        d.prefill_ms = elapsed * 1000
        if d.migrate:  # the prompt's ids, kept unparsed for a migration (router.migrate)
            raw, d.prompt_ids = migrate.cut_prompt_ids(raw)
        result = orjson.loads(raw)
        kv = result.get("kv_transfer_params")
        if not isinstance(kv, dict):
            raise UpstreamError(502, f"prefill engine {engine.name} returned no kv_transfer_params: "
                                     "is it running with the NIXL connector (--kv-transfer-config)?",
                                leg="prefill", engine=engine)
        usage = result.get("usage") or {}
        d.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        d.prefill_cached_tokens = prefill_cached_tokens(kv)
        self.pool.report_success(engine)
        if not d.stream and d.prefill_share_done is not None:
            d.prefill_share_done()  # a whole answer shows no first token: prefill's work is what the share was for
        if d.outcome == ReuseOutcome.HIT:
            self._account_reuse(d, kv, engine)
        elif d.outcome in (ReuseOutcome.MISS, ReuseOutcome.NONE, ReuseOutcome.DISABLED):
            # The rate of prefill's own work: its prefix-cache hits cost nothing.
            self.prefill_rate.observe(d.prefill_ms, d.prompt_tokens - d.prefill_cached_tokens)
        ident = push_identity(kv)
        if ident is not None:
            engine.learned = ident
        named = wire.KVParams(kv).engine_id
        if isinstance(named, str) and named:
            engine.answered_id = named
        return kv

    def _account_reuse(self, d: Dispatch, prefill_params: Mapping[str, Any], engine: Engine) -> None:
        """Reused tokens, from prefill's answer; a refused offer is counted by reason, a token-proof shortfall is
        a tokenization mismatch."""
        d.reused_tokens = reused_tokens(prefill_params)
        verdict = prefill_params.get(wire.VERDICT)
        reason = verdict.get("reason") if isinstance(verdict, Mapping) else None
        if reason in wire.OFFER_REFUSALS:
            # Prefill did not read the offer at all (the outcome becomes recompute); say why, once per reason.
            self.metrics.offer_refusals.labels(reason).inc()
            if reason not in self._refusals_logged:
                self._refusals_logged.add(reason)
                log.warning("prefill engine %s refused a replayed offer (%s)%s", engine.name, reason,
                            f": does this router hold the engines' offer secret ({wire.OFFER_SECRET_FILE_ENV})?"
                            if reason == "uncleared" else "")
        elif reason in ("mismatch", "no-proof", "bad-proof"):
            # The text history matched but the token ids did not (or could not be checked): re-tokenization,
            # a template that renders past turns differently, or a decode engine without the turnkv connector.
            cause = "tokenization" if reason == "mismatch" else "unverified"
            self.metrics.token_mismatches.labels(cause).inc()
            log.info("token proof verified %s of %s offered tokens (%s)", verdict.get("verified"),
                     verdict.get("offered"), reason)
            d.outcome = ReuseOutcome.TOKEN_MISMATCH

    async def open_decode(self, d: Dispatch, request: web.Request, engine: Engine,
                          params: Mapping[str, Any] | None) -> Opened:
        """Send the decode leg and wait for its first token (stream) or its whole answer (unary)."""
        t0 = time.perf_counter()
        lease = self.pool.lease(engine, d.tokens)
        resp = None
        handed = False
        try:
            resp = await self.client.post(engine.url, d.path, decode_body(d, params), self._headers(d, request),
                                          read_timeout=float(self.config.first_token_timeout))
            if resp.status != 200 or not d.stream:
                raw = await resp.read()
                resp.release()
                if resp.status != 200:
                    raise self._http_error("decode", engine, resp.status, raw)
                self._leg["decode"].observe(time.perf_counter() - t0)
                self.pool.report_success(engine)
                return Opened(engine, raw=raw)
            first = b""
            while True:  # up to the first event: until then another engine may still take over
                chunk = await resp.readany()
                if not chunk:
                    raise upstream.EngineDisconnected("decode closed the stream before its first token")
                first += chunk
                at = first.find(b"data:")
                if at >= 0 and first.find(b"\n", at) >= 0:
                    break
                if len(first) > sse.MAX_LINE:
                    raise sse.LineTooLong(f"decode sent {len(first)} bytes without a complete first event")
            self._leg["decode"].observe(time.perf_counter() - t0)
            self.pool.report_success(engine)
            handed = True  # released (and counted down) by the relay
            return Opened(engine, resp=resp, first=first, lease=lease)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._fail("decode", engine, exc) from exc
        finally:
            if not handed:
                if resp is not None:
                    resp.close()
                lease.release()

    def pick_prefill(self, d: Dispatch, tried: dict[str, list[Engine]]) -> Engine:
        """The prefill engine of an attempt: the home of the request's shared prefix within the load bound
        (``router.engines.prefix``), else by load; a retry skips the engines it tried."""
        if d.prefix_key is None:  # once per request: one hash of the tenant and the prefix digest
            d.prefix_key = prefix.key(d.tenant, d.turn, int(self.config.prefill_affinity_min_bytes))
        engine, reason = self.pool.pick_prefill(d.prefix_key, exclude=tried["prefill"], tokens=d.tokens)
        self._prefill_choices[reason].inc()
        return engine

    async def pull(self, d: Dispatch, request: web.Request, params: dict[str, Any] | None,
                   tried: dict[str, list[Engine]]) -> Opened:
        """One attempt in pull mode: prefill, then decode with prefill's params verbatim."""
        prefill = self.pick_prefill(d, tried)
        kv = await self.prefill(d, request, prefill, params or guard.FRESH_PREFILL_PARAMS)
        decode = self.pool.pick("decode", exclude=tried["decode"], prefer="" if tried["decode"] else d.affinity,
                                tokens=d.tokens)
        d.decode_engine = decode.name
        return await self.open_decode(d, request, decode, kv)

    async def alone(self, d: Dispatch, request: web.Request, params: dict[str, Any] | None,
                    tried: dict[str, list[Engine]]) -> Opened:
        """One attempt with decode alone, which computes the prompt itself: a request of several sequences, which
        one prefill request's KV cannot serve (``router.choices``). No ``kv_transfer_params``, in either mode."""
        decode = self.pool.pick("decode", exclude=tried["decode"], prefer="" if tried["decode"] else d.affinity,
                                tokens=d.tokens)
        d.decode_engine = decode.name
        return await self.open_decode(d, request, decode, None)

    async def push(self, d: Dispatch, request: web.Request, params: dict[str, Any] | None,
                   tried: dict[str, list[Engine]]) -> Opened:
        """One attempt in push mode: both legs at once when prefill's identity is known, serially otherwise."""
        prefill = self.pick_prefill(d, tried)
        decode = self.pool.pick("decode", exclude=tried["decode"], prefer="" if tried["decode"] else d.affinity,
                                tokens=d.tokens)
        d.decode_engine = decode.name
        transfer_id = uuid.uuid4().hex
        p_params = {**(params or guard.FRESH_PREFILL_PARAMS), wire.TRANSFER_ID: transfer_id}
        ident = prefill.push_identity
        if ident is None:  # identity unknown: serial, and learn it from the answer
            self.metrics.push_dispatch.labels("serial").inc()
            kv = await self.prefill(d, request, prefill, p_params)
            ident = push_identity(kv)
            if ident is None:
                raise UpstreamError(502, f"prefill engine {prefill.name} did not answer in push mode "
                                         "(transfer_mode 'push'): are the engines running NixlPushConnector?",
                                    leg="prefill", engine=prefill)
            return await self.open_decode(d, request, decode, push_decode_params(ident, d.leg_request_id,
                                                                                 transfer_id))
        self.metrics.push_dispatch.labels("concurrent").inc()
        p_task = asyncio.create_task(self.prefill(d, request, prefill, p_params))
        d_task = asyncio.create_task(self.open_decode(d, request, decode,
                                                      push_decode_params(ident, d.leg_request_id, transfer_id)))
        handed = False
        try:
            await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_EXCEPTION)
            if d_task.done() and d_task.exception() is not None:
                p_task.cancel()
                raise d_task.exception()  # type: ignore[misc]
            kv = await p_task  # raises: the finally cancels (or releases) decode
            answered = push_identity(kv)
            if answered is not None and answered != ident:  # P moved (restart, new id): resend decode
                log.warning("prefill %s answered as %s, not %s: resending decode", prefill.name, answered, ident)
                await _discard_decode(d_task)
                opened = await self.open_decode(d, request, decode, push_decode_params(answered, d.leg_request_id,
                                                                                       transfer_id))
            else:
                opened = await d_task
            handed = True
            return opened
        finally:
            if not handed:  # prefill failed (or we were cancelled): decode must not stay open or counted
                p_task.cancel()
                await _discard_decode(d_task)


async def _discard_decode(task: asyncio.Task[Opened]) -> None:
    """Cancel a decode leg, or, if it already opened, close its stream and give back its load."""
    task.cancel()
    with contextlib.suppress(BaseException):
        (await task).close()
