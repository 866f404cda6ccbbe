"""SSE comments that keep a stream's connection alive while its legs are dispatched (before the first token).

Idle-timeout proxies (the ALB) close a connection that carries nothing for too long; a prefill of a long prompt,
or a queue, can take that long. The handler dispatches the legs itself; a timer starts a writer task only when
the first comment is due, so a request whose first token comes sooner (almost every one) costs one timer, not a
task and a wait. The writer prepares the response (its headers then leave before the reuse outcome is known)
and writes a comment every ``interval`` until stopped. A client that goes away, or does not take a comment
within ``write_timeout``, cancels the handler, as a disconnect does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import aiohttp
from aiohttp import web

from router.relay import SseResponse

KEEPALIVE = b": keepalive\n\n"


class Keepalive:
    """Comments on ``request``'s stream every ``interval`` s, from the first one due until ``stop``."""

    def __init__(self, request: web.Request, headers: Mapping[str, str], interval: float,
                 write_timeout: float) -> None:
        self.response: web.StreamResponse | None = None  # prepared: the stream's headers have left
        self._request = request
        self._headers = headers
        self._interval = interval
        self._write_timeout = write_timeout
        loop = asyncio.get_running_loop()
        self._owner = asyncio.current_task(loop)
        self._task: asyncio.Task[None] | None = None
        self._writing = False
        self._stopping = False
        self._timer = loop.call_later(interval, self._start)

    def _start(self) -> None:
        if not self._stopping:
            self._task = asyncio.get_running_loop().create_task(self._beat())

    async def _beat(self) -> None:
        try:
            while not self._stopping:
                self._writing = True
                async with asyncio.timeout(self._write_timeout):
                    if self.response is None:
                        response = SseResponse(headers=self._headers)
                        self.response = response  # from here on the headers may have left
                        await response.prepare(self._request)
                    await self.response.write(KEEPALIVE)
                self._writing = False
                if self._stopping:
                    return
                await asyncio.sleep(self._interval)
        except (ConnectionError, aiohttp.ClientConnectionResetError, TimeoutError):
            if self._owner is not None and not self._stopping:
                self._owner.cancel()  # the client is gone or does not read: as a disconnect

    async def stop(self) -> web.StreamResponse | None:
        """No more comments; the prepared response, if the first comment went out (or began to)."""
        self._stopping = True
        self._timer.cancel()
        task = self._task
        if task is not None and not task.done():
            if not self._writing:
                task.cancel()  # asleep: nothing half-written
            try:
                await asyncio.wait({task})  # a write under way ends first (bounded by write_timeout)
            except asyncio.CancelledError:  # we were cancelled ourselves (the client left): the writer too
                task.cancel()
                raise
        return self.response
