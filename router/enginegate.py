"""The engines' fair queue on the event loop: ``router.fairqueue`` (the rules) with an asyncio future per waiting
request, woken when its ticket is granted.

A request that goes away while it waits (client gone, cancelled) leaves the queue; one cancelled just after its
grant gives its units back: either way ``leave`` runs exactly once per ticket (``FairQueue.done`` is idempotent).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from router.fairqueue import FairQueue, Ticket


class EngineGate:
    def __init__(self, capacity: float, on_wait: Callable[[], None] | None = None, alone_exempt: bool = True) -> None:
        self.queue = FairQueue(capacity, alone_exempt=alone_exempt)
        self._wakers: dict[Ticket, asyncio.Future[None]] = {}
        self.waits = 0  # requests that waited for room, since start
        self._on_wait = on_wait  # counted as it starts waiting (the router's metric)

    async def enter(self, tenant: str, cost: float, capacity: float | None = None) -> Ticket:
        """Wait for room for ``cost`` units (``capacity``: the pool's now, when it changed); ``leave`` when done."""
        if capacity is not None and capacity != self.queue.capacity:
            self._wake(self.queue.resize(capacity))
        ticket = self.queue.acquire(tenant, cost)
        if ticket.granted:
            return ticket
        self.waits += 1
        if self._on_wait is not None:
            self._on_wait()
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._wakers[ticket] = future
        try:
            await future
        except BaseException:
            self.leave(ticket)  # still waiting, or granted just now: either way nothing stays held
            raise
        finally:
            del self._wakers[ticket]
        return ticket

    def leave(self, ticket: Ticket) -> None:
        self._wake(self.queue.done(ticket))

    def _wake(self, granted: list[Ticket]) -> None:
        for ticket in granted:
            future = self._wakers.get(ticket)
            if future is not None and not future.done():
                future.set_result(None)
