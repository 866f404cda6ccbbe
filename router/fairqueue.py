"""A max-min fair queue of the engines' in-flight work (pure: no I/O, no clock).

The router's other shares (``router.limits``) divide what the router itself spends (requests, body bytes, loop
time, retention). This one divides what the engines are sent: a request holds ``cost`` units (its prompt tokens
still to compute) from its prefill until decode's first token, and the pool holds ``capacity`` units before
requests wait here, in the router, instead of in the engines' own first-come queue (where a tenant with many
requests in flight goes ahead of everyone who comes after them).

Rules, for a tenant ``t`` asking for ``cost``:

- granted at once when nobody waits and the pool has room (``total + cost <= capacity``), when ``t`` is alone (no
  other tenant has work held or waiting, or asked within ``ALONE_WINDOW`` s: a tenant alone is never queued here,
  work-conserving; a light tenant between two turns still counts, so a heavy one cannot refill the pool in every
  gap between them), when nothing is held
  (a request larger than the capacity still goes, alone), or when ``t`` holds less than the max-min fair level
  (``router.fair``) of the capacity among everyone's asks (held + waiting). Requests are whole, so a tenant under
  its level may send one more even where that takes it over (every tenant may have at least one request in
  flight). So a light tenant never waits behind a heavy one, whatever the heavy one holds: the pool may then hold
  more than ``capacity`` for a while (by at most one request per tenant, plus what a tenant took while alone), and
  the heavier tenants get nothing more until it drains back.
- otherwise it waits. When work is released, waiting tenants are served lightest first (fewest units held; then
  the longest waiting), each tenant's own requests in order, while the lightest one's next request fits one of the
  rules above. The heaviest is cut first, and a waiting request is never starved: nothing heavier than it is granted
  until it is, and what is held drains.

Every ticket ends exactly once (``done``: released if granted, dropped if still waiting), so nothing leaks whichever
way a request ends (answer, error, client gone); ``done`` returns the tickets it let through, for the caller to wake.
"""

from __future__ import annotations

import collections
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from router.fair import water_level

#: Seconds a tenant counts as present after its last request (the window of "asking lately" in ``router.limits``).
ALONE_WINDOW = 2.0


@dataclass(eq=False)
class Ticket:
    """One request's place: ``granted`` once it may go to the engines; ``ended`` after ``FairQueue.done``."""

    tenant: str
    cost: float
    seq: int
    granted: bool = False
    ended: bool = False


@dataclass
class _Tenant:
    held: float = 0.0  # units of its granted tickets
    held_n: int = 0
    waiting: collections.deque[Ticket] = field(default_factory=collections.deque)
    waiting_cost: float = 0.0


class FairQueue:
    """Units held by granted requests, per tenant and in all, and the requests waiting for room (see the module)."""

    def __init__(self, capacity: float, clock: Callable[[], float] = time.monotonic,
                 alone_window: float = ALONE_WINDOW, alone_exempt: bool = True) -> None:
        """``alone_exempt`` False: a tenant alone is held to the capacity too (the rules otherwise unchanged), where
        the engines run no more than it at once anyway (decode's sequences) and what waits in the router instead of
        the engine's queue costs that tenant nothing but is not ahead of the next tenant to come."""
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, not {capacity}")
        self.capacity = float(capacity)
        self._alone_exempt = alone_exempt
        self._clock = clock
        self._alone_window = alone_window
        self._seen: dict[str, float] = {}  # tenant -> when it last asked
        self.total = 0.0
        self._tenants: dict[str, _Tenant] = {}
        self._waiting = 0  # tickets waiting, all tenants
        self._held_n = 0  # tickets granted and not yet done, all tenants
        self._seq = itertools.count()

    # -- reading ------------------------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return self._waiting

    def held(self, tenant: str) -> float:
        t = self._tenants.get(tenant)
        return 0.0 if t is None else t.held

    def in_flight(self, tenant: str) -> int:
        t = self._tenants.get(tenant)
        return 0 if t is None else t.held_n

    def waiting_of(self, tenant: str) -> int:
        t = self._tenants.get(tenant)
        return 0 if t is None else len(t.waiting)

    # -- the rules ----------------------------------------------------------------------------------

    def _level(self) -> float:
        return water_level(self.capacity, (t.held + t.waiting_cost for t in self._tenants.values()))

    def _alone(self, name: str) -> bool:
        """Whether ``name`` is the only tenant with work here and the only one that asked lately."""
        if len(self._tenants) != 1:
            return False
        horizon = self._clock() - self._alone_window
        for other, at in list(self._seen.items()):
            if at < horizon:
                del self._seen[other]  # forgotten: the map holds only the tenants of the last window
            elif other != name:
                return False
        return True

    def _may_go(self, name: str, t: _Tenant, cost: float, first_in_line: bool) -> bool:
        """Whether ``t`` may send a request of ``cost`` now (its ask, held + waiting, counts this request)."""
        if self.total <= 0 or (self._alone_exempt and self._alone(name)):
            return True
        if first_in_line and self.total + cost <= self.capacity:
            return True
        return t.held < self._level()

    def _lightest(self) -> tuple[str, tuple[float, int]] | None:
        """The waiting tenant served next and its rank: fewest units held, then the oldest head of its queue."""
        best: tuple[str, tuple[float, int]] | None = None
        for key, t in self._tenants.items():
            if t.waiting:
                rank = (t.held, t.waiting[0].seq)
                if best is None or rank < best[1]:
                    best = (key, rank)
        return best

    def acquire(self, tenant: str, cost: float) -> Ticket:
        """A ticket for ``cost`` units (clipped to 1..capacity), granted now or waiting (see the module's rules)."""
        cost = min(max(1.0, float(cost)), self.capacity) if math.isfinite(cost) else self.capacity
        ticket = Ticket(tenant, cost, next(self._seq))
        self._seen[tenant] = self._clock()
        t = self._tenants.setdefault(tenant, _Tenant())
        if not t.waiting:  # a tenant's own requests keep their order
            lightest = self._lightest() if self._waiting else None
            first = lightest is None or (t.held, ticket.seq) < lightest[1]
            t.waiting_cost += cost  # counted as asked while the level is worked out
            go = self._may_go(tenant, t, cost, first)
            t.waiting_cost -= cost
            if go:
                self._grant(t, ticket)
                return ticket
        t.waiting.append(ticket)
        t.waiting_cost += cost
        self._waiting += 1
        return ticket

    def done(self, ticket: Ticket) -> list[Ticket]:
        """End ``ticket`` (release its units, or leave the queue); idempotent. The waiting tickets this lets through,
        now granted."""
        if ticket.ended:
            return []
        ticket.ended = True
        t = self._tenants.get(ticket.tenant)
        if t is None:  # not reached: a live ticket's tenant is known
            return []
        if ticket.granted:
            t.held -= ticket.cost
            t.held_n -= 1
            self.total -= ticket.cost
            self._held_n -= 1
            if t.held_n == 0:  # no float drift left behind
                t.held = 0.0
            if self._held_n == 0:
                self.total = 0.0
        else:
            t.waiting.remove(ticket)
            t.waiting_cost -= ticket.cost
            self._waiting -= 1
            if not t.waiting:
                t.waiting_cost = 0.0
        if t.held_n == 0 and not t.waiting:
            del self._tenants[ticket.tenant]
        return self._wake()

    def resize(self, capacity: float) -> list[Ticket]:
        """A new capacity (the pool grew or shrank); the waiting tickets that now fit, granted."""
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, not {capacity}")
        self.capacity = float(capacity)
        return self._wake()

    # -- internals ------------------------------------------------------------------------------------

    def _grant(self, t: _Tenant, ticket: Ticket) -> None:
        ticket.granted = True
        t.held += ticket.cost
        t.held_n += 1
        self._held_n += 1
        self.total += ticket.cost

    def _wake(self) -> list[Ticket]:
        woken: list[Ticket] = []
        while self._waiting:
            lightest = self._lightest()
            assert lightest is not None  # someone waits
            t = self._tenants[lightest[0]]
            head = t.waiting[0]
            if not self._may_go(lightest[0], t, head.cost, first_in_line=True):
                break  # the lightest waits: nobody heavier goes before it
            t.waiting.popleft()
            t.waiting_cost -= head.cost
            self._waiting -= 1
            self._grant(t, head)
            woken.append(head)
        return woken
