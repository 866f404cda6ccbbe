"""A list of prompts served one P/D pair per prompt (``router.choices``), answers merged (``router.merge``): the I/O.

Each prompt is dispatched as a request of its own (its prefill share, engines, leg ids, retries: ``Flow._dispatch``),
all at once, within the decode-pool units the whole request holds (n x prompts, one ticket). The answer is the
client's only once every prompt's decode has answered (unary) or sent its first event (stream); a failure before that
fails the whole request, as it would fail one engine request, and the other prompts' legs are closed (vLLM aborts
them). A stream relays the prompts' events as they come, through one writer, each rewritten into the client's stream;
an error in one prompt's stream ends the client's, as vLLM's own stream of a list ends at its first error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
import orjson
from aiohttp import web

from router import choices, sse
from router.config import RouterConfig
from router.deadline import WriteDeadline
from router.dispatch import Dispatch
from router.legs import Opened, new_leg_id
from router.merge import StreamMerge
from router.outcomes import RequestKind
from router.relay import ClientGone, chunks, client_gone, client_write, error_event
from router.reply import ReplyCollector
from router.telemetry import Metrics

log = logging.getLogger("turnkv.router")

Dispatcher = Callable[[Dispatch, web.Request], Awaitable[Opened]]
#: Events waiting for the client's writer: bounded, so a client that does not read holds the engines' streams back.
QUEUED_EVENTS = 64


def parts(d: Dispatch) -> list[Dispatch]:
    """One dispatch per prompt of ``d`` (prompt order), in the decode-pool units ``d`` holds; no reuse (a raw prompt of
    a list is no conversation turn)."""
    return [Dispatch(d.kind, d.path, choices.sub_body(d.body, prompt), d.request_id, None, None, started=d.started,
                     tenant=d.tenant, tenant_tag=d.tenant_tag, tokens=choices.prompt_tokens(prompt), stream=d.stream,
                     leg_request_id=new_leg_id(), affinity=d.affinity, hint=d.hint, decode_slot=d.decode_slot)
            for prompt in d.plan.split]


@dataclass
class Fanned:
    """The opened decode legs of a request's prompts, in prompt order."""

    opened: list[Opened]

    def close(self) -> None:
        for opened in self.opened:
            opened.close()


async def open_all(subs: list[Dispatch], request: web.Request, dispatch: Dispatcher) -> Fanned:
    """Every prompt's legs at once; the first failure (in prompt order) is raised once the others are closed."""
    tasks = [asyncio.create_task(dispatch(sub, request)) for sub in subs]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return Fanned([task.result() for task in tasks])
    except BaseException:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                (await task).close()
        raise


def tally(d: Dispatch, subs: list[Dispatch]) -> None:
    """What the prompts' dispatches did, as the request's own (headers, metrics, the EMF line)."""
    d.prompt_tokens = sum(s.prompt_tokens for s in subs)
    d.prefill_cached_tokens = sum(s.prefill_cached_tokens for s in subs)
    d.retries += sum(s.retries for s in subs)
    d.prefill_ms = max((s.prefill_ms for s in subs if s.prefill_ms is not None), default=None)
    d.prefill_engine = ",".join(sorted({s.prefill_engine for s in subs if s.prefill_engine}))
    d.decode_engine = ",".join(sorted({s.decode_engine for s in subs if s.decode_engine}))


@dataclass(frozen=True)
class _Ended:
    """A prompt's stream ended: normally, with an error event (``error``), or its connection failed (``failure``)."""

    prompt: int
    error: bytes | None = None
    failure: BaseException | None = None


class FanIn:
    """Relays the prompts' decode streams to the client as one stream in vLLM's shape."""

    def __init__(self, config: RouterConfig, metrics: Metrics, first_token: Callable[[Dispatch], None]) -> None:
        self.config = config
        self.metrics = metrics
        self._first_token = first_token

    async def stream(self, d: Dispatch, response: web.StreamResponse, fanned: Fanned, early: bool,
                     request: web.Request | None = None) -> web.StreamResponse:
        """Relay every prompt's stream to the prepared ``response`` to the end; the caller closes ``fanned``."""
        merge = StreamMerge(len(fanned.opened))
        queue: asyncio.Queue[bytes | _Ended] = asyncio.Queue(QUEUED_EVENTS)
        readers = [asyncio.create_task(self._read(i, opened, merge, queue)) for i, opened in enumerate(fanned.opened)]
        deadline = WriteDeadline(float(self.config.write_timeout))
        try:
            await self._write(d, response, merge, queue, len(readers), early, deadline)
        except ClientGone as gone:
            client_gone(self.metrics, d, gone, request)
        finally:
            for reader in readers:
                reader.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
            deadline.close()
        return response

    async def _write(self, d: Dispatch, response: web.StreamResponse, merge: StreamMerge,
                     queue: asyncio.Queue[bytes | _Ended], live: int, early: bool, deadline: WriteDeadline) -> None:
        first = True
        while live:
            items = [await queue.get()]
            while not queue.empty():  # one write for what is there
                items.append(queue.get_nowait())
            out: list[bytes] = []
            stop: _Ended | None = None
            for item in items:
                if isinstance(item, bytes):
                    out.append(item)
                    continue
                live -= 1
                if item.error is not None or item.failure is not None:
                    stop = item
                    break
            if first and out:
                first = False
                self._first_token(d)
            if stop is not None:
                await self._stop(d, response, b"".join(out), stop, deadline)
                return
            if out:
                await client_write(response, b"".join(out), deadline=deadline)
        tail = merge.end()
        if early:  # the headers left before the outcome was known: say it in a comment, as the relay does
            tail = (f": turnkv reuse_outcome={d.outcome} reused_tokens={d.reused_tokens} "
                    f"prefill_cached_tokens={d.prefill_cached_tokens}\n\n").encode() + tail
        await client_write(response, tail, eof=True, deadline=deadline)

    async def _stop(self, d: Dispatch, response: web.StreamResponse, sent: bytes, ended: _Ended,
                    deadline: WriteDeadline) -> None:
        """End the client's stream at a prompt's error: the events before it, then the error and ``[DONE]``."""
        if ended.error is not None:  # the engine's in-stream error event (redacted): vLLM's stream ends after it
            d.error = f"prompt {ended.prompt}: the model server sent an error mid-stream"
            await client_write(response, sent + ended.error + b"data: [DONE]\n\n", eof=True, deadline=deadline)
            return
        exc = ended.failure
        self.metrics.engine_errors.labels("decode", type(exc).__name__).inc()
        d.error = f"prompt {ended.prompt}: decode failed mid-stream: {exc or type(exc).__name__}"
        log.warning("%s", d.error)
        if sent:
            await client_write(response, sent, deadline=deadline)
        await error_event(d, response, "the model server failed mid-stream; the reply is incomplete")

    @staticmethod
    async def _read(prompt: int, opened: Opened, merge: StreamMerge, queue: asyncio.Queue[bytes | _Ended]) -> None:
        """One prompt's stream into the queue, each event rewritten (``router.merge``); its end last."""
        assert opened.resp is not None
        reply = ReplyCollector(RequestKind.COMPLETION, parse=False)  # takes decode's params off, redacts errors
        lines = sse.LineCollector()
        try:
            async for chunk in chunks(opened.first, opened.resp):
                for line in lines.feed(chunk):
                    fed = reply.feed(line)
                    payload = None if fed is None else sse.data_of(fed)
                    if payload is None or payload == sse.DONE:
                        continue  # separators and comments: the writer ends each event itself
                    try:
                        event = orjson.loads(payload)
                    except orjson.JSONDecodeError:
                        continue
                    if not isinstance(event, dict):
                        continue
                    if "error" in event:
                        await queue.put(_Ended(prompt, error=b"data: " + orjson.dumps(event) + b"\n\n"))
                        return
                    out = merge.chunk(prompt, event)
                    if out is not None:
                        await queue.put(out)
                if reply.complete:
                    break
        except (aiohttp.ClientError, TimeoutError) as exc:
            await queue.put(_Ended(prompt, failure=exc))
            return
        await queue.put(_Ended(prompt))
