"""KV fingerprints: a cheap digest of the bytes each KV block holds, taken where the block lives (issue 50).

Decode seals a turn when it retains it: for each block, a fixed sample of the block's elements in every layer of
this rank's KV cache, hashed into one 64-bit value. Prefill recomputes the same digest on the blocks a READ brought,
before any forward uses them; a block whose digest differs is reported invalid (vLLM's scheduler recomputes it and
its hash never enters the prefix cache). The token proof checks what an offer *claims*; this checks what the READ
*brought*, whatever bookkeeping path chose the addresses: a wrong block, a wrong layer, a wrong tier, a stale or
half-written block all change the sampled bytes.

The sample: ``SAMPLES`` positions per block and layer view, spread evenly over the block's elements (first and last
included, so a block written only in part differs) with a fixed seeded jitter, identical on every engine; the
gathered elements' bytes as 32-bit words (bytes where a block's sample is not a whole number of words), each
weighted by a fixed odd 63-bit constant, summed with wrap-around (torch's int64
arithmetic). Runs as torch ops on the cache's own device (one ``take`` of ``blocks x SAMPLES`` elements per layer
view, then one stack and one multiply-add for all of them, over 32-bit words): no copy of a whole block, no kernel
of our own, the same code on CPU and CUDA. Not a MAC: the bytes are not an adversary's; the seal's integrity is the
MAC over it (``turnkv.wire``).

Both sides must lay the blocks out alike (same block size, layout and tensor-parallel shard); where they do not,
prefill cannot compare and says so (``vllm:turnkv_fingerprint_checks_total{result="unverifiable"}``).
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterable, Sequence
from typing import Any

#: Elements sampled per block in each layer view (K and V of a layer are separate views where the cache splits them).
SAMPLES = 16
#: Seed of the sample positions and weights: every engine of every version must draw the same ones.
SEED = 0x7C3A_91E5
_MASK = (1 << 64) - 1


def block_major_views(cache: Any, num_blocks: int) -> list[Any]:
    """Views of one layer's KV cache whose first dimension is the block: the tensor itself when it is block-major
    (vLLM 0.32's NIXL layout), its leading slices when the block is the second dimension (K and V first); none when
    neither (the layer is not fingerprinted)."""
    shape = tuple(getattr(cache, "shape", ()))
    if len(shape) >= 2 and shape[0] == num_blocks:
        return [cache]
    if len(shape) >= 3 and shape[1] == num_blocks and shape[0] <= 4:
        return [cache[i] for i in range(shape[0])]
    return []


class Sampler:
    """The fixed positions and weights for a set of layer views (built once per engine, on the views' devices).

    Views of one shape, dtype and device (every layer of a uniform model) share one flat position vector, so a call
    costs one ``take`` per view plus a constant few ops for all of them: launch count, not bytes, is what a digest
    of a few hundred small samples costs on a GPU."""

    def __init__(self, views: Sequence[Any]) -> None:
        import torch

        self.views = list(views)
        gen = torch.Generator().manual_seed(SEED)
        self._groups: list[tuple[list[Any], Any, int, Any]] = []  # (flat views, positions, elems per block, weights)
        by_kind: dict[tuple[Any, ...], list[Any]] = {}
        for view in self.views:
            if not view.is_contiguous():
                raise ValueError("KV seals need each layer view contiguous (vLLM's NIXL layout is)")
            by_kind.setdefault((tuple(view.shape[1:]), view.dtype, str(view.device)), []).append(view)
        for (inner, _, _), group in by_kind.items():
            elems = 1
            for size in inner:
                elems *= int(size)
            spread = torch.linspace(0, max(0, elems - 1), SAMPLES).long()
            jitter = torch.randint(0, max(1, elems // SAMPLES), (SAMPLES,), generator=gen)
            positions = torch.clamp(spread + jitter * (spread < elems - 1), max=elems - 1)
            positions[0], positions[-1] = 0, elems - 1
            width = len(group) * SAMPLES * group[0].element_size()
            width = width // 4 if width % 4 == 0 else width  # 32-bit words where a block's sample allows: 4x fewer
            weights = torch.randint(1, 1 << 62, (width,), generator=gen, dtype=torch.int64) * 2 + 1
            device = group[0].device
            self._groups.append(([v.reshape(-1) for v in group], positions.to(device), elems, weights.to(device)))

    def __bool__(self) -> bool:
        return bool(self.views)

    def digests(self, block_ids: Sequence[int]) -> list[int]:
        """One 64-bit digest per block id, over every view (unsigned)."""
        import torch

        if not block_ids or not self.views:
            return []
        total = None
        for flats, positions, elems, weights in self._groups:
            ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=positions.device)
            index = ids[:, None] * elems + positions[None, :]  # [blocks, SAMPLES] flat offsets, one for every view
            sampled = torch.stack([flat.take(index) for flat in flats], dim=1)  # [blocks, views, SAMPLES]
            raw = sampled.reshape(len(block_ids), -1).view(torch.uint8).reshape(len(block_ids), -1)
            if raw.shape[1] == weights.shape[0] * 4:
                raw = raw.view(torch.int32)
            raw = raw.to(torch.int64)
            part = (raw * weights[None, :]).sum(dim=1)
            total = part if total is None else total * 31 + part
        assert total is not None
        return [int(v) & _MASK for v in total.cpu().tolist()]


def encode(digests: Iterable[int]) -> str:
    """Digests as text for the wire (little-endian 64-bit words, base64)."""
    values = [int(d) & _MASK for d in digests]
    return base64.b64encode(struct.pack(f"<{len(values)}Q", *values)).decode()


def decode(text: Any) -> list[int] | None:
    """The digests of :func:`encode`; None when the text is not such a list."""
    if not isinstance(text, str):
        return None
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        return None
    if len(raw) % 8:
        return None
    return list(struct.unpack(f"<{len(raw) // 8}Q", raw))


def mismatched(expected: Sequence[int], local: Sequence[int], local_blocks: Sequence[int]) -> list[int]:
    """The local blocks whose digest differs from decode's (pure). A READ fills prefill's blocks with the offer's
    last ``len(local_blocks)`` blocks (upstream skips those prefill's own prefix cache already holds), so the
    expected digests are aligned on the tail; blocks beyond what decode sealed count as mismatched."""
    tail = list(expected[-len(local_blocks):]) if local_blocks else []
    if len(tail) < len(local_blocks):
        tail = [None] * (len(local_blocks) - len(tail)) + tail  # type: ignore[list-item]
    return [block for block, want, got in zip(local_blocks, tail, local, strict=True) if want != got]
