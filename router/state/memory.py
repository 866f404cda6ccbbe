"""In-process conversation store for a single router replica: LRU bounded in entries and in bytes, with expiry.

Entries are kept serialized (``Entry.to_bytes``) with their expiry, keys as raw digest bytes: about
a third of the memory of live objects (a million conversations with 32 block ids each: see
docs/router.md), for a few microseconds of (de)serialization per put and take. An entry's size grows
with its conversation (block ids and per-block proof digests: about 208 KB at 128k tokens), so the
bound that protects the process is bytes (``max_store_bytes``); the entry count bound stays too.
"""

from __future__ import annotations

import sys
import time
from collections import OrderedDict
from collections.abc import Callable

from router.state import Entry
from turnkv import params

#: Bytes an entry costs besides its serialized value: the dict slot, the tuple, the float and the key object.
PER_ENTRY_OVERHEAD = 200


def _compact(key: str) -> bytes | str:
    try:
        return bytes.fromhex(key)  # conversation keys are hex HMACs: half the size as bytes
    except ValueError:
        return key


class MemoryStore:
    does_io = False  # every operation finishes without yielding (no timeout needed)

    def __init__(self, max_entries: int, clock: Callable[[], float] = time.time,
                 max_bytes: int = int(params.get("max_store_bytes").default)) -> None:
        self._entries: OrderedDict[bytes | str, tuple[float, bytes]] = OrderedDict()
        self._max = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self._clock = clock
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _cost(key: bytes | str, value: bytes) -> int:
        return sys.getsizeof(value) + sys.getsizeof(key) + PER_ENTRY_OVERHEAD

    def _drop(self, key: bytes | str) -> tuple[float, bytes] | None:
        item = self._entries.pop(key, None)
        if item is not None:
            self.bytes -= self._cost(key, item[1])
        return item

    async def put(self, key: str, entry: Entry) -> None:
        self._put(_compact(key), entry.expires_at, entry.to_bytes())

    async def put_blob(self, key: str, raw: bytes, expires_at: float) -> None:
        """Opaque bytes until ``expires_at`` (kept responses, ``router.apis.stored``), same bounds."""
        self._put(_compact(key), expires_at, raw)

    async def get_blob(self, key: str) -> bytes | None:
        item = self._entries.get(_compact(key))
        if item is None or item[0] <= self._clock():
            return None
        self._entries.move_to_end(_compact(key))  # least recently used goes first
        return item[1]

    def _put(self, k: bytes | str, expires_at: float, raw: bytes) -> None:
        # orjson's bytes keep their ~8 KiB write buffer: an exact-size copy is 30x smaller
        value = bytes(memoryview(raw))
        cost = self._cost(k, value)
        self._drop(k)
        if cost > self.max_bytes:
            self.evicted += 1
            return  # one entry larger than the whole store: not kept
        self._entries[k] = (expires_at, value)
        self.bytes += cost
        while len(self._entries) > self._max or self.bytes > self.max_bytes:
            oldest = next(iter(self._entries))
            self._drop(oldest)
            self.evicted += 1

    async def get(self, key: str) -> Entry | None:
        item = self._entries.get(_compact(key))
        if item is None or item[0] <= self._clock():
            return None
        return Entry.from_bytes(item[1])

    async def swap(self, key: str, old: Entry, new: Entry | None) -> bool:
        item = self._entries.get(_compact(key))
        if item is None or item[1] != old.to_bytes():
            return False
        if new is None:
            self._drop(_compact(key))
        else:
            await self.put(key, new)
        return True

    async def take(self, key: str) -> Entry | None:
        item = self._drop(_compact(key))
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
            self._drop(k)
        return len(dead)

    async def close(self) -> None:
        self._entries.clear()
        self.bytes = 0
