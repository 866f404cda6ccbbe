"""Worker-side mixin, both modes: transfer metrics by operation, and the decode-boot check on reads.

- Upstream records every finished transfer into one list (``vllm:nixl_bytes_transferred``), so a push +
  bi-directional prefill, which both READs the previous turn from decode and WRITEs the new KV into the
  next decode, cannot show which moved what. The split counters are ``vllm:turnkv_{read,write}_*``.
- A read of decode's retained blocks goes ahead only if the decode engine this worker handshook with is
  the boot that stamped the offer (``connector.boot``); otherwise it fails at once and prefill recomputes.
"""

from __future__ import annotations

import logging
from typing import Any

from connector import boot
from connector.stats import TurnkvKVConnectorStats

logger = logging.getLogger("vllm.turnkv.connector")


class TurnkvWorkerMixin:
    xfer_stats: Any
    _remote_agents: dict[str, Any]
    _recv_failures: set[str]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # turnkv's counters count as news: upstream's stats report a step only when it moved or lost KV.
        self.xfer_stats = TurnkvKVConnectorStats()
        self._turnkv_boots: dict[str, str] = {}  # engine id -> boot fingerprint of its handshaken agent
        self._turnkv_expected: dict[str, str] = {}  # request id -> boot its offer came from

    # transfer metrics ---------------------------------------------------------------------------

    def _pop_done_transfers(self, transfers: dict[str, list[int]]) -> tuple[set[str], set[str]]:
        data = self.xfer_stats.data
        before = len(data["bytes_transferred"])
        done = super()._pop_done_transfers(transfers)  # type: ignore[misc]
        moved = data["bytes_transferred"][before:]
        if moved:
            op = "write" if transfers is getattr(self, "_sending_transfers", None) else "read"
            self.xfer_stats.record(f"turnkv_{op}_bytes", sum(moved))
            self.xfer_stats.record(f"turnkv_{op}_seconds", sum(data["transfer_duration"][before:]))
        return done

    # decode boot check ---------------------------------------------------------------------------

    def add_remote_agent(self, nixl_agent_meta: Any, remote_tp_rank: int = 0, *args: Any, **kwargs: Any) -> str:
        name = super().add_remote_agent(nixl_agent_meta, remote_tp_rank, *args, **kwargs)  # type: ignore[misc]
        if remote_tp_rank == 0:
            self._turnkv_boots[nixl_agent_meta.engine_id] = boot.fingerprint(nixl_agent_meta.agent_metadata)
        return name

    def start_load_kv(self, metadata: Any) -> None:
        self._turnkv_expected.update(getattr(metadata, "turnkv_boots", None) or {})
        super().start_load_kv(metadata)  # type: ignore[misc]

    def _read_blocks_for_req(self, req_id: str, meta: Any) -> None:
        engine_id = meta.remote.engine_id
        if req_id in self._turnkv_expected and engine_id in self._remote_agents:
            expected = self._turnkv_expected.pop(req_id)
            current = self._turnkv_boots.get(engine_id)
            if not boot.same_boot(expected, current):
                logger.warning("turnkv: request %s: decode engine %s has restarted since it offered its KV "
                               "(boot %s, now %s); recomputing", req_id, engine_id, expected, current)
                self.xfer_stats.record("turnkv_stale_offers", 1)
                self._handle_failed_transfer(req_id, None, self._recv_failures,  # type: ignore[attr-defined]
                                             record_failed_transfer=False)
                return
        super()._read_blocks_for_req(req_id, meta)  # type: ignore[misc]
