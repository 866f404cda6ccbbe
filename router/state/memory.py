"""In-process conversation store for a single router replica: bounded LRU with expiry."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from router.state import Entry


class MemoryStore:
    def __init__(self, max_entries: int, clock: Callable[[], float] = time.time) -> None:
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._max = max_entries
        self._clock = clock
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    async def put(self, key: str, entry: Entry) -> None:
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)
            self.evicted += 1

    async def take(self, key: str) -> Entry | None:
        entry = self._entries.pop(key, None)
        if entry is None or entry.expires_at <= self._clock():
            return None
        return entry

    def purge_expired(self) -> int:
        """Drop expired entries (called periodically so dead conversations do not hold memory)."""
        now = self._clock()
        dead = [k for k, e in self._entries.items() if e.expires_at <= now]
        for k in dead:
            del self._entries[k]
        return len(dead)

    async def close(self) -> None:
        self._entries.clear()
