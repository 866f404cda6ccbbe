"""Per-tenant and global limits (pure, no I/O): admission, retention and lease renewal rate.

- ``Admission``: requests in flight, globally and per tenant (a request over either gets 429).
- ``TenantRetentionLedger``: the live conversations and retained decode tokens of each tenant, so no tenant can
  pin an unbounded share of decode memory (over its limits, new turns are served but not retained).
- ``TokenBucket``: events per tenant per second (lease renewals, messages).
- ``FairRate``: requests and body bytes per second, shared max-min (``router.fair``) among the tenants asking lately:
  a tenant alone may take the router's whole rate, and under contention the heaviest is cut first.
- ``ByteBudget``: request body bytes being buffered, globally and per tenant (reserved before reading).
- ``ExpiringBytes``: bytes of kept responses each tenant holds until they expire.
- ``LoopShare`` and ``Metered``: the event-loop time each tenant's requests take (the synchronous steps of their
  handlers, timed as they run), so no tenant's work can crowd the others' off the router's one loop: on a busy
  loop the tenants above the max-min fair level of its time are held back, the heaviest first.

Counts are per router process; replicas each enforce their share (docs/router.md).
"""

from __future__ import annotations

import collections
import heapq
import math
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from router.fair import water_level


class Admission:
    def __init__(self) -> None:
        self.total = 0
        self.by_tenant: dict[str, int] = {}

    def try_enter(self, tenant: str, max_total: int, max_tenant: int) -> str | None:
        """None when admitted (call ``leave`` when done), else which limit refused it."""
        if self.total >= max_total:
            return "router"
        if self.by_tenant.get(tenant, 0) >= max_tenant:
            return "tenant"
        self.total += 1
        self.by_tenant[tenant] = self.by_tenant.get(tenant, 0) + 1
        return None

    def leave(self, tenant: str) -> None:
        self.total -= 1
        left = self.by_tenant.get(tenant, 0) - 1
        if left > 0:
            self.by_tenant[tenant] = left
        else:
            self.by_tenant.pop(tenant, None)


@dataclass
class _Tenant:
    conversations: dict[str, tuple[int, float]] = field(default_factory=dict)  # key -> (tokens, expires_at)
    tokens: int = 0
    #: (expires_at, key) per hold, soonest first: purging costs O(expired log n), not a scan of every held turn
    #: on every request. Entries of keys taken or re-held since are skipped when they surface.
    expiries: list[tuple[float, str]] = field(default_factory=list)


class TenantRetentionLedger:
    """What each tenant retains on decode engines, by conversation key, until the entry expires or is taken: the
    router's per-tenant count (``connector.retention.RetentionLedger`` is decode's own ledger of retained blocks).

    The router's retention (``max_conversations`` turns, ``max_retained_tokens`` tokens) is shared max-min among the
    tenants holding turns: while there is room any tenant may retain more (a tenant alone, all of it); once it is
    full, only a tenant under the fair level (``router.fair``) of both may retain a new turn, so the heaviest
    holder stops growing first and shrinks as its turns are taken or expire. ``tenant_max_*`` are ceilings."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._tenants: dict[str, _Tenant] = {}
        self._owner: dict[str, str] = {}
        self._clock = clock
        self.conversations = 0  # in all, across tenants (expired turns count until their tenant is purged)
        self.tokens = 0

    def _purge(self, t: _Tenant) -> None:
        now = self._clock()
        heap = t.expiries
        while heap and heap[0][0] <= now:
            expires_at, key = heapq.heappop(heap)
            held = t.conversations.get(key)
            if held is not None and held[1] == expires_at:
                self.release(key)
        if len(heap) > 2 * len(t.conversations) + 64:  # mostly taken turns: rebuild from what is still held
            t.expiries = [(exp, key) for key, (_, exp) in t.conversations.items()]
            heapq.heapify(t.expiries)

    def allows(self, tenant: str, tokens: int, max_conversations: int | float, max_tokens: int | float,
               router_conversations: int | float = math.inf, router_tokens: int | float = math.inf) -> bool:
        """Whether ``tenant`` may retain one more turn of ``tokens`` tokens: under its own ceilings
        (``max_*``), and either within the router's room (``router_*``) or under its fair share of it."""
        t = self._tenants.get(tenant)
        if t is not None:
            self._purge(t)
        conversations, held = (0, 0) if t is None else (len(t.conversations), t.tokens)
        if conversations + 1 > max_conversations or held + tokens > max_tokens:
            return False
        if self.conversations + 1 <= router_conversations and self.tokens + tokens <= router_tokens:
            return True
        for other in list(self._tenants.values()):  # full: what expired no longer counts against anyone
            self._purge(other)
        if self.conversations + 1 <= router_conversations and self.tokens + tokens <= router_tokens:
            return True
        others = [(len(o.conversations), o.tokens) for name, o in self._tenants.items() if name != tenant]
        return (conversations + 1 <= water_level(router_conversations, [c for c, _ in others] + [conversations + 1])
                and held + tokens <= water_level(router_tokens, [k for _, k in others] + [held + tokens]))

    def hold(self, tenant: str, key: str, tokens: int, expires_at: float) -> None:
        self.release(key)
        t = self._tenants.setdefault(tenant, _Tenant())
        t.conversations[key] = (tokens, expires_at)
        t.tokens += tokens
        self.conversations += 1
        self.tokens += tokens
        heapq.heappush(t.expiries, (expires_at, key))
        self._owner[key] = tenant

    def release(self, key: str) -> None:
        tenant = self._owner.pop(key, None)
        if tenant is None:
            return
        t = self._tenants[tenant]
        tokens, _ = t.conversations.pop(key)
        t.tokens -= tokens
        self.conversations -= 1
        self.tokens -= tokens
        if not t.conversations:
            del self._tenants[tenant]

    def usage(self, tenant: str) -> tuple[int, int]:
        t = self._tenants.get(tenant)
        return (0, 0) if t is None else (len(t.conversations), t.tokens)


class TokenBucket:
    """``rate`` events per second per key, bursts of ``burst``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_keys: int = 100_000) -> None:
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, last refill)
        self._clock = clock
        self._max_keys = max_keys

    def allow(self, key: str, rate: float, burst: float, cost: float = 1) -> bool:
        """Whether an event costing ``cost`` tokens (1 request, or n bytes) may happen now; it is charged if so."""
        now = self._clock()
        tokens, last = self._buckets.get(key, (burst, now))
        tokens = min(burst, tokens + (now - last) * rate)
        if len(self._buckets) >= self._max_keys and key not in self._buckets:
            self._buckets.clear()  # a flood of new keys: forget the old ones rather than grow without bound
        if tokens < min(cost, burst):
            self._buckets[key] = (tokens, now)
            return False
        self._buckets[key] = (tokens - cost, now)
        return True

    def retry_after(self, rate: float) -> int:
        """Seconds until one more event is allowed at ``rate`` (what a 429's ``Retry-After`` says)."""
        return max(1, math.ceil(1 / rate))


class ByteBudget:
    """Bytes reserved globally and per tenant; a reservation over either limit is refused (nothing reserved)."""

    def __init__(self) -> None:
        self.total = 0
        self.by_tenant: dict[str, int] = {}

    def try_take(self, tenant: str, size: int, max_total: int, max_tenant: int) -> str | None:
        """None when ``size`` bytes are reserved (``give`` them back when done), else the limit that refused."""
        held = self.by_tenant.get(tenant, 0)
        if held + size > max_tenant:
            return "tenant_max_body_buffer_bytes"
        if self.total + size > max_total:
            return "max_body_buffer_bytes"
        self.total += size
        self.by_tenant[tenant] = held + size
        return None

    def give(self, tenant: str, size: int) -> None:
        self.total -= size
        left = self.by_tenant.get(tenant, 0) - size
        if left > 0:
            self.by_tenant[tenant] = left
        else:
            self.by_tenant.pop(tenant, None)


class ExpiringBytes:
    """Bytes each tenant holds in items that all live the same TTL (so they expire in the order they came)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._held: dict[str, collections.deque[tuple[float, int]]] = {}
        self._bytes: dict[str, int] = {}
        self._clock = clock

    def _purge(self, tenant: str) -> None:
        items, now = self._held.get(tenant), self._clock()
        while items and items[0][0] <= now:
            self._bytes[tenant] -= items.popleft()[1]
        if items is not None and not items:
            del self._held[tenant], self._bytes[tenant]

    def used(self, tenant: str) -> int:
        self._purge(tenant)
        return self._bytes.get(tenant, 0)

    def try_hold(self, tenant: str, size: int, expires_at: float, limit: int) -> bool:
        """Count ``size`` bytes against ``tenant`` until ``expires_at``; False (nothing counted) over ``limit``."""
        if self.used(tenant) + size > limit:
            return False
        self._held.setdefault(tenant, collections.deque()).append((expires_at, size))
        self._bytes[tenant] = self._bytes.get(tenant, 0) + size
        return True


#: Seconds a max-min level is reused before it is computed again (it walks every tenant's tally).
LEVEL_REFRESH = 0.1

#: Seconds over which a tenant's event-loop time is averaged (exponential decay: steps older than this count for
#: less than 1/e of their time).
LOOP_WINDOW = 2.0


class LoopShare:
    """Event-loop time charged per tenant (and in all), decaying over ``window`` s: the share of the router's one
    loop each tenant's requests took lately."""

    def __init__(self, window: float = LOOP_WINDOW, clock: Callable[[], float] = time.monotonic,
                 max_keys: int = 100_000) -> None:
        self.window = window
        self._clock = clock
        self._used: dict[str, tuple[float, float]] = {}  # tenant -> (seconds, when last decayed)
        self._total = (0.0, clock())
        self._max_keys = max_keys
        self._level: tuple[float, float, float] | None = None  # (capacity, level, when computed)

    def _decay(self, seconds: float, at: float, now: float) -> float:
        return seconds * math.exp((at - now) / self.window) if now > at else seconds

    def charge(self, tenant: str, seconds: float) -> None:
        now = self._clock()
        used, at = self._used.get(tenant, (0.0, now))
        if len(self._used) >= self._max_keys and tenant not in self._used:
            self._used = {k: v for k, v in self._used.items() if self._decay(*v, now) > 1e-4 * self.window}
        self._used[tenant] = (self._decay(used, at, now) + seconds, now)
        total, at = self._total
        self._total = (self._decay(total, at, now) + seconds, now)

    def share(self, tenant: str | None = None) -> float:
        """The loop share (0..1, can exceed 1 with bursts) ``tenant`` (None: everyone) took over the window."""
        now = self._clock()
        used, at = self._total if tenant is None else self._used.get(tenant, (0.0, now))
        return self._decay(used, at, now) / self.window

    def tallies(self) -> dict[str, float]:
        """Every tenant's share over the window (per second: the rate of what is charged); forgotten ones dropped."""
        now = self._clock()
        out = {t: self._decay(used, at, now) / self.window for t, (used, at) in self._used.items()}
        self._used = {t: v for t, v in self._used.items() if out[t] > 1e-6}
        return {t: v for t, v in out.items() if t in self._used}

    def level(self, capacity: float) -> float:
        """The max-min fair level of ``capacity`` among the tenants' shares (``router.fair``; ``math.inf`` for one
        tenant or none), recomputed at most every ``LEVEL_REFRESH`` s (it walks every tenant)."""
        now = self._clock()
        cached = self._level
        if cached is not None and cached[0] == capacity and now - cached[2] < LEVEL_REFRESH:
            return cached[1]
        tallies = self.tallies()
        # a tenant alone is never held back (work-conserving): the router's own bounds (max_inflight) remain
        value = water_level(capacity, tallies.values()) if len(tallies) > 1 else math.inf
        self._level = (capacity, value, now)
        return value

    def refuse(self, tenant: str, share: float) -> int | None:
        """Seconds until ``tenant`` may start a request again, or None when it may now. While the loop is busy (over
        twice ``share`` in all) and another tenant used it too, that busy level is shared max-min: a tenant over
        the fair level (and over ``share``, the floor nobody is cut below) is held back, so the heaviest is cut
        first and a light tenant never. A tenant alone, or on a loop with room, may take more (work-conserving)."""
        mine = self.share(tenant)
        if share >= 1 or mine <= share:
            return None
        total = self.share()
        if total <= 2 * share or total - mine <= 1e-6:
            return None
        allowed = max(share, self.level(2 * share))
        if mine <= allowed:
            return None
        return max(1, math.ceil(self.window * math.log(mine / allowed)))


class FairRate:
    """Events per second (requests, body bytes) shared max-min among the tenants asking lately (their asks, refused
    or not, averaged over ``window`` s). While all the asks fit in ``capacity``, or one tenant alone asks, nobody
    is limited; beyond, each tenant's token bucket fills at the fair level (``router.fair``), so the heaviest is
    cut first and a tenant asking less than the level never is. ``cap``: a tenant's own ceiling whatever the
    others do (``math.inf``: none)."""

    def __init__(self, window: float = LOOP_WINDOW, clock: Callable[[], float] = time.monotonic,
                 max_keys: int = 100_000) -> None:
        self.asked = LoopShare(window, clock, max_keys)  # a decaying tally per tenant: events asked per second
        self.bucket = TokenBucket(clock, max_keys)

    def rate(self, tenant: str, capacity: float, cap: float = math.inf) -> float:
        """The rate ``tenant`` may have now (``math.inf``: unlimited)."""
        return min(cap, self.asked.level(capacity))

    def allow(self, tenant: str, capacity: float, cap: float = math.inf, cost: float = 1, burst: float = 2.0,
              min_burst: float = 10.0) -> bool:
        """Whether an event costing ``cost`` may happen now (charged if so); bursts of ``burst`` s of the rate."""
        self.asked.charge(tenant, cost)
        rate = self.rate(tenant, capacity, cap)
        if math.isinf(rate):
            return True
        return self.bucket.allow(tenant, rate, max(min_burst, burst * rate), cost)


class Meter:
    """The loop time of one request's steps, charged to its tenant once it is known (before: held)."""

    __slots__ = ("held", "ledger", "tenant")

    def __init__(self, ledger: LoopShare) -> None:
        self.ledger, self.tenant, self.held = ledger, None, 0.0

    def add(self, seconds: float) -> None:
        if self.tenant is None:
            self.held += seconds
        else:
            self.ledger.charge(self.tenant, seconds)

    def known(self, tenant: str) -> None:
        self.tenant = tenant
        if self.held:
            self.ledger.charge(tenant, self.held)
            self.held = 0.0


class Metered:
    """Await ``coro`` timing each of its steps (the code it runs between two awaits that suspend) on ``meter``:
    the event-loop time it takes, wherever it is spent (parsing, hashing, relaying), for about 0.1 us a step."""

    __slots__ = ("_coro", "_meter")

    def __init__(self, coro: Any, meter: Meter) -> None:
        self._coro, self._meter = coro, meter

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, add, clock = self._coro, self._meter.add, time.perf_counter
        value: Any = None
        error: BaseException | None = None
        while True:
            started = clock()
            try:
                step = coro.send(value) if error is None else coro.throw(error)
            except StopIteration as done:
                add(clock() - started)
                return done.value
            except BaseException:
                add(clock() - started)
                # drop what this frame holds of the failure: the exception's traceback holds this frame, and a cycle
                # would keep the request's buffers (a body being read) until a full GC pass
                value = error = None
                raise
            add(clock() - started)
            try:
                value, error = (yield step), None
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # cancellation and the like: thrown into the coroutine
                value, error = None, exc
