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

import contextlib
import dataclasses
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from connector import boot, compat, fingerprint, host_ledger, host_pool_plan, host_tier, inline, seals
from connector.admission import ReadPlan
from connector.stats import TurnkvKVConnectorStats, counts_on_rank, rank_seconds
from turnkv import fabric_limits, neuron, platforms, wire

logger = logging.getLogger("vllm.turnkv.connector")


@dataclass
class TurnkvWorkerMeta(KVConnectorWorkerMetadata):
    """What one engine step's workers measured for the scheduler's cost model."""

    #: Numbers of the steps this output belongs to (``turnkv_step`` of the scheduler's metadata).
    steps: list[int] = field(default_factory=list)
    #: (bytes, seconds) of each finished NIXL READ this worker posted of a decode's device cache.
    reads: list[tuple[int, float]] = field(default_factory=list)
    #: (remote engine id, seconds) of each NIXL handshake this worker finished.
    handshakes: list[tuple[str, float]] = field(default_factory=list)
    #: Host tier: (rank, pool base address, pool slots), once per rank when its pool is registered.
    host_pools: list[tuple[int, int, int]] = field(default_factory=list)
    #: Host tier: (request id, read by prefill) of host-held turns this rank is done with (read or expired).
    host_released: list[tuple[str, bool]] = field(default_factory=list)
    #: Retained turns whose lease a router renewed (the scheduler counts them as wanted, not idle).
    renewed: list[str] = field(default_factory=list)
    #: Fork-readable turns read by prefill and kept for further readers (until the scheduler evicts them).
    fork_held: list[str] = field(default_factory=list)
    #: Host tier as granted at start, once per rank: (rank, configured bytes, granted bytes, why off or "").
    host_tier: list[tuple[int, int, int, str]] = field(default_factory=list)
    #: (bytes, seconds) of each finished NIXL READ of a decode's host tier (their own rate in the cost model).
    host_reads: list[tuple[int, float]] = field(default_factory=list)
    #: Inline readiness news of decode engines (``connector.inline``), in the order it happened on each rank:
    #: (engine, this rank, True) once the rank has handshaken an engine whose blocks land ready to use; (engine, this
    #: rank, False) once that handshake is dropped (a restart, a failed READ's invalidation, upstream's idle eviction).
    #: The scheduler reads a pull inline only from an engine every rank is ready for.
    inline_engines: list[tuple[str, int, bool]] = field(default_factory=list)
    #: KV seals (``connector.fingerprint``), once per rank at start: (rank, whether it digests its KV blocks).
    sealing: list[tuple[int, bool]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Tensor-parallel ranks: one step, every rank's reads and handshakes."""
        if isinstance(other, TurnkvWorkerMeta):
            self.steps = sorted({*self.steps, *other.steps})
            self.reads = [*self.reads, *other.reads]
            self.handshakes = [*self.handshakes, *other.handshakes]
            self.host_pools = [*self.host_pools, *other.host_pools]
            self.host_released = [*self.host_released, *other.host_released]
            self.renewed = sorted({*self.renewed, *other.renewed})
            self.fork_held = sorted({*self.fork_held, *other.fork_held})
            self.host_tier = [*self.host_tier, *other.host_tier]
            self.host_reads = [*self.host_reads, *other.host_reads]
            self.inline_engines = [*self.inline_engines, *other.inline_engines]  # per rank, each in its order
            self.sealing = [*self.sealing, *other.sealing]
        return self


class PerThreadCounts(dict):  # type: ignore[type-arg]
    """A per-engine dict upstream's NIXL worker reads to lay out descriptors (``dst_num_blocks``,
    ``dst_region_num_blocks``), where one thread may see an engine's value replaced for the length of a call and every
    other thread keeps seeing the shared one.

    A host-tier READ addresses decode's pool, laid out like its device cache but with the pool's slot count per region;
    upstream's ``_read_blocks`` takes the count from these dicts. Swapping the shared value for the READ (as turnkv did)
    let upstream's push writer thread, which reads the same dicts in ``_compute_desc_ids`` for its WRITEs into decode's
    device cache, compute a WRITE in that window with pool-sized regions: the KV landed in another layer or block of
    decode's cache. Upstream writes these dicts from several threads (handshakes, cleanup): the shared dict stays
    theirs; only reads on the overriding thread change."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._here = threading.local()

    def _overrides(self) -> dict[Any, Any]:
        return getattr(self._here, "values", None) or {}

    def __getitem__(self, key: Any) -> Any:
        overrides = self._overrides()
        return overrides[key] if key in overrides else super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        overrides = self._overrides()
        return overrides[key] if key in overrides else super().get(key, default)

    @contextlib.contextmanager
    def seen_here(self, key: Any, value: Any) -> Iterator[None]:
        """``value`` for ``key`` on this thread until the block ends (None: no override)."""
        before = getattr(self._here, "values", None)
        if value is not None:
            self._here.values = {**(before or {}), key: value}
        try:
            yield
        finally:
            self._here.values = before


def share_block_counts(worker: Any) -> None:
    """Make the worker's per-engine block counts :class:`PerThreadCounts` (at construction, before other threads)."""
    for name in ("dst_num_blocks", "dst_region_num_blocks"):
        current = getattr(worker, name, None)
        if isinstance(current, dict) and not isinstance(current, PerThreadCounts):
            setattr(worker, name, PerThreadCounts(current))


class TurnkvWorkerMixin:
    xfer_stats: Any
    _remote_agents: dict[str, Any]
    #: Whether this worker reads pulls inline (``connector.inline``): upstream's pull worker, whose receive path the
    #: wait follows. The push worker's prefill reads stay asynchronous.
    turnkv_reads_inline: bool = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        share_block_counts(self)  # before any READ; upstream's writer thread starts at register_kv_caches
        # turnkv's counters count as news: upstream's stats report a step only when it moved or lost KV.
        self.xfer_stats = TurnkvKVConnectorStats()
        # engine id -> {remote tensor-parallel rank: fingerprint of the agent handshaken there}
        self._turnkv_boots: dict[str, dict[int, str]] = {}
        # Prefill: each READ's plan from its admission record (connector.admission: deadline, decode's boot, host
        # pool, inline), from the step that hands it over until upstream reports the READ done or failed.
        self._turnkv_plans: dict[str, ReadPlan] = {}
        self._turnkv_dropped: set[tuple[str, tuple[tuple[int, str], ...]]] = set()  # handshakes dropped once
        self._turnkv_met: set[tuple[str, int, str]] = set()  # (engine, rank, fingerprint) ever handshaken with
        # Cost model samples, taken by build_turnkv_meta once per step (handshakes finish in a NIXL thread).
        self._turnkv_step: int | None = None
        self._turnkv_reads: list[tuple[int, float]] = []
        self._turnkv_host_read_samples: list[tuple[int, float]] = []
        self._turnkv_handshakes: list[tuple[str, float]] = []
        # Evictions announced (request id -> (announcement number, offer's wall expiry)), kept until the offer
        # expires; the epoch tells a router reading the feed that this process restarted (numbers start over).
        self._turnkv_evicted: dict[str, tuple[int, float]] = {}
        self._turnkv_evict_seq = 0
        self._turnkv_epoch = uuid.uuid4().hex[:12]
        # Host tier (connector.host_tier): this rank's pool; turns copied there (request id -> offer's wall expiry),
        # listed on the feed as "hosted"; device copies done this step (reported as sent: vLLM frees the device
        # blocks); host turns done with (read or expired) for the scheduler; prefill's host-tier reads.
        self._turnkv_pool: host_tier.HostPool | None = None
        self._turnkv_pool_reported = False
        self._turnkv_hosted: dict[str, float] = {}
        # Copies in flight (request id -> (copy, offer's wall expiry, bytes)); those upstream finished meanwhile.
        self._turnkv_copying: dict[str, tuple[host_tier.Copy, float, int]] = {}
        self._turnkv_copy_ended: set[str] = set()
        # Host tier as granted at start: (rank, configured bytes, granted bytes, why off), reported once.
        self._turnkv_host_tier: tuple[int, int, int, str] | None = None
        self._turnkv_host_tier_reported = False
        self._turnkv_device_done: set[str] = set()
        self._turnkv_host_released: list[tuple[str, bool]] = []
        self._turnkv_notified: set[str] = set()
        self._turnkv_renewed: list[str] = []
        self._turnkv_remote_meta: dict[tuple[str, int], Any] = {}
        self._turnkv_host_handles: dict[tuple[str, int, int, int], int] = {}
        # Forks: the read notifications of retained turns with a fork-readable offer, taken before upstream sees
        # them (the blocks stay until their lease, cut by the scheduler's eviction, runs out).
        self._turnkv_fork_reads = ForkReads()
        self._turnkv_notifs_filtered = False
        # Inline reads (connector.inline, ``ReadPlan.inline``) are finished before the step's forward; upstream's
        # completion report of them is filtered out (the scheduler never parked them). Engines to report.
        self._turnkv_inline_engines: list[tuple[str, int, bool]] = []
        # KV seals (connector.seals): this rank's digest sampler (set when the KV cache is registered; None: off),
        # whether that was reported, decode's seals of retained turns (on the feed), prefill's READs checked once,
        # the deployment's offer secret (seals are MACed with it), and the READ fault injected for tests (if any).
        self._turnkv_sampler: fingerprint.Sampler | None = None
        self._turnkv_sealing_reported = False
        self._turnkv_seals = seals.SealBook()
        self._turnkv_checked: set[str] = set()
        self._turnkv_secret = wire.offer_secret()
        self._turnkv_faulted: set[str] = set()  # READs misaddressed on purpose (connector.seals.fault)

    # transfer metrics ---------------------------------------------------------------------------

    def _pop_done_transfers(self, transfers: dict[str, list[int]]) -> Any:
        op = "write" if transfers is getattr(self, "_sending_transfers", None) else "read"
        plans = getattr(self, "_turnkv_plans", {})
        # Host-tier READs polled apart, so their telemetry is told from device reads (the cost model fits each).
        host = {r: transfers.pop(r) for r in list(transfers) if r in plans and plans[r].host is not None} \
            if op == "read" and plans else {}
        done = self._turnkv_pop(transfers, op, False)
        if host:
            try:
                done = _merged(done, self._turnkv_pop(host, op, True))
            finally:
                transfers.update(host)  # the ones still in flight
        if op == "read":
            finished, failed = done if isinstance(done, tuple) else (done, set())
            for request_id in finished - set(failed):
                self._turnkv_check_read(request_id)  # before the scheduler learns the READ is done
        return done

    def _turnkv_pop(self, transfers: dict[str, list[int]], op: str, host: bool) -> Any:
        data = self.xfer_stats.data
        before = len(data["bytes_transferred"])
        done = super()._pop_done_transfers(transfers)  # type: ignore[misc]
        moved = data["bytes_transferred"][before:]
        if moved:
            seconds = data["transfer_duration"][before:]
            self.xfer_stats.record(f"turnkv_{op}_bytes", sum(moved))
            self.xfer_stats.record(f"turnkv_{op}_seconds", rank_seconds(sum(seconds), self._turnkv_tp_size()))
            if op == "read":
                (self._turnkv_host_read_samples if host else self._turnkv_reads).extend(
                    zip(moved, seconds, strict=False))
        return done

    def _turnkv_tp_size(self) -> int:
        return max(1, int(getattr(self, "world_size", 1) or 1))

    def _turnkv_count(self, key: str) -> None:
        """One per-request count, recorded once per engine (``connector.stats``: vLLM sums the ranks' stats)."""
        if counts_on_rank(int(getattr(self, "tp_rank", 0) or 0)):
            self.xfer_stats.record(key, 1)

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
        released, self._turnkv_host_released = self._turnkv_host_released, []
        renewed, self._turnkv_renewed = self._turnkv_renewed, []
        fork_held = self._turnkv_fork_reads.drain()
        pools = []
        if self._turnkv_pool is not None and not self._turnkv_pool_reported:
            self._turnkv_pool_reported = True
            pools = [(int(getattr(self, "tp_rank", 0)), self._turnkv_pool.base, self._turnkv_pool.blocks)]
        granted = []
        if self._turnkv_host_tier is not None and not self._turnkv_host_tier_reported:
            self._turnkv_host_tier_reported = True
            granted = [self._turnkv_host_tier]
        host_reads, self._turnkv_host_read_samples = self._turnkv_host_read_samples, []
        inline_engines, self._turnkv_inline_engines = self._turnkv_inline_engines, []
        sealing = []
        if not self._turnkv_sealing_reported and getattr(self, "device_kv_caches", None):
            self._turnkv_sealing_reported = True
            sealing = [(self._turnkv_rank(), self._turnkv_sampler is not None)]
        if step is None and not reads and not handshakes and not released and not renewed and not pools \
                and not fork_held and not granted and not host_reads and not inline_engines and not sealing:
            return None
        return TurnkvWorkerMeta([step] if step is not None else [], reads, handshakes, pools, released, renewed,
                                fork_held, granted, host_reads, inline_engines, sealing)

    # host tier (connector.host_tier) -------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Any) -> None:
        try:
            super().register_kv_caches(kv_caches)  # type: ignore[misc]
        except Exception as exc:
            why = registration_refusal(self, exc)
            if why is None:
                raise
            logger.error(why)
            raise RuntimeError(why) from exc
        self._turnkv_sampler = seals.sampler_for(self)
        budget = int(_extra_config(self).get("host_kv_budget_mib") or 0)
        if budget <= 0:
            return
        tp = int(getattr(getattr(self.vllm_config, "parallel_config", None), "tensor_parallel_size", 1) or 1)
        configured = host_pool_plan.rank_share_bytes(budget, tp)
        why = self._turnkv_host_tier_unsupported()
        if why:
            self._turnkv_host_tier_off(budget, configured, why)
            return
        fitted = self._turnkv_fit_pool(configured)
        blocks = fitted.plan.blocks if fitted.plan is not None else 0
        agreed = host_tier.agree_blocks(blocks, tp)  # every rank's pool holds the same slots (one offer layout)
        if agreed < blocks:
            logger.warning("turnkv: host tier: rank %s holds %d slots, another rank only %d: shrinking to match",
                           getattr(self, "tp_rank", 0), blocks, agreed)
            self._turnkv_drop_pool()
            plan = fitted.plan
            fitted = self._turnkv_fit_pool(configured, host_pool_plan.shrunk(plan, agreed * plan.slot_bytes,
                                                                              self._turnkv_limits())) \
                if agreed > 0 and plan is not None else host_pool_plan.Fitted(None, fitted.refused)
        for plan, error in fitted.refused:
            logger.error("turnkv: host tier: the node refused %s: %s", host_pool_plan.describe(plan), error)
        if self._turnkv_pool is None:
            self._turnkv_host_tier_off(budget, configured, "no pool could be allocated, pinned and registered, "
                                       f"down to {host_pool_plan.size(host_pool_plan.MIN_POOL_BYTES)} a rank (see "
                                       "the refusals above)" if fitted.refused else "the plan holds no slot")
            return
        pool = self._turnkv_pool
        self._turnkv_host_tier = (int(getattr(self, "tp_rank", 0)), configured, pool.plan.pool_bytes, "")
        # The pool is in this agent's metadata only if the handshake payload is made again after registering it.
        import msgspec
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata

        payload = self.xfer_handshake_metadata
        agent = msgspec.msgpack.decode(payload.agent_metadata_bytes, type=NixlAgentMetadata)
        agent = dataclasses.replace(agent, agent_metadata=self.nixl_wrapper.get_agent_metadata())
        self.xfer_handshake_metadata = dataclasses.replace(
            payload, agent_metadata_bytes=msgspec.msgpack.Encoder().encode(agent))
        whole = pool.plan.pool_bytes + pool.plan.slot_bytes > configured  # the budget, in whole slots
        logger.log(logging.INFO if whole else logging.WARNING, "turnkv: host tier: %s; registered with NIXL at %#x%s",
                   host_pool_plan.describe(pool.plan, "pinned" if pool.cuda else "allocated"), pool.base,
                   "" if whole else f" (SHRUNK: {host_pool_plan.size(pool.plan.pool_bytes)} of the configured "
                                    f"{host_pool_plan.size(configured)}; vllm:turnkv_host_tier_granted_bytes)")

    def _turnkv_limits(self) -> Any:
        """The fabric limits a pool is planned within: EFA's where NIXL reads over LIBFABRIC on a CUDA node."""
        backends = [str(b).upper() for b in (getattr(self, "nixl_backends", None) or ())]
        return fabric_limits.EFA_P5EN if _caches_on_cuda(self) and "LIBFABRIC" in backends else fabric_limits.UNLIMITED

    def _turnkv_fit_pool(self, configured: int, plan: Any = None) -> Any:
        """Plan this rank's pool (NUMA node, page size, regions, the room the host's ledger leaves it), then allocate,
        pin and register the largest that the node takes (``host_pool_plan.fit``); the pool, if any, becomes
        ``self._turnkv_pool``, and its bytes this process's claim in the ledger (``connector.host_ledger``)."""
        limits = self._turnkv_limits()
        ledger = host_ledger.HostLedger()
        device = _cuda_device(self)
        layout = host_tier.numa_layout() if device is not None else host_tier.cpu_layout(self._turnkv_tp_size())
        if plan is None:
            node = layout.node_of(device or 0)
            page = host_pool_plan.page_size_for(host_tier.free_hugepages(node), configured) \
                if device is not None else fabric_limits.PAGE_4K
            planned: list[Any] = []

            def plan_in(room: int | None) -> int:
                nonlocal layout
                layout = dataclasses.replace(layout, room_bytes=room)
                planned.append(host_pool_plan.plan_rank(configured, self.block_len_per_layer, page, layout, limits,
                                                        rank=int(getattr(self, "tp_rank", 0)), device=device or 0))
                return planned[-1].allocated_bytes

            # Pools to come on this host: every GPU of it (an engine sees only its own), or a CPU engine's ranks.
            pools = max(len(layout.gpu_node), host_tier.host_gpu_count() if device is not None else 0)
            ledger.reserve(pools, sum(layout.node_bytes), host_tier.host_available_bytes(), plan_in)
            plan = planned[-1]

        def attempt(p: Any) -> None:
            self._turnkv_pool = host_tier.HostPool(self, p)
            self._registered_descs.extend(self._turnkv_pool.registered)

        fitted = host_pool_plan.fit(plan, attempt, limits, host_pool_plan.MIN_POOL_BYTES)
        if fitted.plan is None and plan.page_size != fabric_limits.PAGE_4K:
            # The node's hugepages ran out (ranks of a node take them at once): regular pages, planned anew.
            regular = host_pool_plan.plan_rank(configured, plan.block_lens, fabric_limits.PAGE_4K, layout, limits,
                                               rank=plan.rank, device=plan.device)
            again = host_pool_plan.fit(regular, attempt, limits, host_pool_plan.MIN_POOL_BYTES)
            fitted = host_pool_plan.Fitted(again.plan, fitted.refused + again.refused)
        ledger.settle(fitted.plan.allocated_bytes if fitted.plan is not None else 0)
        return fitted

    def _turnkv_drop_pool(self) -> None:
        pool, self._turnkv_pool = self._turnkv_pool, None
        if pool is None:
            return
        for descs in pool.registered:
            with contextlib.suppress(Exception):
                self.nixl_wrapper.deregister_memory(descs)
            with contextlib.suppress(ValueError):
                self._registered_descs.remove(descs)
        pool.close()
        host_ledger.HostLedger().settle(0)

    def _turnkv_host_tier_off(self, budget_mib: int, configured: int, why: str) -> None:
        """The engine serves without a host tier: said in the log (error), on /metrics (granted 0 of the configured
        budget: ``vllm:turnkv_host_tier_granted_bytes``), hence by ``turnkv doctor`` and the CloudWatch alarm."""
        logger.error("turnkv: HOST TIER OFF: host_kv_budget_mib=%d configured, 0 granted on rank %s: %s. The engine "
                     "serves without it (retained turns that do not fit retained_kv_share are not retained).",
                     budget_mib, getattr(self, "tp_rank", 0), why)
        self._turnkv_host_tier = (int(getattr(self, "tp_rank", 0)), configured, 0, why)

    def _turnkv_host_tier_unsupported(self) -> str | None:
        if not hasattr(self, "region_num_blocks"):
            return ("this vLLM's NIXL worker has no per-region KV layout (vLLM 0.29, the Neuron image's); the host "
                    "tier needs vLLM 0.32 (the GPU image's)")
        if getattr(self, "_has_mamba", False) or getattr(self, "_mixed_mem_types", False):
            return "hybrid (Mamba) or mixed-memory KV caches are not supported by the host tier"
        if getattr(self, "use_mla", False):
            # Every rank holds the same latent KV, so a pool per rank pins TP copies of it. Upstream reads MLA from one
            # remote rank per local rank because the cache is duplicated (vLLM 0.32 nixl/tp_mapping.py, lines 88-97:
            # attn_ranks = [tp_rank * remote_tp_size // tp_size]); one pool on rank 0 read by every prefill rank would
            # leave that mapping, so it is refused until built and verified.
            return ("MLA models are not supported by the host tier: every rank holds the same latent KV (TP copies "
                    "of each turn), and one pool shared through rank 0 is not built")
        if getattr(self, "_physical_blocks_per_logical_kv_block", 1) != 1:
            return (f"the attention kernel's block ({getattr(self, 'block_size', '?')} // "
                    f"{self._physical_blocks_per_logical_kv_block} tokens, e.g. FLASHMLA's 64) is smaller than vLLM's "
                    "--block-size: kernel blocks smaller than vLLM's blocks are not supported by the host tier")
        if getattr(self, "use_host_buffer", False):
            return "the KV cache is already staged through a host buffer"
        if len(set(getattr(self, "region_num_blocks", []) or [0])) != 1:
            return "regions with different block counts are not supported by the host tier"
        return None

    def _turnkv_copy_to_host(self, to_host: dict[str, tuple[list[int], list[int], float]]) -> None:
        """Start copying each turn placed on the host tier into its slots. A turn counts as hosted (listed on the
        feed, its device blocks reported sent) only once its copy is done (:meth:`_turnkv_finish_copies`): at once
        on CPU engines, when the side stream's event completes on CUDA."""
        for request_id, (blocks, slots, until) in to_host.items():
            if self._turnkv_pool is None or request_id not in getattr(self, "_reqs_to_send", {}):
                # Never copied, so never listed as hosted: no router clears its offer. Its slots go back.
                self._turnkv_device_done.add(request_id)
                self._turnkv_host_released.append((request_id, False))
                continue
            try:
                copy = self._turnkv_pool.copy_in(blocks, slots)
            except Exception:
                logger.exception("turnkv: could not copy request %s to the host tier; not retained", request_id)
                self._reqs_to_send.pop(request_id, None)
                self._reqs_to_process.discard(request_id)
                self._turnkv_device_done.add(request_id)
                self._turnkv_host_released.append((request_id, False))
                continue
            self._turnkv_copying[request_id] = (copy, until, len(slots) * sum(self._turnkv_pool.block_lens))
        self._turnkv_finish_copies()

    def _turnkv_finish_copies(self) -> None:
        """Turns whose copy is done: hosted, and their device blocks reported sent (vLLM frees them). A turn upstream
        finished meanwhile (its lease ran out during the copy) gets its slots back instead."""
        for request_id, (copy, until, nbytes) in list(self._turnkv_copying.items()):
            if not copy.done():
                continue
            del self._turnkv_copying[request_id]
            self._turnkv_device_done.add(request_id)
            if request_id in self._turnkv_copy_ended:
                self._turnkv_copy_ended.discard(request_id)
                self._turnkv_host_released.append((request_id, False))
                continue
            self._turnkv_hosted[request_id] = until
            self._turnkv_count("turnkv_host_moves")
            self.xfer_stats.record("turnkv_host_move_bytes", nbytes)

    #: Pull: this (the engine) thread is the only one that takes NIXL notifications, so the fork-readable turns'
    #: are filtered from the agent's; push (``connector.push_worker``) filters them off its writer's hand-over queue.
    _turnkv_filters_nixl_notifs = True

    def _get_new_notifs(self) -> set[str]:
        if self._turnkv_filters_nixl_notifs and not self._turnkv_notifs_filtered and hasattr(self, "nixl_wrapper"):
            self._turnkv_notifs_filtered = True
            self.nixl_wrapper.get_new_notifs = self._turnkv_fork_reads.filtering(self.nixl_wrapper.get_new_notifs)
        notified = super()._get_new_notifs()  # type: ignore[misc]
        self._turnkv_notified.update(r for r in notified if r in self._turnkv_hosted)
        return notified

    def get_transfer_results(self) -> Any:
        """Host-tier turns: their device blocks are reported sent once copied, and upstream's later report (read or
        expired) is the pool's, not vLLM's: those slots go back to the scheduler's ledger instead."""
        results = super().get_transfer_results()  # type: ignore[misc]
        sending = set(results.finished_sending)
        self._turnkv_finish_copies()
        for request_id in [r for r in sending if r in self._turnkv_copying]:
            sending.discard(request_id)  # its device blocks are still being copied from: freed once done
            self._turnkv_copy_ended.add(request_id)
        for request_id in [r for r in sending if r in self._turnkv_hosted]:
            del self._turnkv_hosted[request_id]
            read = request_id in self._turnkv_notified
            self._turnkv_notified.discard(request_id)
            self._turnkv_host_released.append((request_id, read))
            sending.discard(request_id)
        sending |= self._turnkv_device_done
        self._turnkv_device_done = set()
        self._turnkv_fork_reads.forget(sending)
        # Freed turns' seals (a host-tier turn's device blocks are reported sent once copied: its seal stays).
        self._turnkv_seals.forget(time.time(), [*(r for r in sending if r not in self._turnkv_hosted),
                                                *(r for r, _ in self._turnkv_host_released)])
        # Inline reads were computed in the step they were read in: the scheduler never parked them, and a request
        # it did not park must not be reported received (it asserts). A failed one reported its blocks instead
        # (invalid_block_ids): the scheduler recomputes them.
        ended = set(results.finished_recving) | set(getattr(results, "failed_recving", None) or ())
        done_inline = {r for r in ended if r in self._turnkv_plans and self._turnkv_plans[r].inline}
        for request_id in ended:
            self._turnkv_plans.pop(request_id, None)  # the one place a READ's plan is forgotten
            self._turnkv_checked.discard(request_id)
            self._turnkv_faulted.discard(request_id)
        if done_inline:
            return dataclasses.replace(
                results, finished_sending=sending, finished_recving=set(results.finished_recving) - done_inline,
                failed_recving=set(getattr(results, "failed_recving", None) or ()) - done_inline)
        return dataclasses.replace(results, finished_sending=sending)

    def _read_blocks(self, read_spec: Any, dst_engine_id: str, request_id: str, *args: Any, **kwargs: Any) -> Any:
        """A host-tier offer: the same READ, against decode's pool (slot ids in place of block ids)."""
        plan = self._turnkv_plans.get(request_id)
        host = plan.host if plan is not None else None
        if host is None:
            return super()._read_blocks(read_spec, dst_engine_id, request_id, *args, **kwargs)  # type: ignore[misc]
        bases, blocks = host
        rank = int(read_spec.remote_rank)
        handle = self._turnkv_host_handle(dst_engine_id, rank, bases[rank] if rank < len(bases) else 0, blocks)
        if handle is None:
            compat.fail_read(self, request_id)
            return False
        if args:
            args = (*args[:3], handle, *args[4:])  # remote_request_id, local handle, local dram handle, REMOTE
        else:
            kwargs["remote_xfer_side_handle"] = handle
        # The pool's slot counts, seen by this thread alone: upstream's push writer thread reads the same per-engine
        # counts for its WRITEs into decode's device cache meanwhile (``PerThreadCounts``).
        counts, regions = self.dst_num_blocks, self.dst_region_num_blocks
        if not isinstance(counts, PerThreadCounts) or not isinstance(regions, PerThreadCounts):
            raise RuntimeError("turnkv: the per-engine block counts are not per-thread views; see share_block_counts")
        region_count = len(regions.get(dst_engine_id) or ())
        with counts.seen_here(dst_engine_id, blocks), \
                regions.seen_here(dst_engine_id, [blocks] * region_count if region_count else None):
            return super()._read_blocks(read_spec, dst_engine_id, request_id, *args, **kwargs)  # type: ignore[misc]

    def _turnkv_host_handle(self, engine_id: str, rank: int, base: int, blocks: int) -> int | None:
        """Prepared descriptors of decode rank ``rank``'s pool, laid out like its device cache (cached)."""
        key = (engine_id, rank, base, blocks)
        if key in self._turnkv_host_handles:
            return self._turnkv_host_handles[key]
        meta = self._turnkv_remote_meta.get((engine_id, rank))
        agent = self._remote_agents.get(engine_id, {}).get((0, rank)) if meta is not None else None
        if meta is None or agent is None or base <= 0:
            logger.warning("turnkv: no handshake with rank %d of %s for a host-tier read; recomputing", rank,
                           engine_id)
            return None
        try:
            plan = self.tp_mappings[engine_id]
            ratio = self.transfer_topo.block_size_ratio(meta.block_size)
            pool = host_tier.remote_pool_meta(meta, base, blocks)
            descs = self.nixl_wrapper.get_xfer_descs(self._build_fa_remote(plan, pool, ratio), "DRAM")
            handle = self.nixl_wrapper.prep_xfer_dlist(agent, descs)
        except Exception:
            logger.exception("turnkv: could not prepare a host-tier read from %s; recomputing", engine_id)
            return None
        for old in [k for k in self._turnkv_host_handles if k[:2] == (engine_id, rank)]:
            with contextlib.suppress(Exception):
                self.nixl_wrapper.release_dlist_handle(self._turnkv_host_handles.pop(old))
        self._turnkv_host_handles[key] = handle
        return handle

    # decode boot check ---------------------------------------------------------------------------

    def add_remote_agent(self, nixl_agent_meta: Any, remote_tp_rank: int = 0, *args: Any, **kwargs: Any) -> str:
        # Before upstream's handshake bookkeeping: a refused peer fails the handshake, its requests recompute.
        why = platforms.block_size_refusal(getattr(self, "block_size", None),
                                           getattr(nixl_agent_meta, "block_size", None),
                                           str(nixl_agent_meta.engine_id), os.environ)
        if why:
            logger.error(why)
            raise RuntimeError(why)
        name = super().add_remote_agent(nixl_agent_meta, remote_tp_rank, *args, **kwargs)  # type: ignore[misc]
        self._turnkv_remote_meta[(nixl_agent_meta.engine_id, int(remote_tp_rank))] = nixl_agent_meta
        if self._turnkv_reads_inline(nixl_agent_meta):
            self._turnkv_inline_engines.append((str(nixl_agent_meta.engine_id), self._turnkv_rank(), True))
        for key in [k for k in self._turnkv_host_handles if k[:2] == (nixl_agent_meta.engine_id, remote_tp_rank)]:
            del self._turnkv_host_handles[key]  # a new process: its pool is elsewhere (NIXL dropped the old agent)
        # Every rank this worker reads from (with TP > 1, rank i reads decode's rank i, not rank 0).
        ranks = self._turnkv_boots.setdefault(nixl_agent_meta.engine_id, {})
        ranks[int(remote_tp_rank)] = boot.fingerprint(nixl_agent_meta.agent_metadata)
        self._turnkv_met.add((nixl_agent_meta.engine_id, int(remote_tp_rank), ranks[int(remote_tp_rank)]))
        return name

    def start_load_kv(self, metadata: Any) -> None:
        plans: dict[str, ReadPlan] = getattr(metadata, "turnkv_reads", None) or {}
        self._turnkv_plans.update(plans)
        self._turnkv_step = getattr(metadata, "turnkv_step", None)
        super().start_load_kv(metadata)  # type: ignore[misc]
        reads_inline = {rid for rid, plan in plans.items() if plan.inline}
        if reads_inline:
            self._turnkv_wait_inline(reads_inline)
            for request_id in reads_inline:  # before this step's forward computes with them
                if request_id not in self._recv_failures and not self._turnkv_inline_in_flight(request_id):  # type: ignore[attr-defined]
                    self._turnkv_check_read(request_id)
        self._turnkv_fork_reads.forkable.update(getattr(metadata, "turnkv_forkable", None) or ())
        to_seal = getattr(metadata, "turnkv_seal", None)
        if to_seal:
            self._turnkv_seal(to_seal)  # before the host copies: the digests are of the device blocks' bytes
        to_host = getattr(metadata, "turnkv_to_host", None)
        if to_host:
            self._turnkv_copy_to_host(to_host)
        evict = getattr(metadata, "turnkv_evict", None)
        if evict:
            self.turnkv_evict(evict)

    # inline reads (connector.inline) ----------------------------------------------------------------

    def _turnkv_reads_inline(self, remote: Any) -> bool:
        """Whether a READ from ``remote`` (its handshake metadata) needs no conversion after it lands: upstream
        converts after the step's forward, too late for a read that step computes with."""
        if not (self.turnkv_reads_inline and compat.reads_inline()):
            return False
        converts = bool(getattr(self, "use_host_buffer", False) or getattr(self, "enable_permute_local_kv", False)
                        or getattr(self, "enable_heterogeneous_attn_post_process", False))
        return inline.same_layout(
            int(getattr(self, "block_size", 0) or 0), int(getattr(remote, "block_size", -1) or -1),
            getattr(self, "kv_cache_layout", None), getattr(remote, "kv_cache_layout", None),
            int(getattr(self, "_physical_blocks_per_logical_kv_block", 1) or 1),
            int(getattr(remote, "physical_blocks_per_logical_kv_block", 1) or 1), converts)

    def _turnkv_rank(self) -> int:
        return int(getattr(self, "tp_rank", 0) or 0)

    def _turnkv_inline_lost(self, engine_id: str) -> None:
        """This rank's handshake with ``engine_id`` is gone or about to be: no pull from it is read inline until
        every rank has handshaken it again (the first READ after a re-handshake waits for it: asynchronous)."""
        self._turnkv_inline_engines.append((str(engine_id), self._turnkv_rank(), False))

    def _mark_remote_engine_invalid(self, engine_id: str, now: float) -> None:
        # A READ from it failed and its NIXL metadata is gone: reads of it fail fast until it is handshaken again.
        self._turnkv_inline_lost(engine_id)
        super()._mark_remote_engine_invalid(engine_id, now)  # type: ignore[misc]

    def _cleanup_remote_engine(self, engine_id: str, *args: Any, **kwargs: Any) -> None:
        # Every way upstream lets go of a peer (idle TTL eviction, a replaced or invalid peer, shutdown).
        self._turnkv_inline_lost(engine_id)
        super()._cleanup_remote_engine(engine_id, *args, **kwargs)  # type: ignore[misc]

    def _turnkv_wait_inline(self, request_ids: set[str]) -> None:
        """Hold the step until the inline READs of ``request_ids`` are done (or failed: upstream then reports their
        blocks as not loaded and the scheduler recomputes them). Reads whose handshake finishes meanwhile are posted
        here: upstream posts them only at its next ``start_load_kv``, a step too late."""
        started = time.perf_counter()
        while True:
            ready = getattr(self, "_ready_requests", None)
            while ready is not None and not ready.empty():
                self._read_blocks_for_req(*ready.get_nowait())
            waiting = [r for r in request_ids if self._turnkv_inline_in_flight(r)]
            if not waiting:
                return
            if time.perf_counter() - started > inline.WAIT_LIMIT_S:
                logger.error("turnkv: inline READs of %s not done after %.0f s; recomputing them", waiting,
                             inline.WAIT_LIMIT_S)
                still = [r for r in waiting if not self._turnkv_abort_inline(r)]
                if not still:
                    return
                # A READ NIXL would not release may still write into the blocks: the step (and the scheduler's
                # recompute into those blocks) waits for it, as upstream retains a handle it cannot release.
                logger.error("turnkv: NIXL would not release the inline READs of %s: the step waits for them", still)
                request_ids, started = set(still), time.perf_counter()
            time.sleep(inline.POLL_S)

    def _turnkv_inline_in_flight(self, request_id: str) -> bool:
        if request_id not in self._recving_metadata:  # type: ignore[attr-defined]
            return False  # reported already (a read of nothing) or dropped
        if request_id in self._recv_failures:  # type: ignore[attr-defined]
            return False  # failed before or while posting: reported with its blocks after the forward
        handles = self._recving_transfers.get(request_id)  # type: ignore[attr-defined]
        if handles is None:
            return True  # not posted yet: its handshake is still running
        for handle in handles:
            try:
                if self.nixl_wrapper.check_xfer_state(handle) == "PROC":  # type: ignore[attr-defined]
                    return True
            except Exception:  # upstream's poll after the forward sees it too and reports the failure
                return False
        return False

    def _turnkv_abort_inline(self, request_id: str) -> bool:
        """End an inline READ past the wait limit: its handles released (NIXL stops the transfer), then failed, so
        upstream reports its blocks not loaded once, after the step's forward, and the scheduler recomputes them.
        False when a handle could not be released: the READ may still write into the blocks.

        Reporting the blocks at once and leaving the handle in flight (as before) let the READ land later in blocks
        the scheduler had recomputed, or given to another request, and upstream reported them failed a second
        time when NIXL ended it (issue 50)."""
        if request_id in self._recving_transfers:  # type: ignore[attr-defined]
            handles = self._recving_transfers[request_id]  # type: ignore[attr-defined]
            kept = [h for h in handles if not self._try_release_xfer_handle(request_id, h)]  # type: ignore[attr-defined]
            if kept:
                self._recving_transfers[request_id] = kept  # type: ignore[attr-defined]
                return False
            del self._recving_transfers[request_id]  # type: ignore[attr-defined]
        compat.fail_read(self, request_id)  # reported failed with its blocks by upstream's next poll
        return True

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
        self._turnkv_inline_lost(engine_id)
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
        self._turnkv_seals.forget(wall, self._turnkv_evicted)

    def turnkv_evicted(self, request_id: str) -> bool:
        return request_id in self._turnkv_evicted

    def turnkv_own_boot(self, stamp: str | None) -> bool:
        """Whether decode's boot stamp (an offer's, ``connector.boot``) names this rank's NIXL agent, i.e. this
        process; an offer without a stamp (this engine could not fingerprint its agents) is taken as this one's."""
        if stamp is None:
            return True
        if not isinstance(stamp, str):
            return False
        mine = self._turnkv_own_fingerprint()
        fingerprints = boot.rank_fingerprints(stamp)
        rank = int(getattr(self, "tp_rank", 0) or 0)
        return mine is not None and rank < len(fingerprints) and fingerprints[rank] == mine

    def _turnkv_own_fingerprint(self) -> str | None:
        """This rank's agent fingerprint, as the scheduler stamps it (from the handshake payload it serves)."""
        payload = getattr(self, "xfer_handshake_metadata", None)
        if payload is None:
            return None
        cached = getattr(self, "_turnkv_fingerprint_of", None)
        if cached is not None and cached[0] is payload:
            return cached[1]
        import msgspec
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata

        try:
            agent = msgspec.msgpack.decode(payload.agent_metadata_bytes, type=NixlAgentMetadata)
        except Exception:
            logger.exception("turnkv: could not fingerprint this rank's NIXL agent")
            return None
        self._turnkv_fingerprint_of = (payload, boot.fingerprint(agent.agent_metadata))
        return self._turnkv_fingerprint_of[1]

    def turnkv_renewed(self, request_ids: list[str]) -> None:
        """Leases a router renewed (``connector.leases``): reported to the scheduler, which keeps them off the idle
        list."""
        self._turnkv_renewed.extend(request_ids)
        held: dict[str, float] = getattr(self, "_reqs_to_send", {})
        mono, wall = time.perf_counter(), time.time()
        for request_id in request_ids:  # listed again with the lease's new expiry: routers keep the seal as long
            if request_id in held and self._turnkv_seals.renew(request_id, self._turnkv_evict_seq + 1,
                                                               wall + held[request_id] - mono):
                self._turnkv_evict_seq += 1

    def turnkv_evictions(self, since: int) -> dict[str, Any]:
        """The evictions feed of this worker: announcements after number ``since`` (``wire.EVICTIONS_ROUTE``), and
        every turn whose host-tier copy is done and still held (``hosted``; a router clears a host-tier offer only
        once it is listed)."""
        self._forget_evictions(time.time())
        events: list[tuple[int, str, Any]] = [(seq, rid, until) for rid, (seq, until) in self._turnkv_evicted.items()
                                              if seq > since]
        events = sorted([*events, *self._turnkv_seals.since(since)], key=lambda e: e[0])[:wire.EVICTIONS_MAX]
        seq = events[-1][0] if events else self._turnkv_evict_seq
        hosted = [[rid, until] for rid, until in self._turnkv_hosted.items() if rid not in self._turnkv_evicted]
        rank = self._turnkv_rank()
        return {"epoch": self._turnkv_epoch, "seq": seq,
                "evicted": [[rid, e] for _, rid, e in events if not isinstance(e, seals.Seal)],
                "hosted": hosted[:wire.EVICTIONS_MAX], "seals": self._turnkv_sampler is not None,
                "sealed": [[rid, rank, e.digests, e.mac, e.until] for _, rid, e in events if isinstance(e, seals.Seal)]}

    def _turnkv_seal(self, to_seal: dict[str, tuple[list[int], str, float]]) -> None:
        """Decode: digest each retained turn's blocks (its offer says SEALED) and list the seal on the feed."""
        sampler, secret, rank = self._turnkv_sampler, self._turnkv_secret, self._turnkv_rank()
        if sampler is None or secret is None:
            # The scheduler seals only when every rank said it can: a rank that cannot leaves the offer unread.
            logger.warning("turnkv: cannot seal %d retained turns (%s)", len(to_seal),
                           "no offer secret" if sampler is not None else "KV seals off on this rank")
            return
        for request_id, (blocks, identity, until) in to_seal.items():
            try:
                digests = fingerprint.encode(sampler.digests(blocks))
            except Exception:  # no seal: prefill refuses the offer (unsealed) and recomputes
                logger.exception("turnkv: could not digest the KV blocks of request %s", request_id)
                continue
            self._turnkv_evict_seq += 1
            self._turnkv_seals.add(request_id, seals.Seal(self._turnkv_evict_seq, digests,
                                                          wire.seal_mac(secret, identity, rank, digests), until))

    def _turnkv_check_read(self, request_id: str) -> None:
        """Prefill: check the blocks a finished READ brought, once, before any forward uses them: all of them when
        the READ ended after decode may have freed them (``ReadPlan.safe_until``), and, for a sealed offer, those
        whose bytes differ from decode's digests. They are reported not loaded (``invalid_block_ids``): vLLM's
        scheduler recomputes them and never caches their hashes."""
        plan = self._turnkv_plans.get(request_id)
        if plan is None or request_id in self._turnkv_checked:
            return
        meta = self._recving_metadata.get(request_id)  # type: ignore[attr-defined]
        if meta is None:
            return
        self._turnkv_checked.add(request_id)
        local = list((getattr(meta, "local_block_ids", None) or [[]])[0])
        if not local:
            return
        if plan.safe_until is not None and time.time() >= plan.safe_until:
            # Started in time, ended late: decode frees a turn from safe_until on, whatever READ is in flight.
            self._turnkv_count("turnkv_reads_outlived")
            self._invalid_block_ids.put(set(local))  # type: ignore[attr-defined]
            logger.error("turnkv: request %s: the READ from %s ended %.1f s after decode may have freed its blocks; "
                         "recomputing them", request_id, meta.remote.engine_id, time.time() - plan.safe_until)
            return
        if plan.seal is None:
            return
        if seals.fault() == "layer":
            seals.swap_layers(self.device_kv_caches, int(self.num_blocks), local[0])  # type: ignore[attr-defined]
        why = seals.unverifiable(self, plan, meta, self._turnkv_sampler)
        if why:
            self.xfer_stats.record_label("turnkv_fingerprint_checks", "unverifiable")
            logger.warning("turnkv: request %s: the READ's blocks are not compared with decode's seal: %s", request_id,
                           why)
            return
        assert self._turnkv_sampler is not None
        bad = fingerprint.mismatched(plan.seal[self._turnkv_rank()], self._turnkv_sampler.digests(local), local)
        if not bad:
            self.xfer_stats.record_label("turnkv_fingerprint_checks", "ok")
            return
        path = "host" if plan.host is not None else ("inline" if plan.inline else "device")
        self.xfer_stats.record_label("turnkv_fingerprint_checks", "mismatch")
        for _ in bad:
            self.xfer_stats.record_label("turnkv_fingerprint_mismatches", path)
        self._invalid_block_ids.put(set(bad))  # type: ignore[attr-defined]
        logger.error("turnkv: request %s: %d of %d KV blocks READ from %s (%s) differ from decode's seal: recomputing "
                     "them", request_id, len(bad), len(local), meta.remote.engine_id, path)

    def _read_blocks_for_req(self, req_id: str, meta: Any) -> None:
        engine_id = meta.remote.engine_id
        if req_id in self._turnkv_plans and req_id not in self._turnkv_faulted and seals.fault() is not None:
            self._turnkv_faulted.add(req_id)  # once: called again when a handshake finishes
            if seals.inject_before_read(self, req_id, meta, self._turnkv_plans[req_id]):
                return
        plan = self._turnkv_plans.get(req_id)
        deadline = plan.deadline if plan is not None else None
        if deadline is not None and time.time() >= deadline:
            # Checked right before every READ (called again once a handshake finishes): decode may have freed the
            # blocks (an eviction's grace, a fork window's end) and given them to another request since.
            logger.warning("turnkv: request %s: the READ from %s would start %.1f s after its deadline; recomputing",
                           req_id, engine_id, time.time() - deadline)
            self._turnkv_count("turnkv_offers_late")
            compat.fail_read(self, req_id)
            return
        if plan is not None and plan.boot is not None and engine_id in self._remote_agents:
            expected = plan.boot
            current = self._turnkv_boots.get(engine_id)
            if not boot.same_boot(expected, current):
                logger.warning("turnkv: request %s: decode engine %s has restarted since it offered its KV "
                               "(boot %s, now %s); recomputing", req_id, engine_id, expected, current)
                self._turnkv_count("turnkv_stale_offers")
                self._turnkv_drop_handshake(engine_id, current or {}, expected)
                compat.fail_read(self, req_id)
                return
        super()._read_blocks_for_req(req_id, meta)  # type: ignore[misc]


class ForkReads:
    """Read-completion notifications (``"{request}:{readers}"``) of fork-readable retained turns, taken before
    upstream counts them: upstream frees a turn's blocks once its readers have all notified, and a second fork's
    notification would then name a request it no longer knows. Taken here, the turn stays leased (its blocks kept
    until the lease, cut to the grace by the scheduler's eviction once the fork window passed, runs out) and each
    completed read is reported to the scheduler once per ``readers`` notifications (pure)."""

    def __init__(self) -> None:
        self.forkable: set[str] = set()
        self._counts: dict[str, int] = {}
        self._completed: list[str] = []

    def take(self, msg: bytes) -> bool:
        """True when ``msg`` is a fork-readable turn's read notification (kept from upstream)."""
        try:
            text = msg.decode()
            request_id, readers = text.rsplit(":", 1)
            expected = max(1, int(readers))
        except (UnicodeDecodeError, ValueError, AttributeError):
            return False
        if text.startswith("HB:") or request_id not in self.forkable:
            return False
        count = self._counts.get(request_id, 0) + 1
        if count >= expected:  # every reading rank of one reader (or of concurrent readers, interleaved)
            self._counts.pop(request_id, None)
            self._completed.append(request_id)
        else:
            self._counts[request_id] = count
        return True

    def filtering(self, get_new_notifs: Callable[[], dict[str, list[bytes]]]) -> Callable[[], dict[str, list[bytes]]]:
        """``nixl_agent.get_new_notifs`` without the notifications :meth:`take` keeps."""

        def filtered() -> dict[str, list[bytes]]:
            return {agent: [m for m in msgs if not self.take(m)] for agent, msgs in get_new_notifs().items()}

        return filtered

    def drain(self) -> list[str]:
        """Turns read since the last call, each once."""
        done, self._completed = sorted(set(self._completed)), []
        return done

    def forget(self, request_ids: set[str]) -> None:
        """Freed turns (their lease ran out)."""
        self.forkable.difference_update(request_ids)
        for request_id in request_ids:
            self._counts.pop(request_id, None)


def registration_refusal(worker: Any, exc: BaseException) -> str | None:
    """What to say when NIXL refuses a Neuron engine's KV cache at start (None: not that case). NIXL's own error
    ("NIXL_ERR_BACKEND") does not say that its LIBFABRIC plugin offers Neuron HBM only under a Neuron runtime."""
    if not type(exc).__module__.startswith("nixl") or compat.current_platform_name() != "neuron":
        return None
    backends = ", ".join(str(b) for b in getattr(worker, "nixl_backends", None) or ()) or "NIXL's default"
    return (f"turnkv: NIXL refused to register this engine's KV cache as {getattr(worker, 'nixl_memory_type', '?')} "
            f"on {backends}: {exc}. {neuron.DEVICE_MEMORY_FIX}.")


def _extra_config(worker: Any) -> dict[str, Any]:
    config = getattr(getattr(worker, "vllm_config", None), "kv_transfer_config", None)
    return dict(getattr(config, "kv_connector_extra_config", None) or {})


def _caches_on_cuda(worker: Any) -> bool:
    caches = getattr(worker, "device_kv_caches", None) or {}
    return any(getattr(getattr(t, "device", None), "type", "") == "cuda" for t in caches.values())


def _cuda_device(worker: Any) -> int | None:
    """The CUDA device index of the worker's KV cache; None on CPU engines."""
    for cache in (getattr(worker, "device_kv_caches", None) or {}).values():
        device = getattr(cache, "device", None)
        if getattr(device, "type", "") == "cuda":
            return int(device.index or 0)
    return None


def _merged(a: Any, b: Any) -> Any:
    """Two results of upstream's ``_pop_done_transfers``: (done, failed) sets on vLLM 0.32, a done set on 0.29."""
    if isinstance(a, tuple):
        return tuple(x | y for x, y in zip(a, b, strict=True))
    return a | b
