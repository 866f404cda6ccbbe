"""Token proof for pulled KV (pure, no vLLM imports).

Bi-directional prefill pulls KV from decode *by position*; it never compares tokens. Decode therefore
attaches a chained digest of the token ids it holds, one per KV block (like prefix-cache block
hashes), and prefill pulls only the longest prefix whose digests match its own prompt. A partial
last block is verified over exactly the tokens decode holds in it, or not pulled.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from turnkv import wire

PARAMS_KEY = wire.TOKEN_PROOF  # named once, in turnkv.wire
DIGEST_BYTES = 8
VERSION = 1


def _chain(previous: bytes, tokens: Sequence[int]) -> bytes:
    h = hashlib.blake2b(previous, digest_size=DIGEST_BYTES)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


def block_digests(token_ids: Sequence[int], block_size: int) -> list[str]:
    """Chained digests of ``token_ids`` split into blocks; the last one may cover a partial block."""
    digests: list[str] = []
    previous = b"turnkv-proof-v1"
    for start in range(0, len(token_ids), block_size):
        previous = _chain(previous, token_ids[start:start + block_size])
        digests.append(previous.hex())
    return digests


def make_proof(token_ids: Sequence[int], block_size: int) -> dict[str, Any]:
    return {"v": VERSION, "block_size": block_size, "num_tokens": len(token_ids),
            "digests": block_digests(token_ids, block_size)}


@dataclass(frozen=True)
class Verdict:
    offered: int  # tokens decode offered that the prompt could use: min(remote, prompt)
    verified: int  # leading tokens whose digests match: the only ones that may be pulled
    reason: str  # "ok", "mismatch", "no-proof", "bad-proof"

    @property
    def mismatched(self) -> int:
        return self.offered - self.verified


def verify(proof: Mapping[str, Any] | None, prompt_ids: Sequence[int], remote_num_tokens: int) -> Verdict:
    """How many leading tokens of ``prompt_ids`` are proven to equal what decode holds."""
    offered = max(0, min(remote_num_tokens, len(prompt_ids)))
    if proof is None:
        return Verdict(offered, 0, "no-proof")
    try:
        block_size = int(proof["block_size"])
        held = int(proof["num_tokens"])
        digests = list(proof["digests"])
        if proof.get("v") != VERSION or block_size <= 0 or held < remote_num_tokens or \
                len(digests) != -(-held // block_size):
            raise ValueError
    except (KeyError, TypeError, ValueError):
        return Verdict(offered, 0, "bad-proof")
    verified = 0
    previous = b"turnkv-proof-v1"
    for index, digest in enumerate(digests):
        start = index * block_size
        end = min(start + block_size, held)  # decode's block covers [start, end)
        if end > len(prompt_ids):
            break  # the prompt ends inside this block: it cannot be checked against the whole block
        previous = _chain(previous, prompt_ids[start:end])
        if previous.hex() != digest:
            break
        verified = end
    verified = min(verified, offered)
    return Verdict(offered, verified, "ok" if verified == offered else "mismatch")
