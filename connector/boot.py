"""Which boot of a decode engine holds a retained turn (pure, no I/O).

A decode engine that restarts keeps its engine id, side channel and block numbering, but not the KV:
params stored before the restart name blocks that now hold nothing (or another request's KV), and the
token proof cannot tell, because it proves what the old process held. Each engine process has its own
NIXL agent, whose metadata decode's scheduler serves in the handshake. Decode stamps its returned
params with a fingerprint of that metadata; prefill compares it with the fingerprint of the agent it
handshook with for that engine and refuses (recomputes) a read from another boot.

With tensor parallelism each rank has its own agent, and a prefill rank handshakes only with the decode ranks
it reads from (rank i with rank i when both sides have the same TP size). The stamp therefore lists every
decode rank's fingerprint, in tensor-parallel rank order, joined by ``.``; each prefill worker checks the
ranks it handshook with. A single-rank stamp is the one-fingerprint form older params carry.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

from turnkv import wire

#: Where decode puts its fingerprint in the kv_transfer_params it returns.
PARAMS_KEY = wire.BOOT  # named once, in turnkv.wire


def fingerprint(agent_metadata: bytes) -> str:
    """Short digest of an engine's NIXL agent metadata (a new process gets a new agent, a new digest)."""
    return hashlib.blake2b(agent_metadata, digest_size=8).hexdigest()


def stamp(rank_fingerprints: Sequence[str]) -> str:
    """Decode's stamp: its ranks' fingerprints in tensor-parallel rank order."""
    return ".".join(rank_fingerprints)


def rank_fingerprints(stamp_text: str) -> list[str]:
    return stamp_text.split(".") if stamp_text else []


def same_boot(expected: str | None, seen: Mapping[int, str] | None) -> bool:
    """A read may go ahead unless a rank's fingerprint is known on both sides and differs.

    ``expected`` is decode's stamp (None: old params, no check); ``seen`` maps each decode rank this worker
    handshook with to the fingerprint of the agent it met there.
    """
    if expected is None or not seen:
        return True
    offered = rank_fingerprints(expected)
    return all(rank >= len(offered) or offered[rank] == current for rank, current in seen.items())
