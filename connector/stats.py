"""turnkv's connector counters, carried on vLLM's KV-connector stats path to the engine's /metrics."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats, NixlPromMetrics
from vllm.v1.metrics.utils import create_metric_per_engine

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
    "turnkv_decisions_pull": (
        "vllm:turnkv_decisions_pull", "Verified offers pulled (the cost model expected the pull to be faster)."),
    "turnkv_decisions_recompute": (
        "vllm:turnkv_decisions_recompute", "Verified offers recomputed (below the threshold, or slower to pull)."),
    "turnkv_stale_offers": (
        "vllm:turnkv_stale_offers", "Offers from a decode engine that restarted since (not read; recomputed)."),
    "turnkv_read_bytes": (
        "vllm:turnkv_read_bytes", "KV bytes this engine READ from a peer (NIXL READs it posted: pulls)."),
    "turnkv_read_seconds": (
        "vllm:turnkv_read_seconds", "Time spent in the NIXL READs this engine posted (sum over transfers)."),
    "turnkv_write_bytes": (
        "vllm:turnkv_write_bytes", "KV bytes this engine WROTE into a peer (NIXL WRITEs it posted: pushes)."),
    "turnkv_write_seconds": (
        "vllm:turnkv_write_seconds", "Time spent in the NIXL WRITEs this engine posted (sum over transfers)."),
}

#: stats key -> (Prometheus gauge name, help). The last value of an interval is exported.
GAUGES: dict[str, tuple[str, str]] = {
    "turnkv_compute_seconds_per_token": (
        "vllm:turnkv_compute_seconds_per_token", "Prefill's measured compute time per prompt token (EWMA)."),
    "turnkv_pull_seconds_per_token": (
        "vllm:turnkv_pull_seconds_per_token", "Measured pull time per token (fitted slope)."),
    "turnkv_pull_overhead_seconds": (
        "vllm:turnkv_pull_overhead_seconds", "Measured fixed time per pull (fitted intercept)."),
    "turnkv_retained_requests": (
        "vllm:turnkv_retained_requests", "Finished turns whose KV decode holds for the next turn's prefill."),
    "turnkv_retained_blocks": (
        "vllm:turnkv_retained_blocks", "KV blocks decode holds for the next turn's prefill."),
    "turnkv_retained_bytes": (
        "vllm:turnkv_retained_bytes", "KV bytes decode holds for the next turn's prefill."),
}


class TurnkvKVConnectorStats(NixlKVConnectorStats):
    def __post_init__(self) -> None:
        super().__post_init__()
        for key in (*COUNTERS, *GAUGES):
            self.data.setdefault(key, [])

    def reset(self) -> None:
        super().reset()
        for key in (*COUNTERS, *GAUGES):
            self.data[key] = []

    def record(self, key: str, value: float) -> None:
        self.data[key].append(value)

    def is_empty(self) -> bool:
        return super().is_empty() and not any(self.data.get(key) for key in (*COUNTERS, *GAUGES))

    def aggregate(self, other: Any) -> Any:
        for key in (*COUNTERS, *GAUGES):
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

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        super().observe(transfer_stats_data, engine_idx)
        for key, counter in self.turnkv_counters.items():
            for value in transfer_stats_data.get(key, ()):
                counter[engine_idx].inc(value)
        for key, gauge in self.turnkv_gauges.items():
            values = transfer_stats_data.get(key)
            if values:
                gauge[engine_idx].set(values[-1])


class TurnkvStatsReporting:
    """Connector-level mixin: report turnkv's counters (scheduler) and the worker's transfer stats."""

    connector_scheduler: Any
    connector_worker: Any

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
