"""Which boot of a decode engine holds a retained turn (pure, no I/O).

A decode engine that restarts keeps its engine id, side channel and block numbering, but not the KV:
params stored before the restart name blocks that now hold nothing (or another request's KV), and the
token proof cannot tell, because it proves what the old process held. Each engine process has its own
NIXL agent, whose metadata decode's scheduler serves in the handshake. Decode stamps its returned
params with a fingerprint of that metadata; prefill compares it with the fingerprint of the agent it
handshook with for that engine and refuses (recomputes) a read from another boot.
"""

from __future__ import annotations

import hashlib

from turnkv import wire

#: Where decode puts its fingerprint in the kv_transfer_params it returns.
PARAMS_KEY = wire.BOOT  # named once, in turnkv.wire


def fingerprint(agent_metadata: bytes) -> str:
    """Short digest of an engine's NIXL agent metadata (a new process gets a new agent, a new digest)."""
    return hashlib.blake2b(agent_metadata, digest_size=8).hexdigest()


def same_boot(expected: str | None, current: str | None) -> bool:
    """A read may go ahead unless both fingerprints are known and differ (old params carry none)."""
    return expected is None or current is None or expected == current
