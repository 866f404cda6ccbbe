"""The two-leg P/D dispatch: prefill (``max_tokens=1``) and decode, with multi-turn KV reuse.

Per request:
1. look the turn up by its content (``router.guard``: the digest of its messages up to its last
   assistant reply; no client field needed), take the stored decode params (single-use) and keep them
   only if they name a known engine; a client's session id (``router.hints``) only steers the decode
   engine and labels metrics;
2. pull mode: prefill with those params (a pull of the previous turn's KV from decode) or fresh
   ones, then decode with prefill's params verbatim; push mode: prefill and decode at once when the
   prefill engine's identity is known (decode is told where its KV will come from), serially otherwise;
3. stream or return decode's answer, sharing one ``X-Request-Id`` (and ``transfer_id``) per dispatch;
4. take decode's returned params off the response (engine metadata never reaches a client) and
   store them for the next turn.

Failover: a prefill that fails or times out is retried on another prefill engine (``prefill_retries``);
a decode that fails before its first token is retried with both legs on another decode engine
(``decode_retries``; prefill again, because the blocks of the failed dispatch may already be freed);
a retry after a failed reuse pull goes without reuse. A client that goes away cancels the handler,
which closes both upstream connections: vLLM aborts requests whose connection closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from router import apis, guard, hints, limits, migrate, retry, sse, telemetry
from router.apis import stored
from router.config import RouterConfig
from router.deadline import WriteDeadline
from router.dispatch import Dispatch
from router.engines import Engine, EnginePool, NoEngineError
from router.errors import public_message
from router.keepalive import Keepalive
from router.legs import REQUEST_ID_HEADER, Legs, Opened, UpstreamError, new_leg_id
from router.reply import ReplyCollector
from router.state import ConversationStore, Entry
from router.telemetry import Metrics
from turnkv import wire

log = logging.getLogger("turnkv.router")

REUSE_HEADER = "X-TurnKV-Reuse"
REUSED_TOKENS_HEADER = "X-TurnKV-Reused-Tokens"
REUSE_OUTCOME_HEADER = "X-TurnKV-Reuse-Outcome"
CONVERSATION_HEADER = "X-Conversation-Id"


def error_response(status: int, message: str, kind: str = "invalid_request_error",
                   headers: Mapping[str, str] | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "code": status}, "object": "error"}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json", headers=headers)


def client_request_id(raw: str | None) -> str:
    """The client's ``X-Request-Id`` to echo and log, or one of ours; RequestError (400) when it is not
    printable ASCII of at most 128 characters (a header we could not echo back)."""
    if not raw:
        return new_leg_id()
    if len(raw) > 128 or not raw.isascii() or not raw.isprintable():
        raise guard.RequestError("'X-Request-Id' must be printable ASCII of at most 128 characters")
    return raw


class Flow:
    def __init__(self, config: RouterConfig, pool: EnginePool, store: ConversationStore, metrics: Metrics,
                 session: aiohttp.ClientSession, *, forward_auth: bool = True,
                 emf: telemetry.EmfWriter | None = None, responses: stored.ResponseLog | None = None) -> None:
        self.config = config
        self.responses = responses  # kept /v1/responses answers (previous_response_id)
        self.pool = pool
        self.store = store
        self.metrics = metrics
        self.session = session
        self.prefill_rate = telemetry.PrefillRate()
        self.legs = Legs(config, pool, metrics, session, self.prefill_rate, forward_auth=forward_auth)
        self.emf = emf or telemetry.EmfWriter()
        # Prometheus children resolved once (labels() takes a lock and a dict lookup per call)
        self._ttft = {o: metrics.ttft.labels(o) for o in telemetry.OUTCOMES}
        self._reuse = {o: metrics.reuse.labels(o) for o in telemetry.OUTCOMES}
        self._store_seconds = {op: metrics.store_seconds.labels(op) for op in ("take", "put")}
        self.retention = limits.RetentionLedger()
        self.lease_rate = limits.TokenBucket()
        self.hint_sources = hints.parse_sources(config.session_hints)
        self._hint_counts = {s: metrics.session_hints.labels(s.label) for s in self.hint_sources}

    # -- request intake -------------------------------------------------------------------------

    def prepare(self, kind: str, path: str, request: web.Request, body: Any, tenant: str = "",
                size: int = 0, api: apis.Translation | None = None) -> Dispatch:
        if not isinstance(body, dict):
            raise guard.RequestError("the request body must be a JSON object")
        body.pop("kv_transfer_params", None)  # engine metadata is never accepted from clients
        try:
            hint = hints.find(self.hint_sources, request.headers, body)
        except ValueError as exc:
            raise guard.RequestError(str(exc)) from None
        for own in hints.OWN_BODY_FIELDS:
            body.pop(own, None)
        turn = guard.parse_turn(kind, body)
        request_id = client_request_id(request.headers.get(REQUEST_ID_HEADER))
        key = None
        storable = turn is not None
        if turn is not None and turn.kind == "chat":
            if turn.lookup is not None:
                key = guard.content_key(self.config.key_secret, tenant, turn.lookup)
        elif turn is not None:
            storable = hint is not None  # a raw prompt has no turn boundaries: only a session names its slot
            if hint is not None:
                key = guard.hint_key(self.config.key_secret, tenant, hint.value, turn)
        d = Dispatch(kind, path, body, request_id, turn, key, started=time.perf_counter(), tenant=tenant,
                     tokens=size // 4, stream=bool(body.get("stream")), leg_request_id=new_leg_id(), hint=hint,
                     storable=storable)
        d.migrate = int(self.config.decode_migrations) > 0 and migrate.migratable(kind, body)
        if api is not None:  # the engines speak chat; a continuation is translated like the rest of the stream
            d.api, d.route = api, api.route
        if hint is not None:
            self._hint_counts[hint.source].inc()
            d.affinity = hints.rendezvous(tenant, hint.value, [e.name for e in self.pool.decode])
        if request.headers.get(REUSE_HEADER, "").lower() in ("off", "0", "false", "no"):
            d.outcome, d.storable = "disabled", False
        elif key is None:
            d.outcome = "none"
        return d

    async def _take(self, d: Dispatch) -> dict[str, Any] | None:
        """The stored params to replay for this request, or None (and why, in d.outcome)."""
        if d.key is None or d.outcome == "disabled":
            return None
        t0 = time.perf_counter()
        try:
            entry = await asyncio.wait_for(self.store.take(d.key), self.config.store_timeout_ms / 1000)
        except Exception as exc:  # the store is an optimisation: never fail a request because of it
            log.warning("conversation store unavailable (%s); continuing without reuse",
                        exc or type(exc).__name__)
            self.metrics.store_errors.labels("take").inc()
            d.outcome = "store_error"
            return None
        finally:
            self._store_seconds["take"].observe(time.perf_counter() - t0)
        assert d.turn is not None
        self.release_retention(d.key)  # single use: the taken turn no longer counts against the tenant
        if entry is None:
            d.outcome = "miss"
            return None
        d.outcome = guard.reuse_outcome(entry.params, entry.history, entry.expires_at, d.turn, time.time(),
                                        self.pool.known_hosts())
        if d.outcome == "hit" and entry.decode_engine and not self.pool.holds_blocks_since(entry.decode_engine,
                                                                                          entry.stored_at):
            d.outcome = "refused"
            log.warning("decode engine %s was ejected or is unknown since this turn was stored: not replayed",
                        entry.decode_engine)
        elif d.outcome == "hit" and (why := self._evicted(entry)):
            d.outcome = "refused"
            log.info("decode engine %s: stored turn not replayed (%s)", entry.decode_engine, why)
        elif d.outcome == "refused":
            log.warning("stored params name %r, which is no engine of this router: not replayed",
                        entry.params.get("remote_host"))
        if entry.decode_engine:
            d.affinity = entry.decode_engine
        if d.outcome != "hit":
            return None
        # Prefill starts reading within replay_window of now or not at all (router.engines.evictions).
        return {**entry.params, wire.READ_BY: round(time.time() + float(self.config.replay_window), 3)}

    def _evicted(self, entry: Entry) -> str | None:
        """Why decode may have evicted (or be about to free) the entry's blocks, from its evictions feed."""
        engine = self.pool.find(entry.decode_engine) if entry.decode_engine else None
        if engine is None:
            return None
        return engine.feed.refuses(entry.params.get("remote_request_id"), time.time(),
                                   float(self.config.evictions_interval))

    async def _remember(self, d: Dispatch, decode: Engine, params: Any, reply: Mapping[str, Any] | str) -> None:
        replay = guard.replayable(params)
        if not d.retain or d.turn is None or replay is None:
            return
        now = time.time()
        expires = guard.entry_expiry(now, self.config.entry_lifetime(), replay, float(self.config.expiry_margin))
        if expires <= now:
            return
        history = d.turn.extended_by(reply)
        key = guard.content_key(self.config.key_secret, d.tenant, history) if d.kind == "chat" else d.key
        if key is None:
            return
        entry = Entry(replay, history, expires, decode.name, now)
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(self.store.put(key, entry), self.config.store_timeout_ms / 1000)
            self.hold_retention(d.tenant, key, entry, expires)
        except Exception as exc:
            self.metrics.store_errors.labels("put").inc()
            log.warning("could not store conversation state (%s)", exc or type(exc).__name__)
        finally:
            self._store_seconds["put"].observe(time.perf_counter() - t0)

    # -- retention limits (per tenant, this process) -----------------------------------------------

    async def _keep_response(self, d: Dispatch, reply: Mapping[str, Any] | str) -> None:
        """Keep an answer another API can continue by id (``/v1/responses``' previous_response_id)."""
        if d.api is None or self.responses is None:
            return
        kept = d.api.kept(reply)
        if kept is not None:
            await self.responses.save(d.tenant, *kept)

    def hold_retention(self, tenant: str, key: str, entry: Entry, expires: float) -> None:
        self.retention.hold(tenant, key, int(entry.params.get("remote_num_tokens") or 0), expires)

    def release_retention(self, key: str) -> None:
        self.retention.release(key)

    def _may_retain(self, d: Dispatch) -> bool:
        if not d.storable:
            return False
        budget = d.tokens + int(d.body.get("max_tokens") or d.body.get("max_completion_tokens") or 0)
        if self.retention.allows(d.tenant, budget, int(self.config.tenant_max_conversations),
                                 int(self.config.tenant_max_retained_tokens)):
            return True
        self.metrics.retention_refused.inc()
        return False

    def log_engine_error(self, leg: str, engine: Engine, exc: BaseException) -> None:
        self.metrics.engine_errors.labels(leg, type(exc).__name__).inc()
        log.warning("%s engine %s failed: %s", leg, engine.name, str(exc) or type(exc).__name__)

    async def _dispatch(self, d: Dispatch, request: web.Request) -> Opened:
        """Both legs, with the retry budgets; returns the opened decode leg or raises UpstreamError."""
        params = await self._take(d)
        d.retain = self._may_retain(d)
        tried: dict[str, list[Engine]] = {"prefill": [], "decode": list(d.extra.get("avoid_decode", ()))}
        budget = {"prefill": int(self.config.prefill_retries), "decode": int(self.config.decode_retries)}
        attempt = self.legs.push if self.config.mode == "push" else self.legs.pull
        while True:
            try:
                opened = await attempt(d, request, params, tried)
                if d.outcome == "hit" and not d.reused_tokens:
                    d.outcome = "recompute"  # replayed, but prefill pulled nothing (failed or below threshold)
                return opened
            except UpstreamError as exc:
                failure = retry.Failure(exc.leg, exc.retryable, exc.connect, exc.engine is not None)
                decision = retry.decide(failure, budget[exc.leg], replaying=params is not None)
                if not decision.retry:
                    raise
                budget[exc.leg] -= 1
                tried[exc.leg].append(exc.engine)  # type: ignore[arg-type]  # engine_known
                d.retries += 1
                d.leg_request_id = new_leg_id()
                self.metrics.retries.labels(exc.leg, exc.reason).inc()
                if decision.drop_reuse:
                    params = None
                    d.outcome, d.reused_tokens = "recompute", 0
                log.warning("%s; retrying (%s retries left for %s)", exc, budget[exc.leg], exc.leg)

    # -- responses ------------------------------------------------------------------------------

    def _reply_headers(self, d: Dispatch) -> dict[str, str]:
        return {REQUEST_ID_HEADER: d.request_id, REUSED_TOKENS_HEADER: str(d.reused_tokens),
                REUSE_OUTCOME_HEADER: d.outcome}

    def _upstream_error(self, d: Dispatch, exc: UpstreamError) -> web.Response:
        log.warning("%s", exc)
        d.error = str(exc)
        kind = "invalid_request_error" if 400 <= exc.status < 500 else "upstream_error"
        return error_response(exc.status, public_message(exc), kind, headers=self._reply_headers(d))

    async def run(self, d: Dispatch, request: web.Request) -> web.StreamResponse:
        token = telemetry.request_id.set(d.request_id)
        try:
            response = await (self._run_stream(d, request) if d.stream else self._run_unary(d, request))
            d.status = d.status or response.status
            return response
        except asyncio.CancelledError:
            self.metrics.client_disconnects.inc()
            d.status, d.error = 499, "client disconnected"
            log.info("client disconnected: both legs aborted")
            raise
        finally:
            self._finish(d)
            telemetry.request_id.reset(token)

    def _finish(self, d: Dispatch) -> None:
        self._reuse[d.outcome].inc()
        if d.reused_tokens:
            self.metrics.reused_tokens.inc(d.reused_tokens)
        if not self.config.emf:
            return
        saved = None
        if d.reused_tokens and self.prefill_rate.ms_per_token:
            saved = d.reused_tokens * self.prefill_rate.ms_per_token
        self.emf.emit(telemetry.emf_record(
            namespace=telemetry.NAMESPACE, deployment=self.config.deployment, outcome=d.outcome,
            prompt_tokens=d.prompt_tokens, ttft_ms=None if d.ttft is None else d.ttft * 1000,
            error=d.status >= 500 or d.status == 0, reused_tokens=d.reused_tokens, prefill_ms=d.prefill_ms,
            saved_ms=saved, fields={
                "request_id": d.request_id, "status": d.status, "route": d.route or d.path, "stream": d.stream,
                "tenant": d.tenant, "prefill_engine": d.prefill_engine, "decode_engine": d.decode_engine,
                "prompt_tokens": d.prompt_tokens, "retries": d.retries, "mode": self.config.mode,
                "latency_ms": round((time.perf_counter() - d.started) * 1000, 3),
                **({"session": d.hint.value, "session_source": d.hint.source.label} if d.hint else {}),
                **({"error": d.error} if d.error else {})}))

    def _first_token(self, d: Dispatch) -> None:
        d.ttft = time.perf_counter() - d.started
        self._ttft[d.outcome].observe(d.ttft)

    async def _run_unary(self, d: Dispatch, request: web.Request) -> web.StreamResponse:
        try:
            opened = await self._dispatch(d, request)
        except UpstreamError as exc:
            return self._upstream_error(d, exc)
        except NoEngineError as exc:
            d.error = str(exc)
            return error_response(503, str(exc), "service_unavailable", headers=self._reply_headers(d))
        result = orjson.loads(opened.raw)
        kv = result.pop("kv_transfer_params", None)
        self._first_token(d)
        choices = result.get("choices") or [{}]
        reply = guard.reply_message(choices[0]) if d.kind == "chat" else str(choices[0].get("text") or "")
        await self._remember(d, opened.engine, kv, reply)
        if d.api is not None:
            result = d.api.unary(result)
            await self._keep_response(d, reply)
        return web.Response(body=orjson.dumps(result), content_type="application/json",
                            headers=self._reply_headers(d))

    async def _run_stream(self, d: Dispatch, request: web.Request) -> web.StreamResponse:
        # Before the first token: SSE comments keep idle-timeout proxies (ALB) from closing (router.keepalive).
        keepalive = Keepalive(request, {REQUEST_ID_HEADER: d.request_id, "Content-Type": "text/event-stream",
                                        "Cache-Control": "no-cache"}, float(self.config.sse_keepalive),
                              float(self.config.write_timeout))
        opened: Opened | None = None
        try:
            try:
                opened = await self._dispatch(d, request)
            except (UpstreamError, NoEngineError) as exc:
                response = await keepalive.stop()
                if response is None:
                    if isinstance(exc, NoEngineError):
                        d.error = str(exc)
                        return error_response(503, str(exc), "service_unavailable", headers=self._reply_headers(d))
                    return self._upstream_error(d, exc)
                d.error = str(exc)
                status = exc.status if isinstance(exc, UpstreamError) else 503
                await self._error_event(d, response, public_message(exc) if isinstance(exc, UpstreamError)
                                        else str(exc), status)
                return response
            response = await keepalive.stop()
            early = response is not None
            if response is None:
                response = web.StreamResponse(headers={**self._reply_headers(d), "Content-Type": "text/event-stream",
                                                       "Cache-Control": "no-cache"})
                await response.prepare(request)
            return await self._relay(d, response, opened, early, request)
        finally:
            await keepalive.stop()
            if opened is not None:
                opened.close()

    async def _error_event(self, d: Dispatch, response: web.StreamResponse, message: str, status: int = 502) -> None:
        if d.api is not None:
            data = d.api.error_event(status, message)
        else:
            err = {"error": {"message": message, "type": "upstream_error", "code": status}}
            data = b"data: " + orjson.dumps(err) + b"\n\ndata: [DONE]\n\n"
        with contextlib.suppress(ConnectionError, aiohttp.ClientConnectionResetError):  # the client may be gone too
            await response.write_eof(data)

    async def _relay(self, d: Dispatch, response: web.StreamResponse, opened: Opened, early: bool,
                     request: web.Request | None = None) -> web.StreamResponse:
        assert opened.resp is not None
        deadline = WriteDeadline(float(self.config.write_timeout))
        try:
            return await self._relay_lines(d, response, opened, early, request, deadline)
        finally:
            deadline.close()

    async def _relay_lines(self, d: Dispatch, response: web.StreamResponse, opened: Opened, early: bool,
                           request: web.Request | None, deadline: WriteDeadline) -> web.StreamResponse:
        assert opened.resp is not None
        reply = ReplyCollector(d.kind, parse=d.retain or (d.api is not None and d.api.keeps_reply))
        api = d.api
        state = migrate.StreamState(d.kind, bool(d.body.get("return_token_ids"))) if d.migrate else None
        remembered = False
        first = True
        tail: list[bytes] = []
        lines = sse.LineCollector()
        try:
            async for chunk in _chunks(opened.first, opened.resp.content):
                out = []  # one write per chunk received, not per line
                for line in lines.feed(chunk):
                    if state is not None:
                        line = state.observe(line)
                    fed = reply.feed(line)
                    if reply.complete and not remembered:
                        # Store before the client sees [DONE]: its next turn may follow at once.
                        remembered = True
                        if reply.storable:
                            await self._remember(d, opened.engine, reply.kv_transfer_params, reply.value())
                            await self._keep_response(d, reply.value())
                        if early:  # the headers left before the outcome was known: say it in a comment
                            out.append(f": turnkv reuse_outcome={d.outcome} "
                                       f"reused_tokens={d.reused_tokens}\n\n".encode())
                    if fed is not None:
                        out.append(fed if api is None else api.stream_line(fed))
                if first and (reply.has_content or reply.complete):
                    first = False
                    self._first_token(d)
                if reply.complete:  # [DONE] seen: the rest goes out with the end of the stream
                    tail.extend(out)
                elif out:
                    await _client_write(response, b"".join(out), deadline=deadline)
            if rest := lines.flush():
                fed = reply.feed(rest)
                if fed:
                    tail.append(fed if api is None else api.stream_line(fed))
            await _client_write(response, b"".join(tail), eof=True, deadline=deadline)
        except _ClientGone as gone:
            self.metrics.client_disconnects.inc()
            d.status, d.error = 499, "client disconnected"
            if gone.slow:
                self.metrics.slow_readers.inc()
                d.error = "client did not read within write_timeout"
                if request is not None and request.transport is not None:
                    request.transport.close()  # aiohttp would otherwise wait on the full buffer at the end
            log.info("client %s mid-stream: decode aborted", "too slow" if gone.slow else "went away")
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.metrics.engine_errors.labels("decode", type(exc).__name__).inc()
            error = f"decode engine {opened.engine.name} failed mid-stream: {exc or type(exc).__name__}"
            log.warning("%s", error)
            if reply.complete:  # [DONE] had arrived: only the end of the stream is missing
                with contextlib.suppress(_ClientGone):
                    await _client_write(response, b"".join(tail), eof=True, deadline=deadline)
                return response
            if state is not None and await self._migrate(d, request, response, opened.engine, state, deadline):
                return response
            d.error = error
            await self._error_event(d, response, "the model server failed mid-stream; the reply is incomplete")
        return response

    async def _migrate(self, d: Dispatch, request: web.Request | None, response: web.StreamResponse, dead: Engine,
                       state: migrate.StreamState, deadline: WriteDeadline) -> bool:
        """Continue a stream whose decode died on another decode engine (router.migrate); True when it ended
        normally ([DONE] sent). Up to ``decode_migrations`` times; every token is relayed exactly once."""
        prompt = migrate.prompt_ids(d.prompt_ids) if d.prompt_ids is not None else None
        if request is None or not prompt:
            return False
        if not state.ids_parse():
            log.warning("decode sent token ids that are not integers: the stream cannot be continued")
            return False
        avoid = [dead]
        state.prompt_tokens = len(prompt)
        for _ in range(int(self.config.decode_migrations)):
            body = migrate.continuation_body(d.body, prompt + state.generated, len(state.generated))
            if body is None:
                break
            c = Dispatch("completion", "/v1/completions", body, d.request_id, None, None, started=d.started,
                         tenant=d.tenant, tokens=d.tokens + len(state.generated), stream=True,
                         leg_request_id=new_leg_id(), extra={"avoid_decode": list(avoid)})
            try:
                opened = await self._dispatch(c, request)
            except (UpstreamError, NoEngineError) as exc:
                log.warning("stream migration: no engine took over (%s)", exc)
                break
            log.warning("decode engine %s died mid-stream after %d tokens: continuing on %s", dead.name,
                        len(state.generated), opened.engine.name)
            d.retries += 1
            try:
                if await self._relay_continuation(response, opened, state, deadline, d.api):
                    self.metrics.migrations.labels("continued").inc()
                    return True
            except _ClientGone:
                return True  # the client left: nothing more to send
            finally:
                opened.close()
            avoid.append(opened.engine)
            dead = opened.engine
        self.metrics.migrations.labels("failed").inc()
        return False

    async def _relay_continuation(self, response: web.StreamResponse, opened: Opened, state: migrate.StreamState,
                                  deadline: WriteDeadline, api: apis.Translation | None = None) -> bool:
        """Relay a continuation stream in the client's format (chat chunks, then through ``api`` for a translated
        stream); True at [DONE], False when it failed too."""
        assert opened.resp is not None
        lines = sse.LineCollector()
        try:
            async for chunk in _chunks(opened.first, opened.resp.content):
                out = []
                for line in lines.feed(chunk):
                    payload = sse.data_of(line)
                    if payload is None:
                        continue
                    if payload == sse.DONE:
                        done = b"data: [DONE]\n\n"
                        out.append(done if api is None else api.stream_line(done))
                        await _client_write(response, b"".join(out), eof=True, deadline=deadline)
                        return True
                    try:
                        rewritten = state.rewrite(orjson.loads(payload))
                    except orjson.JSONDecodeError:
                        continue
                    if rewritten is not None:
                        out.append(rewritten if api is None else api.stream_line(rewritten))
                if out:
                    await _client_write(response, b"".join(out), deadline=deadline)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("continuation on %s failed too: %s", opened.engine.name, exc or type(exc).__name__)
        return False


class _ClientGone(Exception):
    """Writing to the client failed: it went away, or did not read within the write deadline (``slow``)."""

    def __init__(self, slow: bool = False) -> None:
        super().__init__()
        self.slow = slow


async def _client_write(response: web.StreamResponse, data: bytes, eof: bool = False, *,
                        deadline: WriteDeadline) -> None:
    try:
        await deadline.run(response.write_eof(data) if eof else response.write(data))
    except (ConnectionError, aiohttp.ClientConnectionResetError) as exc:
        raise _ClientGone() from exc
    except TimeoutError as exc:
        raise _ClientGone(slow=True) from exc


async def _chunks(first: bytes, rest: aiohttp.StreamReader):
    if first:
        yield first
    async for chunk in rest.iter_any():
        yield chunk
