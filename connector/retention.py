"""Decode's retained turns in two tiers, and what to keep when they do not all fit (pure, no vLLM).

A decode engine keeps a finished turn's blocks for the next turn's prefill to read. Room is bounded twice:
``retained_kv_share`` of the device KV cache, then the host tier (``host_kv_budget_mib``, slots of a pool that
``connector.host_tier`` allocates and registers with NIXL). A finished turn goes to the first tier with room.

**No cliff.** Oldest-first eviction under a cyclic pattern (every live conversation comes back in turn, as
agents do) evicts exactly the turn needed next: with room for a third of the live conversations, reuse fell to
10% of turns. So a newcomer never pushes out a turn that is still likely to be read. Only turns *idle* past
``idle_after`` (unread and unrenewed that long: the conversation probably ended) are evicted; otherwise the
newcomer is not retained. A stable subset keeps reusing, so reuse degrades to the share that fits.

Freeing blocks that an offer names is only safe once no prefill can read them: prefill READs by block
position and the offer's token proof and signature describe what decode held, not what the blocks hold
after reuse. So an evicted turn is not freed at once. It is first *announced* (the engine's evictions feed,
``connector.leases``; routers refuse to replay an announced offer and its lease can no longer be renewed)
and its blocks are freed ``retention_eviction_grace`` seconds later. Until then its room still counts (the
tiers are bounds on memory, not targets), but it is no candidate any more.

**Tenants.** The router names the tenant a turn is retained for (``turnkv.wire.TENANT``). Room is shared max-min
among the tenants that want it (:func:`fair_shares`: each gets what it holds up to an equal split of what the others
leave): a tenant alone may use the whole tier, and when a newcomer's tenant is under its share, the turns of the
tenant furthest over its share go first (oldest first, only down to its share), idle or not. Idle is measured per
tenant (each tenant's own read delays) above a floor (``retention_idle_floor``), so one tenant reading fast cannot
make everyone else's unread turns look idle.

**Forks.** A read turn is not freed at once: it stays readable for ``fork_window`` after its first read, so
forks of one history (parallel samples, subagents, a retry) each pull it. Its conversation has moved on (the
next turn is retained on its own), so read turns are the first candidates when room is needed, before idle
ones, and are evicted (announced, freed after the grace) once the window has passed.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum


class Tier(StrEnum):
    DEVICE = "device"
    HOST = "host"


class Refusal(StrEnum):
    """Why a finished turn was not retained (the label of ``vllm:turnkv_retention_refusals``)."""

    TOO_LARGE = "too_large"  # larger than any tier on its own
    FULL = "full"  # every tier full of turns still likely to be read


class EvictReason(StrEnum):
    """Why a retained turn was evicted (the label of ``vllm:turnkv_retention_evictions``)."""

    IDLE = "idle"  # unread past idle_after, to make room for a newer turn (or above its tenant's fair share)
    SHRUNK = "shrunk"  # its tier's bound was lowered below what it holds
    READ = "read"  # read by its next turn and kept for forks: the fork window passed, or room was needed


@dataclass
class Held:
    blocks: int
    expires_at: float  # the offer's wall-clock expiry: an announcement is kept until then
    tier: Tier = Tier.DEVICE
    since: float = 0.0  # when it was retained or last renewed (wall clock)
    slots: tuple[int, ...] = ()  # host tier: the pool slots that hold it
    read_at: float | None = None  # first read (wall clock): kept only for forks from then on
    fork_window: float = 0.0  # the window its offer was signed with (0: single use)
    tenant: str | None = None  # whom the router retained it for (None: untagged, one tenant of its own)


@dataclass
class Placement:
    """Where a finished turn goes: a tier (and host slots), or why not; and the idle turns evicted for it."""

    tier: Tier | None
    refusal: Refusal | None = None
    slots: tuple[int, ...] = ()
    evicted: list[tuple[str, Held]] = field(default_factory=list)


class HostSlots:
    """The host pool's free slots (block-sized), lowest first so the pool's tail stays unused when it can."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free = list(range(size - 1, -1, -1))  # popped from the end: slot 0 first

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, count: int) -> tuple[int, ...] | None:
        if count > len(self._free):
            return None
        return tuple(self._free.pop() for _ in range(count))

    def give_back(self, slots: tuple[int, ...]) -> None:
        self._free.extend(sorted(slots, reverse=True))
        self._free.sort(reverse=True)


class ReadDelays:
    """How long retained turns waited before prefill read them (the last ``keep`` per tenant, for the
    ``max_tenants`` tenants read most recently), for ``idle_after``."""

    def __init__(self, keep: int = 256, min_samples: int = 8, max_tenants: int = 1024) -> None:
        self._by_tenant: OrderedDict[str | None, deque[float]] = OrderedDict()
        self._keep, self._min, self._max_tenants = keep, min_samples, max_tenants

    @property
    def _delays(self) -> list[float]:
        """Every tenant's samples (what is kept)."""
        return [d for delays in self._by_tenant.values() for d in delays]

    def observe(self, seconds: float, tenant: str | None = None) -> None:
        if seconds < 0:
            return
        delays = self._by_tenant.pop(tenant, None) or deque(maxlen=self._keep)
        delays.append(seconds)
        self._by_tenant[tenant] = delays  # most recently read last
        while len(self._by_tenant) > self._max_tenants:
            self._by_tenant.popitem(last=False)

    def p90(self, tenant: str | None = None) -> float | None:
        delays = self._by_tenant.get(tenant) or ()
        if len(delays) < self._min:
            return None
        ordered = sorted(delays)
        return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]

    def idle_after(self, configured: float, ttl: float, tenant: str | None = None, floor: float = 1.0) -> float:
        """``configured`` when set, else twice the p90 of the waits of ``tenant``'s turns, at least ``floor`` (the
        TTL until there are enough): another tenant's fast reads do not make this tenant's turns idle sooner."""
        if configured > 0:
            return configured
        p90 = self.p90(tenant)
        return ttl if p90 is None else min(ttl, max(floor, 1.0, 2 * p90))


def fair_shares(demands: Mapping[str | None, float], room: float) -> dict[str | None, float]:
    """Max-min fair shares of ``room`` among tenants wanting ``demands`` (pure water-filling): the smallest demands
    are met in full, the rest split what is left equally; a lone tenant gets all it wants up to the room."""
    shares: dict[str | None, float] = {}
    left, pending = float(room), sorted(demands.items(), key=lambda kv: kv[1])
    while pending:
        split = left / len(pending)
        tenant, demand = pending[0]
        if demand > split:  # every tenant left wants more than an equal split: each gets the split
            shares.update((t, split) for t, _ in pending)
            break
        shares[tenant] = demand
        left -= demand
        pending.pop(0)
    return shares


@dataclass
class RetentionLedger:
    """Retained turns in the order decode finished them (oldest first), and those announced as evicted."""

    live: dict[str, Held] = field(default_factory=dict)
    evicting: dict[str, Held] = field(default_factory=dict)
    host: HostSlots | None = None

    @property
    def blocks(self) -> int:
        """Blocks decode holds for next turns, both tiers (evicting turns included: not freed yet)."""
        return self.used(Tier.DEVICE) + self.used(Tier.HOST)

    def used(self, tier: Tier) -> int:
        return (sum(h.blocks for h in self.live.values() if h.tier is tier)
                + sum(h.blocks for h in self.evicting.values() if h.tier is tier))

    def count(self, tier: Tier) -> int:
        return sum(1 for h in (*self.live.values(), *self.evicting.values()) if h.tier is tier)

    def get(self, request_id: str) -> Held | None:
        return self.live.get(request_id) or self.evicting.get(request_id)

    def hold(self, request_id: str, held: Held) -> None:
        self.live[request_id] = held

    def touch(self, request_id: str, now: float) -> None:
        """A renewed lease: the turn is wanted again, so it is not idle."""
        if request_id in self.live:
            self.live[request_id].since = now

    def mark_read(self, request_id: str, now: float) -> Held | None:
        """A live turn read for the first time (kept for forks from now): the turn, else None (unknown, or already
        read)."""
        held = self.live.get(request_id)
        if held is None or held.read_at is not None:
            return None
        held.read_at = now
        return held

    def forks_done(self, now: float) -> list[tuple[str, Held]]:
        """Announce the read turns whose fork window (the one their offer was signed with) has passed."""
        due = [rid for rid, h in self.live.items() if h.read_at is not None and now - h.read_at >= h.fork_window]
        return self._announce_until(due, float("inf"))

    def release(self, request_id: str) -> Held | None:
        """Freed (read by prefill, expired, or evicted and past the grace): its host slots return to the pool."""
        held = self.live.pop(request_id, None) or self.evicting.pop(request_id, None)
        if held is not None and held.slots and self.host is not None:
            self.host.give_back(held.slots)
        return held

    def place(self, adding: int, now: float, device_room: float, host_room: float,
              idle_after: float | Callable[[str | None], float], host_ok: bool = True,
              tenant: str | None = None) -> Placement:
        """Where a finished turn of ``adding`` blocks of ``tenant`` goes: the device tier while it has room, then
        the host tier (``host_ok``: the turn's layout can live there), else nowhere. When neither has room, read
        turns (kept for forks), turns idle for ``idle_after`` (seconds, or seconds by tenant) and, while ``tenant``
        is under its fair share (:func:`fair_shares`), turns of tenants over theirs are evicted (read first; then
        idle, over-share tenants' first; then the largest excess's oldest turns, down to its share; device first)
        until ``adding`` would fit once they are freed; the newcomer itself is not retained then (evicted room frees
        only after the grace)."""
        host_room = host_room if (host_ok and self.host is not None) else 0.0
        if adding > device_room and adding > host_room:
            return Placement(None, Refusal.TOO_LARGE)
        if self.used(Tier.DEVICE) + adding <= device_room:
            return Placement(Tier.DEVICE)
        if host_room and self.used(Tier.HOST) + adding <= host_room:
            slots = self.host.take(adding) if self.host is not None else None
            if slots is not None:
                return Placement(Tier.HOST, slots=slots)
        idle = idle_after if callable(idle_after) else (lambda _tenant, seconds=float(idle_after): seconds)
        return Placement(None, Refusal.FULL, evicted=self._evict_idle(adding, now, device_room, host_room, idle,
                                                                      tenant))

    def held_by_tenant(self, tier: Tier) -> dict[str | None, int]:
        """Live blocks of ``tier`` by tenant (evicting ones are on their way out)."""
        held: dict[str | None, int] = {}
        for h in self.live.values():
            if h.tier is tier:
                held[h.tenant] = held.get(h.tenant, 0) + h.blocks
        return held

    def _evict_idle(self, adding: int, now: float, device_room: float, host_room: float,
                    idle_after: Callable[[str | None], float], tenant: str | None) -> list[tuple[str, Held]]:
        evicted: list[tuple[str, Held]] = []
        for tier, room in ((Tier.DEVICE, device_room), (Tier.HOST, host_room)):
            if adding > room:
                continue
            # What the tier holds once its evicting turns are freed, and how much must go for the newcomer.
            over = sum(h.blocks for h in self.live.values() if h.tier is tier) + adding - room
            held = self.held_by_tenant(tier)
            wanted = {**held, tenant: held.get(tenant, 0) + adding}
            shares = fair_shares(wanted, room)
            excess = {t: held.get(t, 0) - shares[t] for t in held if t != tenant and held.get(t, 0) > shares[t]}
            # Read turns (kept only for forks) first, oldest read first; then idle turns, over-share tenants' first,
            # oldest idle first.
            idle = sorted((h.read_at is None, h.tenant not in excess, h.read_at or h.since, rid)
                          for rid, h in self.live.items()
                          if h.tier is tier and (h.read_at is not None or now - h.since >= idle_after(h.tenant)))
            candidates = [rid for *_, rid in idle]
            if wanted[tenant] <= shares[tenant]:
                candidates += self._over_share(tier, excess, set(candidates))
            if sum(self.live[rid].blocks for rid in candidates) < over:
                continue
            return self._announce_until(candidates, over)
        return evicted

    def _over_share(self, tier: Tier, excess: dict[str | None, float], taken: set[str]) -> list[str]:
        """Turns of tenants over their fair share, the largest excess first, each tenant's oldest first, only as
        many as bring it down to its share (counting the ones already ``taken``)."""
        out: list[str] = []
        for t, over in sorted(excess.items(), key=lambda kv: -kv[1]):
            left = over - sum(self.live[rid].blocks for rid in taken if self.live[rid].tenant == t)
            for rid, h in self.live.items():
                if left <= 0:
                    break
                if h.tier is tier and h.tenant == t and rid not in taken:
                    out.append(rid)
                    left -= h.blocks
        return out

    def shrink(self, tier: Tier, room: float) -> list[tuple[str, Held]]:
        """Evict a tier's oldest live turns until what it holds fits ``room`` again (its bound was lowered)."""
        return self._announce_until([r for r, h in self.live.items() if h.tier is tier], self.used(tier) - room)

    def _announce_until(self, candidates: list[str], over: float) -> list[tuple[str, Held]]:
        """Announce ``candidates`` in order until ``over`` blocks are gone."""
        evicted = []
        for rid in candidates:
            if over <= 0:
                break
            held = self.live.pop(rid)
            self.evicting[rid] = held
            evicted.append((rid, held))
            over -= held.blocks
        return evicted

    def announce(self, request_id: str) -> Held | None:
        """Mark a live turn as evicting (announced, freed after the grace)."""
        held = self.live.pop(request_id, None)
        if held is not None:
            self.evicting[request_id] = held
        return held
