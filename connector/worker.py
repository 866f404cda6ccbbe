"""Worker-side mixin, both modes: transfer metrics by operation, and the decode-boot check on reads.

- Upstream records every finished transfer into one list (``vllm:nixl_bytes_transferred``), so a push +
  bi-directional prefill, which both READs the previous turn from decode and WRITEs the new KV into the
  next decode, cannot show which moved what. The split counters are ``vllm:turnkv_{read,write}_*``.
- A read of decode's retained blocks goes ahead only if the decode engine this worker handshook with is
  the boot that stamped the offer (``connector.boot``); otherwise it fails at once and prefill recomputes.
  A mismatch usually means decode restarted (same engine id and address) after this worker handshook:
  upstream keeps the dead process's agent, so every later offer of the new process would fail too. The
  stale handshake is dropped (upstream's invalid-peer path) and the next read handshakes again. Not for an
  offer of a process this worker has handshaken with before (an old offer: the handshake is the newer one),
  and at most once per handshake, so offers cannot make it re-handshake over and over.
- Decode's retained turns evicted by the scheduler (``connector.retention``): each is announced on the
  evictions feed (``connector.leases``), can no longer be renewed, and its lease is cut to the grace, after
  which upstream's reaper frees its blocks.
- The cost model's inputs measured where they happen, sent back to the scheduler with each step's output
  (:class:`TurnkvWorkerMeta`, vLLM's worker -> scheduler metadata channel): the step's number (so the
  scheduler times each step even when steps overlap), the bytes and seconds of every NIXL READ this
  worker posted (NIXL's own telemetry: the transfer, not the time the request waited for the engine),
  and how long each NIXL handshake took.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from connector import boot, compat
from connector.stats import TurnkvKVConnectorStats
from turnkv import wire

logger = logging.getLogger("vllm.turnkv.connector")


@dataclass
class TurnkvWorkerMeta(KVConnectorWorkerMetadata):
    """What one engine step's workers measured for the scheduler's cost model."""

    #: Numbers of the steps this output belongs to (``turnkv_step`` of the scheduler's metadata).
    steps: list[int] = field(default_factory=list)
    #: (bytes, seconds) of each finished NIXL READ this worker posted.
    reads: list[tuple[int, float]] = field(default_factory=list)
    #: (remote engine id, seconds) of each NIXL handshake this worker finished.
    handshakes: list[tuple[str, float]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Tensor-parallel ranks: one step, every rank's reads and handshakes."""
        if isinstance(other, TurnkvWorkerMeta):
            self.steps = sorted({*self.steps, *other.steps})
            self.reads = [*self.reads, *other.reads]
            self.handshakes = [*self.handshakes, *other.handshakes]
        return self


class TurnkvWorkerMixin:
    xfer_stats: Any
    _remote_agents: dict[str, Any]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # turnkv's counters count as news: upstream's stats report a step only when it moved or lost KV.
        self.xfer_stats = TurnkvKVConnectorStats()
        # engine id -> {remote tensor-parallel rank: fingerprint of the agent handshaken there}
        self._turnkv_boots: dict[str, dict[int, str]] = {}
        self._turnkv_expected: dict[str, str] = {}  # request id -> boot its offer came from
        self._turnkv_dropped: set[tuple[str, tuple[tuple[int, str], ...]]] = set()  # handshakes dropped once
        self._turnkv_met: set[tuple[str, int, str]] = set()  # (engine, rank, fingerprint) ever handshaken with
        # Cost model samples, taken by build_turnkv_meta once per step (handshakes finish in a NIXL thread).
        self._turnkv_step: int | None = None
        self._turnkv_reads: list[tuple[int, float]] = []
        self._turnkv_handshakes: list[tuple[str, float]] = []
        # Evictions announced (request id -> (announcement number, offer's wall expiry)), kept until the offer
        # expires; the epoch tells a router reading the feed that this process restarted (numbers start over).
        self._turnkv_evicted: dict[str, tuple[int, float]] = {}
        self._turnkv_evict_seq = 0
        self._turnkv_epoch = uuid.uuid4().hex[:12]

    # transfer metrics ---------------------------------------------------------------------------

    def _pop_done_transfers(self, transfers: dict[str, list[int]]) -> tuple[set[str], set[str]]:
        data = self.xfer_stats.data
        before = len(data["bytes_transferred"])
        done = super()._pop_done_transfers(transfers)  # type: ignore[misc]
        moved = data["bytes_transferred"][before:]
        if moved:
            op = "write" if transfers is getattr(self, "_sending_transfers", None) else "read"
            seconds = data["transfer_duration"][before:]
            self.xfer_stats.record(f"turnkv_{op}_bytes", sum(moved))
            self.xfer_stats.record(f"turnkv_{op}_seconds", sum(seconds))
            if op == "read":
                self._turnkv_reads.extend(zip(moved, seconds, strict=False))
        return done

    # cost model samples ---------------------------------------------------------------------------

    def _nixl_handshake(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        result = super()._nixl_handshake(*args, **kwargs)  # type: ignore[misc]
        engine = kwargs.get("expected_engine_id", args[3] if len(args) > 3 else "")
        self._turnkv_handshakes.append((str(engine), time.perf_counter() - started))
        return result

    def build_turnkv_meta(self) -> TurnkvWorkerMeta | None:
        """This step's samples for the scheduler (None when there are none: the output stays empty)."""
        step, self._turnkv_step = self._turnkv_step, None
        reads, self._turnkv_reads = self._turnkv_reads, []
        handshakes, self._turnkv_handshakes = self._turnkv_handshakes, []
        if step is None and not reads and not handshakes:
            return None
        return TurnkvWorkerMeta([step] if step is not None else [], reads, handshakes)

    # decode boot check ---------------------------------------------------------------------------

    def add_remote_agent(self, nixl_agent_meta: Any, remote_tp_rank: int = 0, *args: Any, **kwargs: Any) -> str:
        name = super().add_remote_agent(nixl_agent_meta, remote_tp_rank, *args, **kwargs)  # type: ignore[misc]
        # Every rank this worker reads from (with TP > 1, rank i reads decode's rank i, not rank 0).
        ranks = self._turnkv_boots.setdefault(nixl_agent_meta.engine_id, {})
        ranks[int(remote_tp_rank)] = boot.fingerprint(nixl_agent_meta.agent_metadata)
        self._turnkv_met.add((nixl_agent_meta.engine_id, int(remote_tp_rank), ranks[int(remote_tp_rank)]))
        return name

    def start_load_kv(self, metadata: Any) -> None:
        self._turnkv_expected.update(getattr(metadata, "turnkv_boots", None) or {})
        self._turnkv_step = getattr(metadata, "turnkv_step", None)
        super().start_load_kv(metadata)  # type: ignore[misc]
        evict = getattr(metadata, "turnkv_evict", None)
        if evict:
            self.turnkv_evict(evict)

    def _turnkv_drop_handshake(self, engine_id: str, seen: dict[int, str], offered: str) -> None:
        """Have upstream release its state for ``engine_id`` once reads drain, so the next read handshakes with
        the process serving there now (see the module docstring)."""
        fingerprints = boot.rank_fingerprints(offered)
        if all((engine_id, rank, fingerprints[rank]) in self._turnkv_met
               for rank in seen if rank < len(fingerprints)):
            return  # an offer of a process met before: the handshake is the newer one
        key = (engine_id, tuple(sorted(seen.items())))
        mark = getattr(self, "_mark_remote_engine_invalid", None)
        if key in self._turnkv_dropped or mark is None:
            return
        self._turnkv_dropped.add(key)
        try:
            mark(engine_id, time.perf_counter())
        except Exception:  # the read is refused anyway; only the recovery is lost
            logger.exception("turnkv: could not drop the handshake with %s", engine_id)

    def _cleanup_remote_engines(self) -> None:
        """Pull: drop the handshake with every engine a READ failed from, so the next read handshakes again.

        Upstream drops a failed engine only when NIXL's *local* copy of its metadata is gone. A peer that
        restarted under the same engine id and address keeps that copy, so every later READ from it failed
        (NIXL_ERR_REMOTE_DISCONNECT) and decode recomputed the whole prompt: 307 READs by one decode engine
        after a prefill restart in a 210 s fault run, each also leaving prefill's blocks pinned until their
        lease ran out. Upstream backs off repeated invalidations of one engine (reads fail fast meanwhile)."""
        failed = getattr(self, "_failed_remote_engines", None)
        mark = getattr(self, "_mark_remote_engine_invalid", None)
        if failed and mark is not None and getattr(self, "_TRANSFER_MODE", "pull") == "pull":
            invalid = getattr(self, "_invalid_remote_engines", set())
            now = time.perf_counter()
            for engine_id in sorted(failed - invalid):
                if engine_id in self._remote_agents:
                    logger.warning("turnkv: a READ from %s failed: handshaking with it again", engine_id)
                    mark(engine_id, now)
        super()._cleanup_remote_engines()  # type: ignore[misc]

    # retained turns evicted by the scheduler ---------------------------------------------------------

    def turnkv_evict(self, evict: dict[str, tuple[float, float]]) -> None:
        """Announce each evicted turn and cut its lease to ``grace`` seconds from now (upstream's reaper frees
        the blocks then). The announcement lasts as long as the offer could be read: its signed expiry, or the
        lease as renewed since, whichever is later."""
        held: dict[str, float] = getattr(self, "_reqs_to_send", {})
        mono, wall = time.perf_counter(), time.time()
        for request_id, (grace, expires_at) in evict.items():
            until = float(expires_at)
            if request_id in held:
                until = max(until, wall + (held[request_id] - mono))
                held[request_id] = min(held[request_id], mono + float(grace))
            self._turnkv_evict_seq += 1
            self._turnkv_evicted[request_id] = (self._turnkv_evict_seq, until)
        self._forget_evictions(wall)

    def _forget_evictions(self, wall: float) -> None:
        for request_id, (_, until) in list(self._turnkv_evicted.items()):
            if until < wall:
                del self._turnkv_evicted[request_id]

    def turnkv_evicted(self, request_id: str) -> bool:
        return request_id in self._turnkv_evicted

    def turnkv_evictions(self, since: int) -> dict[str, Any]:
        """The evictions feed of this worker: announcements after number ``since`` (``wire.EVICTIONS_ROUTE``)."""
        self._forget_evictions(time.time())
        events = [(seq, rid, until) for rid, (seq, until) in self._turnkv_evicted.items() if seq > since]
        events = events[:wire.EVICTIONS_MAX]
        seq = events[-1][0] if events else self._turnkv_evict_seq
        return {"epoch": self._turnkv_epoch, "seq": seq, "evicted": [[rid, until] for _, rid, until in events]}

    def _read_blocks_for_req(self, req_id: str, meta: Any) -> None:
        engine_id = meta.remote.engine_id
        if req_id in self._turnkv_expected and engine_id in self._remote_agents:
            expected = self._turnkv_expected.pop(req_id)
            current = self._turnkv_boots.get(engine_id)
            if not boot.same_boot(expected, current):
                logger.warning("turnkv: request %s: decode engine %s has restarted since it offered its KV "
                               "(boot %s, now %s); recomputing", req_id, engine_id, expected, current)
                self.xfer_stats.record("turnkv_stale_offers", 1)
                self._turnkv_drop_handshake(engine_id, current or {}, expected)
                compat.fail_read(self, req_id)
                return
        super()._read_blocks_for_req(req_id, meta)  # type: ignore[misc]
