"""What a KV seal costs (``connector.fingerprint``): the time to digest N blocks, on this machine's device, for the
KV layouts turnkv serves, against the time a pull of those blocks takes.

Decode digests each retained turn once (at the step after it finishes), prefill digests every block a READ brought
(before the request computes). Both are one gather of ``SAMPLES`` elements per block and layer view and one
multiply-add: the cost grows with blocks x layers, not with the block's bytes. The pull it guards moves every byte
of those blocks. The table prints the digest time per block and per pulled token, and, where a READ bandwidth is
given (``--read-gbps``; the local stack's NIXL READs measured by ``bench.pull_cost``), the digest's share of the
pull's transfer time.

    python -m bench.seal_cost --blocks 64 --repeat 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

from connector import fingerprint


@dataclass(frozen=True)
class Layout:
    """One engine rank's KV cache: layers of ``[blocks, 2, block_size, kv_heads, head_dim]`` (vLLM 0.32's NIXL
    block-major layout)."""

    name: str
    layers: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: str

    def block_bytes(self) -> int:
        import torch

        return self.layers * 2 * self.block_size * self.kv_heads * self.head_dim * \
            torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


LAYOUTS = (
    # the tiny model the suites and the demo run (turnkv.local.model_maker), float32, vLLM's CPU block of 128
    Layout("tiny (local stack)", 2, 128, 2, 32, "float32"),
    # Llama-3.3-70B on a p5en rank at TP 8 (8 KV heads / 8), bf16, vLLM's CUDA block of 16
    Layout("70B, TP 8 rank", 80, 16, 1, 128, "bfloat16"),
    # Qwen3-32B at TP 2 (8 KV heads / 2), bf16, block 16
    Layout("32B, TP 2 rank", 64, 16, 4, 128, "bfloat16"),
)


def measure(layout: Layout, blocks: int, repeat: int, device: str) -> float:
    """Median seconds to digest ``blocks`` blocks (a cache of 4x that many, so the gather is not one contiguous run)."""
    import torch

    total = blocks * 4
    caches = {f"l{i:03d}": torch.randn(total, 2, layout.block_size, layout.kv_heads, layout.head_dim,
                                       device=device).to(getattr(torch, layout.dtype)) for i in range(layout.layers)}
    sampler = fingerprint.Sampler([v for n in sorted(caches) for v in fingerprint.block_major_views(caches[n], total)])
    ids = list(range(0, total, 4))
    sampler.digests(ids)  # warm-up
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        sampler.digests(ids)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.seal_cost", description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=64, help="Blocks per digest call (one pull's blocks).")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--device", default="cpu")
    p.add_argument("--read-gbps", type=float, default=None,
                   help="READ bandwidth to compare with (GB/s), e.g. bench.pull_cost's read bytes / read seconds.")
    args = p.parse_args(argv)
    print(f"digest of {args.blocks} blocks, median of {args.repeat}, on {args.device}"
          f" ({fingerprint.SAMPLES} samples per block and layer view)\n")
    head = "| layout | block bytes | digest ms | us per block | ns per token |"
    head += " digest / READ time |" if args.read_gbps else ""
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for layout in LAYOUTS:
        seconds = measure(layout, args.blocks, args.repeat, args.device)
        row = (f"| {layout.name} | {layout.block_bytes():,} | {seconds * 1000:.2f} | "
               f"{seconds / args.blocks * 1e6:.1f} | {seconds / (args.blocks * layout.block_size) * 1e9:.0f} |")
        if args.read_gbps:
            read_s = args.blocks * layout.block_bytes() / (args.read_gbps * 1e9)
            row += f" {seconds / read_s:.2f} |"
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
