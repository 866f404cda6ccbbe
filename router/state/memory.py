"""In-process conversation store for a single router replica: bounded LRU with expiry.

Entries are kept serialized (``Entry.to_bytes``) with their expiry, keys as raw digest bytes: about
a third of the memory of live objects (a million conversations with 32 block ids each: see
docs/router.md), for a few microseconds of (de)serialization per put and take.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from router.state import Entry


def _compact(key: str) -> bytes | str:
    try:
        return bytes.fromhex(key)  # conversation keys are hex HMACs: half the size as bytes
    except ValueError:
        return key


class MemoryStore:
    def __init__(self, max_entries: int, clock: Callable[[], float] = time.time) -> None:
        self._entries: OrderedDict[bytes | str, tuple[float, bytes]] = OrderedDict()
        self._max = max_entries
        self._clock = clock
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    async def put(self, key: str, entry: Entry) -> None:
        k = _compact(key)
        # orjson's bytes keep their ~8 KiB write buffer: an exact-size copy is 30x smaller
        self._entries[k] = (entry.expires_at, bytes(memoryview(entry.to_bytes())))
        self._entries.move_to_end(k)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)
            self.evicted += 1

    async def take(self, key: str) -> Entry | None:
        item = self._entries.pop(_compact(key), None)
        if item is None or item[0] <= self._clock():
            return None
        return Entry.from_bytes(item[1])

    def peek(self, key: str) -> Entry | None:
        """The entry without taking it (tests and debugging)."""
        item = self._entries.get(_compact(key))
        return None if item is None else Entry.from_bytes(item[1])

    def conversation_keys(self) -> list[str]:
        return [k.hex() if isinstance(k, bytes) else k for k in self._entries]

    def purge_expired(self) -> int:
        """Drop expired entries (called periodically so dead conversations do not hold memory)."""
        now = self._clock()
        dead = [k for k, (expires_at, _) in self._entries.items() if expires_at <= now]
        for k in dead:
            del self._entries[k]
        return len(dead)

    async def close(self) -> None:
        self._entries.clear()
