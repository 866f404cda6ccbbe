"""Decode engines' evictions feeds: which retained turns a decode engine evicted, so their offers are not replayed.

A decode engine above ``retained_kv_share`` evicts its oldest retained turns (``connector.retention``): it
announces each on its feed (``turnkv.wire.EVICTIONS_ROUTE``) and frees the blocks
``retention_eviction_grace`` later. The router reads every decode engine's feed each ``evictions_interval``
and refuses to replay an announced offer (outcome ``refused``). An engine whose feed it has not read yet, or
has read before but not for longer than the feed's age limit, has none of its offers replayed until it has
(an eviction may have gone unseen). An engine whose feed answered 404 (no turnkv connector, an engine
restarting behind a proxy, a route that failed to load) has none of its offers replayed either, and its feed is
asked again every interval: a 404 is no proof that the engine never evicts. Each replayed offer carries a
read-by instant (``turnkv.wire.READ_BY``, ``replay_window`` away) after which prefill will not start reading
it; together these bound the time between an eviction and the last possible read of its blocks below the grace
(``turnkv.params.eviction_grace_needed``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from turnkv import wire

log = logging.getLogger("turnkv.router")

#: Why a host-tier offer is not replayed yet: decode's feed does not list its copy as done.
HOST_COPY_PENDING = "host-tier copy not confirmed"
#: Why a sealed offer is not replayed yet: decode's feed has not listed every rank's seal of its KV bytes.
SEAL_PENDING = "KV seal not listed yet"
#: Pauses (seconds) before each fresh read of the feed for a turn whose host copy or seal is not listed yet: decode
#: makes both at the step after the turn ended, so a next turn sent at once may ask before that step ran.
PENDING_REREADS = (0.0, 0.02, 0.1)


def max_age(interval: float) -> float:
    """How old the last read of a feed may be before the engine's offers are refused: two intervals, plus one
    read (its timeout)."""
    return 2 * interval + max(1.0, interval)


@dataclass
class EvictionFeed:
    """What the router knows of one decode engine's evictions (pure)."""

    epoch: str = ""
    seq: int = 0
    evicted: dict[str, float] = field(default_factory=dict)  # request id -> the offer's wall-clock expiry
    read_at: float = 0.0  # wall clock when the last successful read was sent; 0: never
    supported: bool | None = None  # None: not read yet; False: the last read answered 404 (asked again each interval)
    hosted: set[str] = field(default_factory=set)  # turns whose host-tier copy is done (the last read's list)
    #: Seals of retained turns' KV bytes (``turnkv.wire.SEALS``): request id -> {rank: [rank, digests, mac]}, kept
    #: until the offer's expiry; whether the engine seals at all (its offers then say ``SEALED``).
    sealed: dict[str, dict[int, list[Any]]] = field(default_factory=dict)
    sealed_until: dict[str, float] = field(default_factory=dict)

    def apply(self, answer: Mapping[str, Any], sent_at: float, since: int = 0) -> bool:
        """A feed answer to a read sent at ``sent_at`` from cursor ``since``; an answer that is not a feed leaves the
        feed stale. True when it must be read again at once: a new process answered a read from the old process's
        cursor, so its own first announcements (numbered from 1 again) were skipped."""
        epoch, seq, events = answer.get("epoch"), answer.get("seq"), answer.get("evicted")
        if not isinstance(epoch, str) or isinstance(seq, bool) or not isinstance(seq, int) \
                or not isinstance(events, list):
            return False
        if epoch != self.epoch:
            # A new process: its numbers start over, and whatever the old one announced was held by blocks a
            # restarted engine no longer has (the pool refuses those entries anyway).
            self.evicted.clear()
            self.sealed.clear()
            self.sealed_until.clear()
            if since > 0 and self.epoch:
                self.epoch, self.seq = epoch, 0  # read_at stays: not read since, until the read from 0
                return True
        for event in events:
            if isinstance(event, list) and len(event) == 2 and isinstance(event[0], str) \
                    and isinstance(event[1], (int, float)):
                self.evicted[event[0]] = float(event[1])
        # A decode engine may answer from a read it made up to ``age`` seconds before this one arrived (the
        # engine shares its collective_rpc between routers: connector.leases): the feed is that much older.
        age = answer.get("age")
        age = float(age) if isinstance(age, (int, float)) and not isinstance(age, bool) and age > 0 else 0.0
        self.epoch, self.seq, self.read_at, self.supported = epoch, seq, sent_at - age, True
        hosted = answer.get("hosted")
        self.hosted = {e[0] for e in hosted if isinstance(e, list) and e and isinstance(e[0], str)} \
            if isinstance(hosted, list) else set()
        for entry in answer.get("sealed") or ():
            if isinstance(entry, list) and len(entry) == 5 and isinstance(entry[0], str) \
                    and isinstance(entry[1], int) and isinstance(entry[4], (int, float)):
                self.sealed.setdefault(entry[0], {})[entry[1]] = [entry[1], entry[2], entry[3]]
                self.sealed_until[entry[0]] = max(float(entry[4]), self.sealed_until.get(entry[0], 0.0))
        for request_id, until in list(self.evicted.items()):
            if until < sent_at:
                del self.evicted[request_id]  # the offer has expired: prefill refuses it anyway
        for request_id, until in list(self.sealed_until.items()):
            if until < sent_at or request_id in self.evicted:
                del self.sealed_until[request_id]
                self.sealed.pop(request_id, None)
        return False

    def unsupported(self) -> None:
        self.supported = False

    def seals_of(self, request_id: Any, ranks: int) -> list[list[Any]] | None:
        """Every rank's seal of the offer's KV bytes, as a replay carries them (``turnkv.wire.SEALS``), or None."""
        by_rank = self.sealed.get(request_id) or {}
        if ranks <= 0 or sorted(by_rank) != list(range(ranks)):
            return None
        return [by_rank[r] for r in range(ranks)]

    def refuses(self, request_id: Any, now: float, interval: float, host_tier: bool = False,
                sealed_ranks: int = 0) -> str | None:
        """Why an offer of this engine must not be replayed now, or None. A host-tier offer also needs its copy
        listed as done (decode copies at the step after the turn ends: ``connector.host_tier``), a sealed one every
        rank's seal (``sealed_ranks``: decode's tensor-parallel ranks; digested at that step too)."""
        if request_id in self.evicted:
            return "evicted"
        if host_tier and request_id not in self.hosted:
            return HOST_COPY_PENDING
        if sealed_ranks and self.seals_of(request_id, sealed_ranks) is None:
            return SEAL_PENDING
        if self.supported is None:
            # Not read yet (a router just started, an engine just discovered): decode may have evicted the turn
            # while this router was not looking. The first read comes within one interval.
            return "evictions feed not read yet"
        if not self.supported:
            # The feed answered 404: whatever this engine evicts goes unseen, so nothing it offers is replayed
            # until a read succeeds (each interval re-probes it).
            return "evictions feed unsupported"
        if now - self.read_at > max_age(interval):
            return "evictions feed not read lately"
        return None


async def read_feed(session: aiohttp.ClientSession, url: str, feed: EvictionFeed, timeout: float,
                    clock: Callable[[], float], fresh: bool = False) -> None:
    """One read of an engine's feed into ``feed``. ``fresh``: not from the engine's short cache of its last read
    (``connector.leases``): a read for a turn whose host copy or seal is due at decode's next step."""
    for _ in range(2):  # a second read only after a restart seen mid-cursor (EvictionFeed.apply)
        sent_at, since = clock(), feed.seq
        try:
            async with session.get(f"{url}{wire.EVICTIONS_ROUTE}?since={since}{'&fresh=1' if fresh else ''}",
                                   timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                if resp.status == 404:
                    feed.unsupported()
                    return
                if resp.status != 200:
                    return
                answer = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            return
        if not isinstance(answer, Mapping) or not feed.apply(answer, sent_at, since):
            return


async def evictions_loop(decode: Callable[[], list[Any]], session: aiohttp.ClientSession,
                         interval: Callable[[], float], clock: Callable[[], float]) -> None:
    """Read every decode engine's feed each ``interval`` (engines come from ``decode()``: discovery may change
    them), a feed that answered 404 included (re-probed: its offers are refused until a read succeeds)."""
    while True:
        try:
            every = interval()
            engines = list(decode())
            await asyncio.gather(*(read_feed(session, e.url, e.feed, max(1.0, every), clock) for e in engines))
        except Exception:  # never let the loop die
            log.exception("evictions loop")
        await asyncio.sleep(interval())
