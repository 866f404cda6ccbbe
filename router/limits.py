"""Per-tenant and global limits (pure, no I/O): admission, retention and lease renewal rate.

- ``Admission``: requests in flight, globally and per tenant (a request over either gets 429).
- ``TenantRetentionLedger``: the live conversations and retained decode tokens of each tenant, so no tenant can
  pin an unbounded share of decode memory (over its limits, new turns are served but not retained).
- ``TokenBucket``: lease renewals and requests per tenant per second.
- ``ByteBudget``: request body bytes being buffered, globally and per tenant (reserved before reading).
- ``ExpiringBytes``: bytes of kept responses each tenant holds until they expire.
- ``LoopShare`` and ``Metered``: the event-loop time each tenant's requests take (the synchronous steps of their
  handlers, timed as they run), so no tenant's work can crowd the others' off the router's one loop.

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
    router's per-tenant count (``connector.retention.RetentionLedger`` is decode's own ledger of retained blocks)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._tenants: dict[str, _Tenant] = {}
        self._owner: dict[str, str] = {}
        self._clock = clock

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

    def allows(self, tenant: str, tokens: int, max_conversations: int, max_tokens: int) -> bool:
        """Whether ``tenant`` may retain one more turn of ``tokens`` tokens."""
        t = self._tenants.get(tenant)
        if t is None:
            return tokens <= max_tokens
        self._purge(t)
        return len(t.conversations) < max_conversations and t.tokens + tokens <= max_tokens

    def hold(self, tenant: str, key: str, tokens: int, expires_at: float) -> None:
        self.release(key)
        t = self._tenants.setdefault(tenant, _Tenant())
        t.conversations[key] = (tokens, expires_at)
        t.tokens += tokens
        heapq.heappush(t.expiries, (expires_at, key))
        self._owner[key] = tenant

    def release(self, key: str) -> None:
        tenant = self._owner.pop(key, None)
        if tenant is None:
            return
        t = self._tenants[tenant]
        tokens, _ = t.conversations.pop(key)
        t.tokens -= tokens
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

    def refuse(self, tenant: str, share: float) -> int | None:
        """Seconds until ``tenant`` may start a request again, or None when it may now. A tenant over ``share`` of
        the loop is held back only while the loop is busy (over twice ``share`` in all) and some other tenant
        used it too: a tenant alone, or on a loop with room, may take more (work-conserving)."""
        mine = self.share(tenant)
        if share >= 1 or mine <= share:
            return None
        total = self.share()
        if total <= 2 * share or total - mine <= 1e-6:
            return None
        return max(1, math.ceil(self.window * math.log(mine / share)))


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
