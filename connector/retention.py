"""Decode's retained turns under a share of its KV cache: oldest first out (pure, no vLLM).

A decode engine keeps a finished turn's blocks for the next turn's prefill to read. Above
``retained_kv_share`` of the cache it frees the oldest retained turns to make room for the newest (the
conversation most likely to come back soon), instead of refusing the newest.

Freeing blocks that an offer names is only safe once no prefill can read them: prefill READs by block
position and the offer's token proof and signature describe what decode held, not what the blocks hold
after reuse. So an evicted turn is not freed at once. It is first *announced* (the engine's evictions feed,
``connector.leases``; routers refuse to replay an announced offer and its lease can no longer be renewed)
and its blocks are freed ``retention_eviction_grace`` seconds later, longer than a router takes to see the
announcement and a prefill it already sent the offer to takes to read. Until then its blocks still count
against the share (the share is a bound on memory, not a target), but it is no candidate any more.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Held:
    blocks: int
    expires_at: float  # the offer's wall-clock expiry: an announcement is kept until then


@dataclass
class RetentionLedger:
    """Retained turns in the order decode finished them (oldest first), and those announced as evicted."""

    live: dict[str, Held] = field(default_factory=dict)
    evicting: dict[str, Held] = field(default_factory=dict)

    @property
    def blocks(self) -> int:
        """Blocks decode holds for next turns (evicting turns included: not freed yet)."""
        return sum(h.blocks for h in self.live.values()) + sum(h.blocks for h in self.evicting.values())

    def hold(self, request_id: str, blocks: int, expires_at: float) -> None:
        self.live[request_id] = Held(blocks, expires_at)

    def release(self, request_id: str) -> bool:
        """Blocks freed (read by prefill, expired, or evicted and past the grace); True if it was held."""
        return (self.live.pop(request_id, None) or self.evicting.pop(request_id, None)) is not None

    def fits(self, adding: int, capacity: float) -> bool:
        """Whether ``adding`` blocks can be retained, evicting live turns if need be (evicting ones are not
        freed yet: they still take their room)."""
        return sum(h.blocks for h in self.evicting.values()) + adding <= capacity

    def make_room(self, adding: int, capacity: float) -> list[tuple[str, Held]] | None:
        """Evict the oldest live turns until ``adding`` more blocks fit in ``capacity``; returns the evicted
        (oldest first), or None when the new turn cannot fit even with every live turn gone (then nothing is
        evicted and the new turn is not retained)."""
        over = self.blocks + adding - capacity
        if over <= 0:
            return []
        if sum(h.blocks for h in self.live.values()) < over:
            return None
        evicted = []
        for request_id in list(self.live):
            if over <= 0:
                break
            held = self.live.pop(request_id)
            self.evicting[request_id] = held
            evicted.append((request_id, held))
            over -= held.blocks
        return evicted
