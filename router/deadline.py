"""A deadline on every write of one stream to its client, with one timer per stream instead of one per write.

A relayed stream writes once per upstream chunk, hundreds of times for a long reply; almost every write returns
at once (the socket takes it). ``asyncio.timeout`` around each write arms and cancels a timer each time. Here a
single timer checks, every ``timeout`` seconds, whether a write has been under way for that long; if so it
cancels the writing task, and the write raises TimeoutError, as ``asyncio.timeout`` would (same ``uncancel``
bookkeeping, so a cancellation from elsewhere, such as the client leaving, still propagates).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class WriteDeadline:
    """Bounds each awaited write of the current task by ``timeout`` seconds (TimeoutError past it)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task(self._loop)  # given the loop: no second lookup (a getpid call)
        self._since: float | None = None  # when the write under way began
        self._expired = False
        self._timer: asyncio.TimerHandle | None = None

    async def run(self, write: Awaitable[T]) -> T:
        task = self._task
        if task is None:  # not in a task (cannot be cancelled): no deadline to enforce
            return await write
        self._since = self._loop.time()
        if self._timer is None:
            self._timer = self._loop.call_at(self._since + self.timeout, self._check)
        cancelling = task.cancelling()
        try:
            return await write
        except asyncio.CancelledError:
            if self._expired and task.uncancel() <= cancelling:
                self._expired = False
                raise TimeoutError from None
            raise
        finally:
            self._since = None

    def _check(self) -> None:
        now = self._loop.time()
        since = self._since
        if since is not None and now - since >= self.timeout and self._task is not None:
            self._expired = True
            self._timer = None
            self._task.cancel()
            return
        due = since + self.timeout if since is not None else now + self.timeout
        self._timer = self._loop.call_at(due, self._check)

    def close(self) -> None:
        """Stop the timer (the stream has ended)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
