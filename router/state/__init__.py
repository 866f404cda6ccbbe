"""Conversation state: conversation key -> the decode engine's latest ``kv_transfer_params``.

Only metadata is stored (block ids, engine address, expiry), never KV tensors. An entry is single use (``take``
removes it atomically) unless decode's offer is fork-readable (``turnkv.wire.FORK_WINDOW``): then the first read
marks it (``fork_until``) and forks of the same history read it until then (``router.flow``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from router.guard import History


@dataclass(frozen=True)
class Entry:
    params: dict[str, Any]
    history: History
    #: Router-clock (time.time()) instant after which the entry must not be replayed.
    expires_at: float
    decode_engine: str = ""
    #: Router-clock instant the entry was stored (a decode engine that restarted since lost the blocks).
    stored_at: float = 0.0
    #: Router-clock instant after which forks may no longer read it (set at its first read; 0: not read yet).
    fork_until: float = 0.0

    def to_bytes(self) -> bytes:
        h = self.history
        return orjson.dumps({"p": self.params, "h": [h.kind, h.render_digest, h.digest, h.length],
                             "e": self.expires_at, "d": self.decode_engine, "s": self.stored_at,
                             "f": self.fork_until})

    @classmethod
    def from_bytes(cls, raw: bytes) -> Entry:
        data = orjson.loads(raw)
        return cls(data["p"], History(*data["h"]), data["e"], data.get("d", ""), data.get("s", 0.0),
                   data.get("f", 0.0))


class StoreError(RuntimeError):
    """The store could not answer (down, slow past its timeout): proceed without reuse."""


class ConversationStore(Protocol):
    #: Whether an operation waits on the network (and so may hang: the flow bounds it by ``store_timeout_ms``).
    #: An in-process store's operations finish without yielding; the flow awaits them inline.
    does_io: bool

    async def put(self, key: str, entry: Entry) -> None: ...

    async def get(self, key: str) -> Entry | None:
        """The live entry for ``key`` without taking it (None when absent or expired)."""
        ...

    async def swap(self, key: str, old: Entry, new: Entry | None) -> bool:
        """Replace ``old`` with ``new`` (None: delete) only if ``old`` is still the stored entry; True when done.
        A concurrent turn that took or replaced the entry meanwhile wins."""
        ...

    async def take(self, key: str) -> Entry | None:
        """Remove and return the live entry for ``key`` (None when absent or expired)."""
        ...

    async def close(self) -> None: ...
