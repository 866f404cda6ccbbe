"""A lean HTTP/1.1 client for the two engine legs: pooled keep-alive connections, httptools' C parser, no
per-request objects beyond a response.

aiohttp's client spent about a third of the router's CPU per request (py-spy, docs/router.md): a request object,
a timer context, header multidicts, a stream reader and its own parser per leg. The engines speak one dialect
(vLLM's uvicorn: ``POST`` with a JSON body, a JSON answer or a chunked SSE stream), so this sends the request as
one write and hands body chunks over as the parser yields them.

What the flow relies on is kept: a connection that cannot be made is ``EngineConnectError`` (the one failure
that ejects an engine), unless the shortage is the router's own (``RouterResourceError``: EMFILE, ENFILE, ...);
a connection lost before the answer ended is ``EngineDisconnected``; timeouts raise
``TimeoutError``; closing a response closes its connection, which makes vLLM abort the request. All errors are
``aiohttp.ClientError`` or ``TimeoutError``, as before.
"""

from __future__ import annotations

import asyncio
import collections
import errno
from collections.abc import AsyncIterator, Mapping, Sequence
from urllib.parse import urlsplit

import aiohttp
import httptools

#: vLLM's uvicorn closes a keep-alive connection idle for 5 s; one idle this long is not reused (no race).
IDLE_REUSE_S = 4.0
#: Body bytes held for a reader that does not take them before the engine's socket stops being read.
HIGH_WATER = 1 << 20
MAX_IDLE_PER_ENGINE = 256


class EngineHTTPError(aiohttp.ClientError):
    """An engine leg failed at the HTTP level."""


class EngineConnectError(EngineHTTPError):
    """No connection could be made: the engine never saw the request."""


class RouterResourceError(EngineHTTPError):
    """The router itself could not open a connection (out of file descriptors, ports or buffers): no fault of
    the engine's, which must not be ejected for it."""


#: ``OSError`` numbers that are the router's own shortage, not the engine's failure.
ROUTER_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.EADDRNOTAVAIL, errno.ENOBUFS, errno.ENOMEM})


class EngineDisconnected(EngineHTTPError):
    """The connection closed (or sent what is not HTTP) before the answer ended."""


class _Connection(asyncio.Protocol):
    """One connection to an engine, parsing one answer at a time (httptools calls the ``on_*`` methods)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.waiter: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.reset()
        self.lost = False
        self.idle_since = 0.0

    def reset(self) -> None:
        self.status = 0
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.received = False
        self.broken: str | None = None
        self.paused = False
        self.timed_out = False
        self.activity = self.loop.time()
        self.read_timeout: float | None = None
        self.deadline: float | None = None

    # -- asyncio.Protocol -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received = True
        self.activity = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.broken = f"the engine's answer is not HTTP/1.1 ({exc})"
            self.close()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._wake()

    # -- httptools callbacks ----------------------------------------------------------------------

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        self.complete = True

    # -- for the response -------------------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def arm(self, read_timeout: float | None, deadline: float | None) -> None:
        """Bound this answer: ``read_timeout`` s without a byte, or the loop-time ``deadline``. One timer for the
        whole answer, re-armed only when it fires early (a timer per wait would cost one per relayed event)."""
        self.read_timeout, self.deadline = read_timeout, deadline
        self._schedule()

    def _schedule(self) -> None:
        due = [t for t in (self.deadline, None if self.read_timeout is None else self.activity + self.read_timeout)
               if t is not None]
        self.timer = self.loop.call_at(min(due), self._check) if due else None

    def _check(self) -> None:
        now = self.loop.time()
        if (self.deadline is not None and now >= self.deadline) or (
                self.read_timeout is not None and now - self.activity >= self.read_timeout):
            self.timer = None
            self.timed_out = True
            self._wake()
        else:
            self._schedule()

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    async def wait(self) -> None:
        """Until more arrives, the connection ends, or the armed timeout passes (TimeoutError)."""
        if self.timed_out:
            raise TimeoutError()
        self.waiter = fut = self.loop.create_future()
        try:
            await fut
        finally:
            self.waiter = None
        if self.timed_out:
            raise TimeoutError()

    def take(self) -> bytes:
        """Everything buffered, as one chunk (fewer relay iterations when several events arrived at once)."""
        data = self.chunks.popleft() if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks.clear()
        self.buffered = 0
        if self.paused and self.buffered < HIGH_WATER // 2 and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    def close(self) -> None:
        self.disarm()
        if self.transport is not None:
            self.transport.close()
        self.lost = True


class EngineResponse:
    """An engine's answer: ``status``, then its body as it arrives. ``release`` after the whole body was read
    gives the connection back for the next leg; ``close`` drops it (mid-stream: vLLM aborts the request)."""

    __slots__ = ("_conn", "_key", "_pool", "status")

    def __init__(self, pool: LegClient, key: tuple[str, int], conn: _Connection) -> None:
        self._pool = pool
        self._key = key
        self._conn: _Connection | None = conn
        self.status = conn.status

    async def readany(self) -> bytes:
        """The next body chunk; ``b""`` once the answer is complete."""
        conn = self._conn
        if conn is None:
            return b""
        while not conn.chunks:
            if conn.complete:
                return b""
            if conn.lost:
                raise EngineDisconnected(conn.broken or "the engine closed the connection before its answer ended")
            await conn.wait()
        return conn.take()

    async def read(self) -> bytes:
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return b"".join(parts)

    async def iter_any(self) -> AsyncIterator[bytes]:
        while chunk := await self.readany():
            yield chunk

    def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        conn.disarm()
        if conn.complete and conn.keep_alive and not conn.lost and not conn.chunks:
            self._pool.put_back(self._key, conn)
        else:
            conn.close()

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


class LegClient:
    """Keep-alive connections to the engines, reused one request at a time (HTTP/1.1 without pipelining)."""

    def __init__(self, connect_timeout: float = 5.0) -> None:
        self.connect_timeout = connect_timeout
        self._idle: dict[tuple[str, int], collections.deque[_Connection]] = {}
        self._targets: dict[str, tuple[tuple[str, int], bytes, bytes]] = {}
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        """The loop the legs run on, looked up once (each ``asyncio.get_running_loop`` is a getpid system call)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            loop = self._loop = asyncio.get_running_loop()
        return loop

    def _target(self, base_url: str) -> tuple[tuple[str, int], bytes, bytes]:
        """(host, port), the path prefix and the Host header of an engine's base URL, parsed once."""
        target = self._targets.get(base_url)
        if target is None:
            parts = urlsplit(base_url)
            if parts.scheme != "http" or not parts.hostname:
                raise ValueError(f"engine URL {base_url!r}: only http://host:port is supported for the legs")
            target = ((parts.hostname, parts.port or 80), parts.path.rstrip("/").encode(), parts.netloc.encode())
            self._targets[base_url] = target
        return target

    async def post(self, base_url: str, path: str, body: bytes | Sequence[bytes | memoryview],
                   headers: Mapping[str, str], *, read_timeout: float | None = None,
                   total_timeout: float | None = None) -> EngineResponse:
        """POST ``body`` (bytes, or parts joined in order: ``router.encoded``) to the engine at ``base_url``; returns
        once the answer's headers are in."""
        key, prefix, host = self._target(base_url)
        loop = self._running_loop()
        deadline = None if total_timeout is None else loop.time() + total_timeout
        parts = (body,) if isinstance(body, bytes) else body
        size = len(body) if isinstance(body, bytes) else sum(map(len, parts))
        lines = [b"POST ", prefix, path.encode(), b" HTTP/1.1\r\nHost: ", host,
                 b"\r\nContent-Length: ", str(size).encode(), b"\r\n"]
        for name, value in headers.items():
            if "\r" in value or "\n" in value:
                raise ValueError(f"header {name} has a line break")
            lines += [name.encode("latin-1"), b": ", value.encode("latin-1"), b"\r\n"]
        lines.append(b"\r\n")
        lines.extend(parts)
        request = b"".join(lines)
        for attempt in (0, 1):
            conn, reused = self._idle_connection(key)
            if conn is None:
                conn = await self._connect(key, deadline)
            conn.reset()
            assert conn.transport is not None
            conn.transport.write(request)
            conn.arm(read_timeout, deadline)
            response = EngineResponse(self, key, conn)
            try:
                while not conn.headers_done:
                    if conn.lost:
                        raise EngineDisconnected(conn.broken or "the engine closed the connection before answering")
                    await conn.wait()
            except EngineDisconnected:
                conn.close()
                if reused and not conn.received and attempt == 0:
                    continue  # the engine closed an idle connection as we sent: it never saw this request
                raise
            except BaseException:
                conn.close()  # timed out or cancelled: vLLM aborts what it started
                raise
            response.status = conn.status
            return response
        raise AssertionError("unreachable")

    def _idle_connection(self, key: tuple[str, int]) -> tuple[_Connection | None, bool]:
        idle = self._idle.get(key)
        now = self._running_loop().time()  # the clock of every timeout here
        while idle:
            conn = idle.pop()
            if not conn.lost and now - conn.idle_since < IDLE_REUSE_S:
                return conn, True
            conn.close()
        return None, False

    async def _connect(self, key: tuple[str, int], deadline: float | None) -> _Connection:
        loop = self._running_loop()
        timeout = self.connect_timeout
        if deadline is not None:
            timeout = min(timeout, max(deadline - loop.time(), 0.0))
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(lambda: _Connection(loop), key[0], key[1])
        except OSError as exc:
            if exc.errno in ROUTER_ERRNOS:
                raise RouterResourceError(f"the router cannot open a connection to {key[0]}:{key[1]}: "
                                          f"{exc.strerror or exc}") from exc
            raise EngineConnectError(f"cannot connect to {key[0]}:{key[1]}: {exc.strerror or exc}") from exc
        return conn

    def put_back(self, key: tuple[str, int], conn: _Connection) -> None:
        idle = self._idle.setdefault(key, collections.deque())
        if self._closed or len(idle) >= MAX_IDLE_PER_ENGINE:
            conn.close()
            return
        conn.idle_since = conn.loop.time()
        idle.append(conn)

    def close(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            while idle:
                idle.pop().close()
