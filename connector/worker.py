"""Worker-side mixin: NIXL transfer telemetry split by operation (READ vs WRITE this engine posted).

Upstream records every finished transfer into one list (``vllm:nixl_bytes_transferred``), so a push +
bi-directional prefill, which both READs the previous turn from decode and WRITEs the new KV into the
next decode, cannot show which moved what. The split counters are ``vllm:turnkv_{read,write}_*``.
"""

from __future__ import annotations

from typing import Any


class TransferStatsMixin:
    xfer_stats: Any

    def _pop_done_transfers(self, transfers: dict[str, list[int]]) -> tuple[set[str], set[str]]:
        data = self.xfer_stats.data
        before = len(data["bytes_transferred"])
        done = super()._pop_done_transfers(transfers)  # type: ignore[misc]
        data = self.xfer_stats.data  # the same dict: upstream appends, it never swaps it mid-call
        moved = data["bytes_transferred"][before:]
        if moved:
            op = "write" if transfers is getattr(self, "_sending_transfers", None) else "read"
            data.setdefault(f"turnkv_{op}_bytes", []).append(sum(moved))
            data.setdefault(f"turnkv_{op}_seconds", []).append(sum(data["transfer_duration"][before:]))
        return done
