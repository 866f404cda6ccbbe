"""The client's side of a stream: decode's SSE relayed to the client as it comes, and a stream whose decode died
continued on another decode engine (``router.migrate``) without losing or repeating a token.

The relay writes once per chunk received, bounds every write by one per-stream deadline (``router.deadline``),
stores the turn before the client sees ``[DONE]`` (its next turn may follow at once), and ends with an error event
when decode fails mid-stream and the stream cannot go on. What it needs of the flow (dispatching a continuation,
storing the reply, timing the first token) it is handed as callables, so it does not import the flow.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from router import apis, migrate, sse, upstream, usage
from router.config import RouterConfig
from router.deadline import WriteDeadline
from router.dispatch import Dispatch
from router.engines import Engine, NoEngineError
from router.legs import Opened, UpstreamError, new_leg_id
from router.outcomes import RequestKind
from router.reply import ReplyCollector
from router.telemetry import Metrics

log = logging.getLogger("turnkv.router")

#: Both legs of a dispatch with the flow's retries: how a continuation is sent (``Flow._dispatch``).
Dispatcher = Callable[[Dispatch, web.Request], Awaitable[Opened]]
#: Keeps a finished reply for the next turn (and for ``previous_response_id``): decode's engine, params, reply.
ReplyStore = Callable[[Dispatch, Engine, Any, Mapping[str, Any] | str], Awaitable[None]]


class SseResponse(web.StreamResponse):
    """A client's event stream whose headers leave with its first event: one send where aiohttp makes two (the
    headers at ``prepare``, then the event). The first event is at hand when the stream is prepared (decode's
    first chunk, or a keepalive comment), so nothing waits on this."""

    _send_headers_immediately = False  # aiohttp's switch (web.Response has it off): an unknown name is ignored


async def error_event(d: Dispatch, response: web.StreamResponse, message: str, status: int = 502) -> None:
    """End ``response`` with an error event in the client's format (the stream has begun: no status to send)."""
    if d.api is not None:
        data = d.api.error_event(status, message)
    else:
        err = {"error": {"message": message, "type": "upstream_error", "code": status}}
        data = b"data: " + orjson.dumps(err) + b"\n\ndata: [DONE]\n\n"
    with contextlib.suppress(ConnectionError, aiohttp.ClientConnectionResetError):  # the client may be gone too
        await response.write_eof(data)


class Relay:
    """Relays decode streams to their clients, continuing one whose decode died through ``dispatch``."""

    def __init__(self, config: RouterConfig, metrics: Metrics, *, dispatch: Dispatcher, store_reply: ReplyStore,
                 first_token: Callable[[Dispatch], None]) -> None:
        self.config = config
        self.metrics = metrics
        self._dispatch = dispatch
        self._store_reply = store_reply
        self._first_token = first_token
        self._itl = metrics.inter_token_latency

    async def stream(self, d: Dispatch, response: web.StreamResponse, opened: Opened, early: bool,
                     request: web.Request | None = None) -> web.StreamResponse:
        """Relay ``opened`` to the prepared ``response`` to its end (``early``: the headers left before the reuse
        outcome was known, by a keepalive comment); the caller closes ``opened``."""
        assert opened.resp is not None
        deadline = WriteDeadline(float(self.config.write_timeout))
        try:
            return await self._lines(d, response, opened, early, request, deadline)
        finally:
            deadline.close()

    async def _lines(self, d: Dispatch, response: web.StreamResponse, opened: Opened, early: bool,
                     request: web.Request | None, deadline: WriteDeadline) -> web.StreamResponse:
        assert opened.resp is not None
        reply = ReplyCollector(d.kind, parse=d.retain or (d.api is not None and d.api.keeps_reply))
        api = d.api
        state = migrate.StreamState(d.kind, bool(d.body.get("return_token_ids"))) if d.migrate else None
        remembered = False
        first = True
        last_sent: float | None = None  # when the previous chunk carrying events went out (inter-token latency)
        tail: list[bytes] = []
        lines = sse.LineCollector()
        try:
            async for chunk in chunks(opened.first, opened.resp):
                out = []  # one write per chunk received, not per line
                events = False  # whether this chunk carries an event (not only separators or comments)
                for line in lines.feed(chunk):
                    if line == b"\n" and api is None and not reply.drop_separator:
                        out.append(line)  # the blank line ending each event: nothing to read in it
                        continue
                    if state is not None:
                        line = state.observe(line)
                    fed = reply.feed(line)
                    if reply.complete and not remembered:
                        # Store before the client sees [DONE]: its next turn may follow at once.
                        remembered = True
                        if reply.storable:
                            await self._store_reply(d, opened.engine, reply.kv_transfer_params, reply.value())
                        if early:  # the headers left before the outcome was known: say it in a comment
                            out.append(f": turnkv reuse_outcome={d.outcome} "
                                       f"reused_tokens={d.reused_tokens} "
                                       f"prefill_cached_tokens={d.prefill_cached_tokens}\n\n".encode())
                    if fed is not None:
                        events = events or fed.startswith(b"data")
                        fed = usage.rewrite_line(fed, d)
                        out.append(fed if api is None else api.stream_line(fed))
                if first and (reply.has_content or reply.complete):
                    first = False
                    self._first_token(d)
                    last_sent = time.perf_counter()
                elif events and last_sent is not None and not reply.complete:
                    now = time.perf_counter()
                    self._itl.observe(now - last_sent)
                    last_sent = now
                if reply.complete:  # [DONE] seen: the rest goes out with the end of the stream
                    tail.extend(out)
                elif out:
                    await client_write(response, b"".join(out), deadline=deadline)
            if rest := lines.flush():
                fed = reply.feed(rest)
                if fed:
                    tail.append(fed if api is None else api.stream_line(fed))
            await client_write(response, b"".join(tail), eof=True, deadline=deadline)
        except ClientGone as gone:
            client_gone(self.metrics, d, gone, request)
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.metrics.engine_errors.labels("decode", type(exc).__name__).inc()
            error = f"decode engine {opened.engine.name} failed mid-stream: {exc or type(exc).__name__}"
            log.warning("%s", error)
            if reply.complete:  # [DONE] had arrived: only the end of the stream is missing
                with contextlib.suppress(ClientGone):
                    await client_write(response, b"".join(tail), eof=True, deadline=deadline)
                return response
            if state is not None and await self._migrate(d, request, response, opened.engine, state, deadline):
                return response
            d.error = error
            await error_event(d, response, "the model server failed mid-stream; the reply is incomplete")
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
            c = Dispatch(RequestKind.COMPLETION, "/v1/completions", body, d.request_id, None, None, started=d.started,
                         tenant=d.tenant, tokens=d.tokens + len(state.generated), stream=True,
                         leg_request_id=new_leg_id(), avoid_decode=list(avoid),
                         prefix_key=d.prefix_key,  # the rendered prompt's ids: the same leading blocks
                         decode_slot=d.decode_slot)
            try:
                opened = await self._dispatch(c, request)
            except (UpstreamError, NoEngineError) as exc:
                log.warning("stream migration: no engine took over (%s)", exc)
                break
            log.warning("decode engine %s died mid-stream after %d tokens: continuing on %s", dead.name,
                        len(state.generated), opened.engine.name)
            d.retries += 1
            try:
                if await self._continuation(response, opened, state, deadline, d.api):
                    self.metrics.migrations.labels("continued").inc()
                    return True
            except ClientGone:
                return True  # the client left: nothing more to send
            finally:
                opened.close()
            avoid.append(opened.engine)
            dead = opened.engine
        self.metrics.migrations.labels("failed").inc()
        return False

    async def _continuation(self, response: web.StreamResponse, opened: Opened, state: migrate.StreamState,
                            deadline: WriteDeadline, api: apis.Translation | None = None) -> bool:
        """Relay a continuation stream in the client's format (chat chunks, then through ``api`` for a translated
        stream); True at [DONE], False when it failed too."""
        assert opened.resp is not None
        lines = sse.LineCollector()
        try:
            async for chunk in chunks(opened.first, opened.resp):
                out = []
                for line in lines.feed(chunk):
                    payload = sse.data_of(line)
                    if payload is None:
                        continue
                    if payload == sse.DONE:
                        done = b"data: [DONE]\n\n"
                        out.append(done if api is None else api.stream_line(done))
                        await client_write(response, b"".join(out), eof=True, deadline=deadline)
                        return True
                    try:
                        rewritten = state.rewrite(orjson.loads(payload))
                    except orjson.JSONDecodeError:
                        continue
                    if rewritten is not None:
                        out.append(rewritten if api is None else api.stream_line(rewritten))
                if out:
                    await client_write(response, b"".join(out), deadline=deadline)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("continuation on %s failed too: %s", opened.engine.name, exc or type(exc).__name__)
        return False


class ClientGone(Exception):
    """Writing to the client failed: it went away, or did not read within the write deadline (``slow``)."""

    def __init__(self, slow: bool = False) -> None:
        super().__init__()
        self.slow = slow


def client_gone(metrics: Metrics, d: Dispatch, gone: ClientGone, request: web.Request | None) -> None:
    """A client that went away mid-stream, or did not read within ``write_timeout`` (its connection is closed:
    aiohttp would otherwise wait on the full buffer at the end): counted, and the request's status says which."""
    metrics.client_disconnects.inc()
    d.status, d.error = 499, "client disconnected"
    if gone.slow:
        metrics.slow_readers.inc()
        d.error = "client did not read within write_timeout"
        if request is not None and request.transport is not None:
            request.transport.close()
    log.info("client %s mid-stream: decode aborted", "too slow" if gone.slow else "went away")


async def client_write(response: web.StreamResponse, data: bytes, eof: bool = False, *,
                        deadline: WriteDeadline) -> None:
    """Write to the client within the stream's deadline; ClientGone when it went away or did not read."""
    try:
        await deadline.run(response.write_eof(data) if eof else response.write(data))
    except (ConnectionError, aiohttp.ClientConnectionResetError) as exc:
        raise ClientGone() from exc
    except TimeoutError as exc:
        raise ClientGone(slow=True) from exc


async def chunks(first: bytes, rest: upstream.EngineResponse) -> AsyncIterator[bytes]:
    """The stream as it comes: what opening the decode leg already read, then the rest."""
    if first:
        yield first
    async for chunk in rest.iter_any():
        yield chunk
