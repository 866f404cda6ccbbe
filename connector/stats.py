"""turnkv's connector counters, carried on vLLM's KV-connector stats path to the engine's /metrics.

Worker-side stats are per tensor-parallel rank, and vLLM sums every rank's into the engine's (its output
aggregator concatenates the increments). So, on the worker side (``connector.worker``):

- a count per request (``turnkv_stale_offers``, ``turnkv_host_moves``), which every rank sees, is recorded by rank 0
  only (:func:`counts_on_rank`): once per request, not TP times;
- bytes (``turnkv_{read,write}_bytes``, ``turnkv_host_move_bytes``) are each rank's share, summed: the engine's total;
- transfer seconds (``turnkv_{read,write}_seconds``): the ranks transfer at the same time, so each records its own
  seconds over the TP size (:func:`rank_seconds`) and the sum is the mean over ranks of their transfer time.
  ``turnkv_read_bytes / turnkv_read_seconds`` is then the engine's bandwidth (all ranks together), not TP times less.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats, NixlPromMetrics
from vllm.v1.metrics.utils import create_metric_per_engine

from connector.policy import REASONS
from turnkv import metric_names as mn


def counts_on_rank(tp_rank: int) -> bool:
    """Whether this rank records per-request counts (rank 0: vLLM sums the ranks' stats)."""
    return int(tp_rank) == 0


def rank_seconds(seconds: float, tp_size: int) -> float:
    """This rank's part of the engine's transfer seconds: summed over ranks, the mean rank's transfer time."""
    return float(seconds) / max(1, int(tp_size))


#: stats key -> (Prometheus counter name, help). Every value is a list of increments (vLLM's convention).
COUNTERS: dict[str, tuple[str, str]] = {
    "turnkv_proof_offered_tokens": (
        "vllm:turnkv_proof_offered_tokens", "Tokens decode offered for a bi-directional pull (prefill side)."),
    "turnkv_proof_verified_tokens": (
        "vllm:turnkv_proof_verified_tokens", "Offered tokens whose token-id digests matched the prompt (pulled)."),
    "turnkv_proof_rejected_tokens": (
        "vllm:turnkv_proof_rejected_tokens", "Offered tokens not pulled because their digests did not match."),
    "turnkv_proof_mismatches": (
        "vllm:turnkv_proof_mismatches", "Pulls cut short by a token-id digest mismatch."),
    "turnkv_proof_missing": (
        "vllm:turnkv_proof_missing", "Offers without a valid token proof (nothing pulled)."),
    "turnkv_stale_offers": (
        "vllm:turnkv_stale_offers", "Offers from a decode engine that restarted since (not read; recomputed)."),
    "turnkv_offers_unsigned": (
        "vllm:turnkv_offers_unsigned", "Offers without a signature (not read; recomputed)."),
    "turnkv_offers_forged": (
        "vllm:turnkv_offers_forged", "Offers whose signature did not verify: edited, foreign or another model."),
    "turnkv_offers_expired": (
        "vllm:turnkv_offers_expired", "Offers past their wall-clock expiry minus expiry_skew_margin (not read)."),
    "turnkv_offers_replayed": (
        "vllm:turnkv_offers_replayed", "Offers this prefill engine had already read once (not read again)."),
    "turnkv_offers_uncleared": (
        "vllm:turnkv_offers_uncleared", "Offers no router cleared (sent straight to prefill; not read)."),
    "turnkv_offers_late": (
        "vllm:turnkv_offers_late", "Offers replayed by a router whose read-by instant had passed (not read)."),
    "turnkv_reads_outlived": (
        "vllm:turnkv_reads_outlived", "READs that ended after decode may have freed their blocks (the read-by deadline "
                                      "plus expiry_skew_margin): their blocks recomputed."),
    "turnkv_offers_unsealed": (
        "vllm:turnkv_offers_unsealed", "Offers decode sealed that came without a valid seal (the feed had not listed "
                                       "it, or it was edited): not read, recomputed."),
    "turnkv_host_tier_rank_mismatches": (
        "vllm:turnkv_host_tier_rank_mismatches", "Host tiers turned off on every rank because the ranks' pools "
                                                 "differ in slots, or a rank has none (decode side; logged)."),
    "turnkv_retention_refused": (
        "vllm:turnkv_retention_refused", "Finished turns decode did not retain: larger than retained_kv_share."),
    "turnkv_retention_evicted": (
        "vllm:turnkv_retention_evicted", "Retained turns decode evicted, oldest first, to stay under "
                                         "retained_kv_share (announced, freed after retention_eviction_grace)."),
    "turnkv_fork_holds": (
        mn.VLLM_FORK_HOLDS, "Retained turns read once and kept readable for forks of the same history "
                                  "(fork_window; decode side)."),
    "turnkv_read_bytes": (
        "vllm:turnkv_read_bytes", "KV bytes this engine READ from a peer (NIXL READs it posted: pulls)."),
    "turnkv_read_seconds": (
        "vllm:turnkv_read_seconds", "Time spent in the NIXL READs this engine posted (sum over transfers; mean over "
                                    "tensor-parallel ranks, which read at the same time)."),
    "turnkv_write_bytes": (
        "vllm:turnkv_write_bytes", "KV bytes this engine WROTE into a peer (NIXL WRITEs it posted: pushes)."),
    "turnkv_write_seconds": (
        "vllm:turnkv_write_seconds", "Time spent in the NIXL WRITEs this engine posted (sum over transfers; mean "
                                     "over tensor-parallel ranks, which write at the same time)."),
    "turnkv_host_moves": (
        "vllm:turnkv_host_moves", "Finished turns decode copied from its device cache into its host tier."),
    "turnkv_retention_yielded": (
        "vllm:turnkv_retention_yielded", "Finished turns decode kept off its device cache because incoming requests "
                                         "waited for more blocks than were free (host tier instead, or not retained)."),
    "turnkv_host_move_bytes": (
        "vllm:turnkv_host_move_bytes", "KV bytes decode copied from its device cache into its host tier."),
}

#: stats key -> (Prometheus counter name, help, label, label values). Each entry records a label value's index.
#: Names and label values from turnkv.metric_names, which the EMF bridge and the dashboards read too.
LABELLED: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    "turnkv_retention_placed": (
        mn.VLLM_RETENTION_PLACED, "Finished turns decode retained for the next turn, by tier.", "tier", mn.TIERS),
    "turnkv_retention_refusals": (
        mn.VLLM_RETENTION_REFUSALS, "Finished turns decode did not retain, by reason: too_large (larger than "
        "any tier), full (every tier full of turns still likely to be read).", "reason", mn.REFUSAL_REASONS),
    "turnkv_retention_evictions": (
        mn.VLLM_RETENTION_EVICTIONS, "Retained turns decode evicted, by reason: idle (unread past "
        "retention_idle_evict, for a newer turn), shrunk (share or host budget lowered), read (read once and kept "
        "for forks: the fork window passed or room was needed).", "reason",
        mn.EVICTION_REASONS),
    "turnkv_pulls": (
        mn.VLLM_PULLS, "Offers prefill pulled, by the tier decode held them in.", "tier", mn.TIERS),
    "turnkv_decisions": (
        mn.VLLM_DECISIONS, "Offers prefill decided on, by decision: pull, or recompute (refused before any READ, "
        "below the floor, or slower to pull even counting the queue; see vllm:turnkv_decision_reasons for why).",
        "decision", mn.DECISIONS),
    "turnkv_inline_plans": (
        mn.VLLM_INLINE_PLANS, "Pulls prefill decided to make, by how they are read: inline (inside the step that "
        "computes the request, connector.inline) or why not: off (inline_pull_max_ms 0), engine (not handshaken yet, "
        "or blocks converted after the READ), no-estimate (no READ timed yet), slow (predicted above "
        "inline_pull_max_ms), whole-prompt (nothing left to compute in the step), runner (Model Runner V2: its "
        "rollback of a failed inline READ is not trusted), offload (an offloading connector beside turnkv's would "
        "store a failed READ's blocks).", "reason", mn.INLINE_REASONS),
    "turnkv_fingerprint_checks": (
        mn.VLLM_FINGERPRINT_CHECKS, "READs of a sealed offer checked against decode's per-block digests of the KV "
        "bytes (connector.fingerprint), per rank, by result: ok, mismatch (those blocks recomputed), unverifiable "
        "(block size or tensor-parallel layout differ: not compared).", "result", mn.FINGERPRINT_RESULTS),
    "turnkv_fingerprint_mismatches": (
        mn.VLLM_FINGERPRINT_MISMATCHES, "KV blocks a READ brought whose bytes differ from decode's seal (reported "
        "invalid: recomputed, never cached), by read path: device, host (tier), inline.", "path", mn.READ_PATHS),
}

#: stats key -> (Prometheus gauge name, help). The last value of an interval is exported.
GAUGES: dict[str, tuple[str, str]] = {
    "turnkv_compute_seconds_per_token": (
        "vllm:turnkv_compute_seconds_per_token",
        "Marginal engine time per scheduled token (slope of step time against step tokens)."),
    "turnkv_compute_step_overhead_seconds": (
        "vllm:turnkv_compute_step_overhead_seconds", "Fixed engine time per step (intercept of the same fit)."),
    "turnkv_pull_seconds_per_token": (
        "vllm:turnkv_pull_seconds_per_token", "NIXL READ time per token moved (slope over the READs posted)."),
    "turnkv_pull_overhead_seconds": (
        "vllm:turnkv_pull_overhead_seconds", "Fixed time per NIXL READ (intercept of the same fit)."),
    "turnkv_host_pull_seconds_per_token": (
        "vllm:turnkv_host_pull_seconds_per_token",
        "NIXL READ time per token moved from decode's host tier (slope over those READs; fitted apart)."),
    "turnkv_host_pull_overhead_seconds": (
        "vllm:turnkv_host_pull_overhead_seconds", "Fixed time per NIXL READ of decode's host tier."),
    "turnkv_handshake_seconds": (
        "vllm:turnkv_handshake_seconds", "NIXL handshake time, paid by the first READ from an engine (EWMA)."),
    "turnkv_pull_wait_seconds": (
        "vllm:turnkv_pull_wait_seconds",
        "Time a pulling request waited for the engine beyond its transfer (EWMA; the queue, not a cost input)."),
    "turnkv_decision_tokens": (
        "vllm:turnkv_decision_tokens", "Last decision: tokens offered."),
    "turnkv_decision_pull_seconds": (
        "vllm:turnkv_decision_pull_seconds", "Last decision: predicted transfer time of the offer."),
    "turnkv_decision_compute_seconds": (
        "vllm:turnkv_decision_compute_seconds", "Last decision: predicted engine time to recompute the offer."),
    "turnkv_decision_queue_delay_seconds": (
        "vllm:turnkv_decision_queue_delay_seconds",
        "Last decision: what recomputing would add to the waits of the other requests (compute x requests)."),
    "turnkv_decision_queue_requests": (
        "vllm:turnkv_decision_queue_requests", "Last decision: other requests with prefill work in the engine."),
    "turnkv_decision_queue_tokens": (
        "vllm:turnkv_decision_queue_tokens", "Last decision: prompt tokens those requests still have to compute."),
    "turnkv_retained_requests": (
        "vllm:turnkv_retained_requests", "Finished turns whose KV decode holds for the next turn's prefill."),
    "turnkv_retained_blocks": (
        "vllm:turnkv_retained_blocks", "KV blocks decode holds for the next turn's prefill."),
    "turnkv_retained_bytes": (
        "vllm:turnkv_retained_bytes", "KV bytes decode holds for the next turn's prefill (both tiers)."),
    "turnkv_host_retained_requests": (
        "vllm:turnkv_host_retained_requests", "Finished turns decode holds in its host tier."),
    "turnkv_host_retained_bytes": (
        "vllm:turnkv_host_retained_bytes", "KV bytes decode holds in its host tier."),
    "turnkv_host_pool_bytes": (
        "vllm:turnkv_host_pool_bytes",
        "Size of decode's host-tier pool (0: no host tier, or no step run since start)."),
    "turnkv_host_tier_configured_bytes": (
        mn.VLLM_HOST_TIER_CONFIGURED_BYTES,
        "Host-tier bytes host_kv_budget_mib asked for at engine start (every rank's share, whole slots or not)."),
    "turnkv_host_tier_granted_bytes": (
        mn.VLLM_HOST_TIER_GRANTED_BYTES,
        "Host-tier bytes the engine allocated, pinned and registered at start (all ranks): below the configured "
        "bytes when the node refused the plan (shrunk) or the tier is off (0; the engine log says why)."),
}


#: Stats key of the decision reasons: one entry per decision, the index of its reason in REASONS.
REASONS_KEY = "turnkv_decision_reasons"
REASONS_METRIC = ("vllm:turnkv_decision_reasons",
                  "Pull-or-recompute decisions by reason: floor, no-estimate, faster, load (pulled because "
                  "recomputing would delay the queue), slower (refused), probe (a refused path tried).")
_KEYS = (*COUNTERS, *GAUGES, *LABELLED, REASONS_KEY)


class TurnkvKVConnectorStats(NixlKVConnectorStats):
    def __post_init__(self) -> None:
        super().__post_init__()
        for key in _KEYS:
            self.data.setdefault(key, [])

    def reset(self) -> None:
        super().reset()
        for key in _KEYS:
            self.data[key] = []

    def record(self, key: str, value: float) -> None:
        self.data[key].append(value)

    def record_reason(self, reason: str) -> None:
        self.data[REASONS_KEY].append(REASONS.index(reason))

    def record_label(self, key: str, value: str) -> None:
        """One increment of a labelled counter (``LABELLED``), as the index of its label value."""
        self.data[key].append(LABELLED[key][3].index(str(value)))

    def is_empty(self) -> bool:
        return super().is_empty() and not any(self.data.get(key) for key in _KEYS)

    def aggregate(self, other: Any) -> Any:
        for key in _KEYS:
            other.data.setdefault(key, [])
        return super().aggregate(other)

    @classmethod
    def wrap(cls, stats: NixlKVConnectorStats | None) -> TurnkvKVConnectorStats | None:
        if stats is None or isinstance(stats, cls):
            return stats
        return cls(data=dict(stats.data))


class TurnkvPromMetrics(NixlPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.turnkv_counters = {
            key: create_metric_per_engine(self._counter_cls(name=name, documentation=doc, labelnames=labelnames),
                                          self.per_engine_labelvalues)
            for key, (name, doc) in COUNTERS.items()
        }
        self.turnkv_gauges = {
            key: create_metric_per_engine(self._gauge_cls(name=name, documentation=doc, labelnames=labelnames,
                                                          multiprocess_mode="mostrecent"),
                                          self.per_engine_labelvalues)
            for key, (name, doc) in GAUGES.items()
        }
        reasons = self._counter_cls(name=REASONS_METRIC[0], documentation=REASONS_METRIC[1],
                                    labelnames=[*labelnames, "reason"])
        self.turnkv_reasons = {idx: [reasons.labels(*values, reason) for reason in REASONS]
                               for idx, values in self.per_engine_labelvalues.items()}
        self.turnkv_labelled = {}
        for key, (name, doc, label, label_values) in LABELLED.items():
            counter = self._counter_cls(name=name, documentation=doc, labelnames=[*labelnames, label])
            self.turnkv_labelled[key] = {idx: [counter.labels(*values, v) for v in label_values]
                                         for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        super().observe(transfer_stats_data, engine_idx)
        for key, counter in self.turnkv_counters.items():
            for value in transfer_stats_data.get(key, ()):
                counter[engine_idx].inc(value)
        for key, gauge in self.turnkv_gauges.items():
            values = transfer_stats_data.get(key)
            if values:
                gauge[engine_idx].set(values[-1])
        for index in transfer_stats_data.get(REASONS_KEY, ()):
            self.turnkv_reasons[engine_idx][int(index)].inc()
        for key, per_engine in self.turnkv_labelled.items():
            for index in transfer_stats_data.get(key, ()):
                per_engine[engine_idx][int(index)].inc()


class TurnkvStatsReporting:
    """Connector-level mixin: report turnkv's counters (scheduler) and the worker's transfer stats, and
    send the worker's cost-model samples to the scheduler with each step's output."""

    connector_scheduler: Any
    connector_worker: Any

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """vLLM's block pool, for the scheduler's decode-side pressure check (``turnkv_bind_block_pool``)."""
        super().bind_gpu_block_pool(gpu_block_pool)  # type: ignore[misc]
        scheduler = getattr(self, "connector_scheduler", None)
        if scheduler is not None and hasattr(scheduler, "turnkv_bind_block_pool"):
            scheduler.turnkv_bind_block_pool(gpu_block_pool)

    def build_connector_worker_meta(self) -> Any:
        """The worker's cost-model samples of this step (``connector.worker.TurnkvWorkerMeta``)."""
        worker = getattr(self, "connector_worker", None)
        ours = worker.build_turnkv_meta() if worker is not None and hasattr(worker, "build_turnkv_meta") else None
        return ours if ours is not None else super().build_connector_worker_meta()  # type: ignore[misc]

    def get_kv_connector_stats(self) -> Any:
        if self.connector_scheduler is not None:
            return self.connector_scheduler.take_turnkv_stats()
        return TurnkvKVConnectorStats.wrap(super().get_kv_connector_stats())  # type: ignore[misc]

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        return TurnkvKVConnectorStats(data=data) if data is not None else TurnkvKVConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        return TurnkvPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
