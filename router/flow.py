"""The two-leg P/D dispatch: prefill (``max_tokens=1``) then decode, with multi-turn KV reuse.

Per request:
1. take the conversation's stored decode params (single-use) and keep them only if the new
   prompt extends the stored history exactly (``router.guard``);
2. prefill with those params (a pull of the previous turn's KV from decode) or fresh ones;
3. decode with prefill's params verbatim, streaming or not, sharing one ``X-Request-Id``;
4. take decode's returned params off the response (engine metadata never reaches a client) and
   store them for the next turn.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from router import guard
from router.config import RouterConfig
from router.engines import Engine, EnginePool, NoEngineError
from router.state import ConversationStore, Entry
from router.telemetry import Metrics

log = logging.getLogger("turnkv.router")

REUSE_HEADER = "X-TurnKV-Reuse"
REUSED_TOKENS_HEADER = "X-TurnKV-Reused-Tokens"
REUSE_OUTCOME_HEADER = "X-TurnKV-Reuse-Outcome"
CONVERSATION_HEADER = "X-Conversation-Id"
REQUEST_ID_HEADER = "X-Request-Id"


def error_response(status: int, message: str, kind: str = "invalid_request_error",
                   headers: Mapping[str, str] | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "code": status}, "object": "error"}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json", headers=headers)


class UpstreamError(Exception):
    def __init__(self, status: int, message: str, body: bytes | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body


@dataclass
class Dispatch:
    """One client request on its way through the two legs."""

    kind: str  # "chat" | "completion"
    path: str
    body: dict[str, Any]
    request_id: str
    turn: guard.Turn | None
    key: str | None
    outcome: str = "none"
    reused_tokens: int = 0
    started: float = 0.0


class Flow:
    def __init__(self, config: RouterConfig, pool: EnginePool, store: ConversationStore, metrics: Metrics,
                 session: aiohttp.ClientSession) -> None:
        self.config = config
        self.pool = pool
        self.store = store
        self.metrics = metrics
        self.session = session

    # -- request intake -------------------------------------------------------------------------

    def prepare(self, kind: str, path: str, request: web.Request, body: Any, tenant: str = "") -> Dispatch:
        if not isinstance(body, dict):
            raise guard.RequestError("the request body must be a JSON object")
        body.pop("kv_transfer_params", None)  # engine metadata is never accepted from clients
        conversation_id = body.pop("conversation_id", None) or request.headers.get(CONVERSATION_HEADER)
        if conversation_id is not None and (not isinstance(conversation_id, str) or not conversation_id
                                            or len(conversation_id) > 256):
            raise guard.RequestError("'conversation_id' must be a non-empty string of at most 256 characters")
        turn = guard.parse_turn(kind, body)
        request_id = request.headers.get(REQUEST_ID_HEADER) or f"turnkv-{uuid.uuid4().hex}"
        key = None
        if conversation_id and turn is not None:
            key = guard.conversation_key(self.config.key_secret, tenant, conversation_id, turn)
        d = Dispatch(kind, path, body, request_id, turn, key, started=time.perf_counter())
        if key is None:
            d.outcome = "none"
        elif request.headers.get(REUSE_HEADER, "").lower() in ("off", "0", "false", "no"):
            d.outcome = "disabled"
        return d

    async def _take(self, d: Dispatch) -> dict[str, Any] | None:
        """The stored params to replay for this request, or None (and why, in d.outcome)."""
        if d.key is None or d.outcome == "disabled":
            return None
        t0 = time.perf_counter()
        try:
            entry = await asyncio.wait_for(self.store.take(d.key), self.config.store_timeout_ms / 1000)
        except Exception as exc:  # the store is an optimisation: never fail a request because of it
            log.warning("request %s: conversation store unavailable (%s); continuing without reuse",
                        d.request_id, exc or type(exc).__name__)
            d.outcome = "store_error"
            return None
        finally:
            self.metrics.store_seconds.labels("take").observe(time.perf_counter() - t0)
        if entry is None:
            d.outcome = "miss"
            return None
        assert d.turn is not None
        if not d.turn.continues(entry.history):
            d.outcome = "mismatch"
            return None
        d.outcome = "hit"
        return entry.params

    async def _remember(self, d: Dispatch, decode: Engine, params: Any, reply: Mapping[str, Any] | str) -> None:
        replay = guard.replayable(params)
        if d.key is None or d.turn is None or replay is None or d.outcome == "disabled":
            return
        entry = Entry(replay, d.turn.extended_by(reply), time.time() + self.config.entry_lifetime(), decode.name)
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(self.store.put(d.key, entry), self.config.store_timeout_ms / 1000)
        except Exception as exc:
            log.warning("request %s: could not store conversation state (%s)", d.request_id,
                        exc or type(exc).__name__)
        finally:
            self.metrics.store_seconds.labels("put").observe(time.perf_counter() - t0)

    # -- legs -----------------------------------------------------------------------------------

    def _headers(self, d: Dispatch, request: web.Request) -> dict[str, str]:
        headers = {REQUEST_ID_HEADER: d.request_id, "Content-Type": "application/json"}
        auth = request.headers.get("Authorization")
        if auth:
            headers["Authorization"] = auth
        return headers

    async def _prefill(self, d: Dispatch, request: web.Request, params: dict[str, Any] | None) -> dict[str, Any]:
        body = dict(d.body)
        body["max_tokens"] = 1
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        body["stream"] = False
        body.pop("stream_options", None)
        body["kv_transfer_params"] = params or guard.FRESH_PREFILL_PARAMS
        engine = self.pool.pick("prefill")
        timeout = aiohttp.ClientTimeout(total=self.config.prefill_timeout, sock_connect=5)
        t0 = time.perf_counter()
        engine.outstanding += 1
        try:
            async with self.session.post(engine.url + d.path, data=orjson.dumps(body),
                                         headers=self._headers(d, request), timeout=timeout) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    self.metrics.engine_errors.labels("prefill", f"http_{resp.status}").inc()
                    raise UpstreamError(resp.status if resp.status < 500 else 502,
                                        f"prefill engine {engine.name} answered HTTP {resp.status}", raw)
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.metrics.engine_errors.labels("prefill", type(exc).__name__).inc()
            status = 504 if isinstance(exc, TimeoutError) else 502
            raise UpstreamError(status, f"prefill engine {engine.name} failed: {exc or type(exc).__name__}") from exc
        finally:
            engine.outstanding -= 1
        self.metrics.leg.labels("prefill").observe(time.perf_counter() - t0)
        result = orjson.loads(raw)
        kv = result.get("kv_transfer_params")
        if not isinstance(kv, dict):
            raise UpstreamError(502, f"prefill engine {engine.name} returned no kv_transfer_params: "
                                     "is it running with the NIXL connector (--kv-transfer-config)?")
        if d.outcome == "hit":
            self._account_reuse(d, kv)
        return kv

    def _account_reuse(self, d: Dispatch, prefill_params: Mapping[str, Any]) -> None:
        """Reused tokens, from prefill's answer; a token-proof shortfall is a tokenization mismatch."""
        d.reused_tokens = int(prefill_params.get("remote_prefill_cached_tokens") or 0)
        verdict = prefill_params.get("turnkv_proof_verdict")
        if isinstance(verdict, Mapping) and verdict.get("reason") in ("mismatch", "no-proof", "bad-proof"):
            # The text history matched but the token ids did not (or could not be checked): re-tokenization,
            # a template that renders past turns differently, or a decode engine without the turnkv connector.
            cause = "tokenization" if verdict["reason"] == "mismatch" else "unverified"
            self.metrics.token_mismatches.labels(cause).inc()
            log.info("request %s: token proof verified %s of %s offered tokens (%s)", d.request_id,
                     verdict.get("verified"), verdict.get("offered"), verdict["reason"])
            d.outcome = "token_mismatch"

    def _decode_body(self, d: Dispatch, prefill_params: dict[str, Any]) -> bytes:
        body = dict(d.body)
        if d.key is not None and d.outcome != "disabled":
            # A conversation turn: ask decode to keep its KV for the next turn (others pin nothing).
            prefill_params = {**prefill_params, "turnkv_retain": True}
        body["kv_transfer_params"] = prefill_params
        return orjson.dumps(body)

    def _reply_headers(self, d: Dispatch) -> dict[str, str]:
        return {REQUEST_ID_HEADER: d.request_id, REUSED_TOKENS_HEADER: str(d.reused_tokens),
                REUSE_OUTCOME_HEADER: d.outcome}

    async def run(self, d: Dispatch, request: web.Request) -> web.StreamResponse:
        params = await self._take(d)
        try:
            prefill_params = await self._prefill(d, request, params)
        except UpstreamError as exc:
            return self._upstream_error(d, exc)
        except NoEngineError as exc:
            return error_response(503, str(exc), "service_unavailable")
        self.metrics.reuse.labels(d.outcome).inc()
        if d.reused_tokens:
            self.metrics.reused_tokens.inc(d.reused_tokens)
        try:
            decode = self.pool.pick("decode")
        except NoEngineError as exc:
            return error_response(503, str(exc), "service_unavailable")
        if d.body.get("stream"):
            return await self._stream(d, request, decode, prefill_params)
        return await self._unary(d, request, decode, prefill_params)

    def _upstream_error(self, d: Dispatch, exc: UpstreamError) -> web.Response:
        log.warning("request %s: %s", d.request_id, exc)
        if exc.body and 400 <= exc.status < 500:  # the engine refused the request: pass its words on
            return web.Response(status=exc.status, body=exc.body, content_type="application/json",
                                headers=self._reply_headers(d))
        return error_response(exc.status, str(exc), "upstream_error", headers=self._reply_headers(d))

    async def _unary(self, d: Dispatch, request: web.Request, decode: Engine,
                     prefill_params: dict[str, Any]) -> web.StreamResponse:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=self.config.first_token_timeout)
        decode.outstanding += 1
        try:
            async with self.session.post(decode.url + d.path, data=self._decode_body(d, prefill_params),
                                         headers=self._headers(d, request), timeout=timeout) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.metrics.engine_errors.labels("decode", type(exc).__name__).inc()
            return self._upstream_error(d, UpstreamError(504 if isinstance(exc, TimeoutError) else 502,
                                                         f"decode engine {decode.name} failed: {exc!r}"))
        finally:
            decode.outstanding -= 1
        if status != 200:
            self.metrics.engine_errors.labels("decode", f"http_{status}").inc()
            return self._upstream_error(d, UpstreamError(status if status < 500 else 502,
                                                         f"decode engine {decode.name} answered HTTP {status}", raw))
        result = orjson.loads(raw)
        kv = result.pop("kv_transfer_params", None)
        self.metrics.ttft.labels(d.outcome).observe(time.perf_counter() - d.started)
        choices = result.get("choices") or [{}]
        reply = guard.reply_message(choices[0]) if d.kind == "chat" else str(choices[0].get("text") or "")
        await self._remember(d, decode, kv, reply)
        return web.Response(body=orjson.dumps(result), content_type="application/json",
                            headers=self._reply_headers(d))

    async def _stream(self, d: Dispatch, request: web.Request, decode: Engine,
                      prefill_params: dict[str, Any]) -> web.StreamResponse:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=self.config.first_token_timeout)
        decode.outstanding += 1
        response: web.StreamResponse | None = None
        try:
            async with self.session.post(decode.url + d.path, data=self._decode_body(d, prefill_params),
                                         headers=self._headers(d, request), timeout=timeout) as resp:
                if resp.status != 200:
                    raw = await resp.read()
                    self.metrics.engine_errors.labels("decode", f"http_{resp.status}").inc()
                    return self._upstream_error(d, UpstreamError(
                        resp.status if resp.status < 500 else 502,
                        f"decode engine {decode.name} answered HTTP {resp.status}", raw))
                response = web.StreamResponse(headers={**self._reply_headers(d), "Content-Type": "text/event-stream",
                                                       "Cache-Control": "no-cache"})
                await response.prepare(request)
                reply = _ReplyCollector(d.kind)
                first = True
                remembered = False
                async for line in resp.content:
                    out = reply.feed(line)
                    if reply.complete and not remembered:
                        # Store before the client sees [DONE]: its next turn may follow at once.
                        remembered = True
                        if reply.storable:
                            await self._remember(d, decode, reply.kv_transfer_params, reply.value())
                    if out is None:
                        continue
                    await response.write(out)
                    if first and reply.has_content:
                        first = False
                        self.metrics.ttft.labels(d.outcome).observe(time.perf_counter() - d.started)
                await response.write_eof()
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.metrics.engine_errors.labels("decode", type(exc).__name__).inc()
            message = f"decode engine {decode.name} failed: {exc or type(exc).__name__}"
            if response is None:
                return self._upstream_error(d, UpstreamError(504 if isinstance(exc, TimeoutError) else 502, message))
            # Headers are gone: end the stream with an error event the client can parse.
            err = {"error": {"message": message, "type": "upstream_error", "code": 502}}
            await response.write(b"data: " + orjson.dumps(err) + b"\n\ndata: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            decode.outstanding -= 1
        return response


class _ReplyCollector:
    """Reads decode's SSE lines: forwards them, strips ``kv_transfer_params``, rebuilds the reply."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.content: list[str] = []
        self.reasoning: dict[str, list[str]] = {}  # "reasoning_content" / "reasoning" deltas, as named
        self.kv_transfer_params: dict[str, Any] | None = None
        self.has_content = False
        self.complete = False
        self.storable = True
        self._drop_separator = False

    def feed(self, line: bytes) -> bytes | None:
        if not line.startswith(b"data: "):
            if self._drop_separator and not line.strip():
                self._drop_separator = False
                return None  # the blank line that ended a chunk we removed
            return line
        payload = line[6:].strip()
        if payload == b"[DONE]":
            self.complete = True
            return line
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return line
        if not isinstance(chunk, dict):
            return line
        if "kv_transfer_params" in chunk:
            self.kv_transfer_params = chunk.pop("kv_transfer_params")
            if not chunk.get("choices") and not chunk.get("usage"):
                self._drop_separator = True
                return None  # the connector's params-only chunk: nothing left for the client
            line = b"data: " + orjson.dumps(chunk) + b"\n"
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                self.storable = False
                continue
            if self.kind == "chat":
                delta = choice.get("delta") or {}
                if delta.get("tool_calls"):
                    self.storable = False  # tool-call deltas are not rebuilt here: no reuse rather than a guess
                text = delta.get("content")
                for field in ("reasoning_content", "reasoning"):
                    if delta.get(field):
                        self.reasoning.setdefault(field, []).append(delta[field])
            else:
                text = choice.get("text")
            if text:
                self.content.append(text)
                self.has_content = True
        return line

    def value(self) -> dict[str, Any] | str:
        text = "".join(self.content)
        if self.kind != "chat":
            return text
        message: dict[str, Any] = {"role": "assistant", "content": text}
        for field, parts in self.reasoning.items():
            message[field] = "".join(parts)
        return guard.canonical_message(message)
