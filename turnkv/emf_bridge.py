"""Engine metrics bridge: vLLM's Prometheus ``/metrics`` -> CloudWatch embedded-metric-format lines.

The CloudWatch agent's Prometheus input drops histograms (TTFT, inter-token latency, NIXL transfer time are
all histograms in vLLM), so each engine node runs this bridge (``turnkv-metrics.service``, written by the
CDK user data): every interval it scrapes the engine, turns counters and histograms into per-interval
values (means, estimated p99, deltas) and sends one EMF document to the agent's listener on tcp:25888. On a node
of several engines each engine has its own bridge (``turnkv-metrics@k``), given its engine id (``--engine-id``):
its metrics go out per engine as well as under the dashboards' ``{Deployment, Role}`` (:func:`dimension_sets`).

The parsing and arithmetic are pure functions; ``run`` does the I/O. Names: ``turnkv.metric_names``.
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import sys
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field

from turnkv import metric_names as mn
from turnkv import node_env

DEFAULT_EMF_ADDRESS = ("127.0.0.1", 25888)


@dataclass(frozen=True)
class Spec:
    family: str
    kind: str  # gauge | counter | histogram
    #: (EMF name, statistic, unit): statistic is value | delta | mean | sum | p50 | p99 ...
    outputs: tuple[tuple[str, str, str], ...]
    scale: float = 1.0
    aggregate: str = "sum"  # how label sets (several engines/ranks) combine: sum | max
    #: Only samples with these labels (e.g. one tier of a counter labelled by tier).
    labels: tuple[tuple[str, str], ...] = ()

    @property
    def key(self) -> str:
        """The snapshot key: the family, and the label filter when there is one."""
        return self.family + "".join(f"{{{k}={v}}}" for k, v in self.labels)


SPECS: tuple[Spec, ...] = (
    Spec(mn.VLLM_TTFT, "histogram", ((mn.ENGINE_TTFT, "mean", "Milliseconds"),
                                     (mn.ENGINE_TTFT_P99, "p99", "Milliseconds")), scale=1000),
    Spec(mn.VLLM_ITL, "histogram", ((mn.ENGINE_ITL, "mean", "Milliseconds"),
                                    (mn.ENGINE_ITL_P99, "p99", "Milliseconds")), scale=1000),
    Spec(mn.VLLM_NIXL_XFER_TIME, "histogram", ((mn.NIXL_XFER_TIME, "mean", "Milliseconds"),
                                               (mn.NIXL_XFER_TIME_P99, "p99", "Milliseconds")), scale=1000),
    Spec(mn.VLLM_NIXL_BYTES, "histogram", ((mn.NIXL_BYTES, "sum", "Bytes"),)),
    Spec(mn.VLLM_KV_USAGE, "gauge", ((mn.KV_CACHE_USAGE, "value", "Percent"),), scale=100, aggregate="max"),
    Spec(mn.VLLM_RUNNING, "gauge", ((mn.REQUESTS_RUNNING, "value", "Count"),)),
    Spec(mn.VLLM_WAITING, "gauge", ((mn.REQUESTS_WAITING, "value", "Count"),)),
    Spec(mn.VLLM_NIXL_EXPIRED, "counter", ((mn.NIXL_EXPIRED, "delta", "Count"),)),
    Spec(mn.VLLM_RETAINED_BYTES, "gauge", ((mn.RETAINED_BYTES, "value", "Bytes"),)),
    Spec(mn.VLLM_HOST_RETAINED_BYTES, "gauge", ((mn.HOST_RETAINED_BYTES, "value", "Bytes"),)),
    Spec(mn.VLLM_HOST_POOL_BYTES, "gauge", ((mn.HOST_POOL_BYTES, "value", "Bytes"),)),
    Spec(mn.VLLM_HOST_TIER_CONFIGURED_BYTES, "gauge", ((mn.HOST_TIER_CONFIGURED_BYTES, "value", "Bytes"),)),
    Spec(mn.VLLM_HOST_TIER_GRANTED_BYTES, "gauge", ((mn.HOST_TIER_GRANTED_BYTES, "value", "Bytes"),)),
    Spec(mn.VLLM_HOST_MOVES, "counter", ((mn.HOST_MOVES, "delta", "Count"),)),
    *(Spec(mn.VLLM_PULLS, "counter", ((mn.pulls(t), "delta", "Count"),), labels=(("tier", t),)) for t in mn.TIERS),
    *(Spec(mn.VLLM_RETENTION_PLACED, "counter", ((mn.retained(t), "delta", "Count"),), labels=(("tier", t),))
      for t in mn.TIERS),
    *(Spec(mn.VLLM_RETENTION_REFUSALS, "counter", ((mn.refused(r), "delta", "Count"),), labels=(("reason", r),))
      for r in mn.REFUSAL_REASONS),
    *(Spec(mn.VLLM_RETENTION_EVICTIONS, "counter", ((mn.evicted(r), "delta", "Count"),), labels=(("reason", r),))
      for r in mn.EVICTION_REASONS),
)


@dataclass
class Histogram:
    buckets: dict[float, float] = field(default_factory=dict)  # upper bound -> cumulative count
    sum: float = 0.0
    count: float = 0.0


Snapshot = dict[str, "float | Histogram"]


def parse(text: str, specs: tuple[Spec, ...] = SPECS) -> Snapshot:
    """The families in ``specs`` from Prometheus text, label sets combined; missing families are left out."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted: dict[str, list[Spec]] = {}
    for spec in specs:
        wanted.setdefault(spec.family, []).append(spec)
    out: Snapshot = {}
    for family in text_string_to_metric_families(text):
        name = family.name[:-6] if family.name.endswith("_total") else family.name
        for spec in wanted.get(name, ()):
            samples = [s for s in family.samples if all(s.labels.get(k) == v for k, v in spec.labels)]
            if samples:
                _take(spec, samples, out)
    return out


def _take(spec: Spec, samples: list, out: Snapshot) -> None:
    if spec.kind == "histogram":
        h = out.setdefault(spec.key, Histogram())
        assert isinstance(h, Histogram)
        for s in samples:
            if s.name.endswith("_bucket"):
                le = math.inf if s.labels["le"] == "+Inf" else float(s.labels["le"])
                h.buckets[le] = h.buckets.get(le, 0.0) + s.value
            elif s.name.endswith("_sum"):
                h.sum += s.value
            elif s.name.endswith("_count"):
                h.count += s.value
        return
    values = [s.value for s in samples if not s.name.endswith("_created")]
    if values:
        out[spec.key] = max(values) if spec.aggregate == "max" else sum(values)


def quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """Prometheus' histogram_quantile: linear interpolation inside the bucket holding the q-th observation."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    total = buckets[bounds[-1]]
    rank = q * total
    lower, below = 0.0, 0.0
    for upper in bounds:
        count = buckets[upper]
        if count >= rank:
            if math.isinf(upper):
                return lower  # beyond the last finite bound: report that bound
            inside = count - below
            return lower + (upper - lower) * ((rank - below) / inside if inside > 0 else 0.0)
        lower, below = upper, count
    return lower


def _delta(cur: float, prev: float | None) -> float:
    # a counter that went down means the engine restarted: the new value is the delta
    return cur if prev is None or cur < prev else cur - prev


def interval_values(prev: Snapshot, cur: Snapshot, specs: tuple[Spec, ...] = SPECS) -> dict[str, tuple[float, str]]:
    """EMF name -> (value, unit) for one interval; metrics without observations in it are left out."""
    out: dict[str, tuple[float, str]] = {}
    for spec in specs:
        if spec.key not in cur:
            continue
        now = cur[spec.key]
        before = prev.get(spec.key)
        for emf_name, stat, unit in spec.outputs:
            value: float | None
            if spec.kind == "gauge":
                value = float(now)  # type: ignore[arg-type]
            elif spec.kind == "counter":
                if before is None:
                    continue
                value = _delta(float(now), float(before))  # type: ignore[arg-type]
            else:
                assert isinstance(now, Histogram)
                old = before if isinstance(before, Histogram) else None
                if old is None:
                    continue
                restarted = now.count < old.count
                count = now.count if restarted else now.count - old.count
                total = now.sum if restarted else now.sum - old.sum
                if stat == "sum":
                    value = total
                elif count <= 0:
                    continue
                elif stat == "mean":
                    value = total / count
                else:
                    buckets = now.buckets if restarted else {
                        le: c - old.buckets.get(le, 0.0) for le, c in now.buckets.items()}
                    value = quantile(float(stat[1:]) / 100, buckets)
                    if value is None:
                        continue
            out[emf_name] = (value * spec.scale, unit)
    return out


def dimension_sets(dimensions: Mapping[str, str]) -> list[list[str]]:
    """The directive's dimension sets: always the dashboards' ``{Deployment, Role}``; with an engine id also the
    per-engine set, so the engines of one node (or of a role) are told apart without emptying a dashboard."""
    sets = [list(mn.ENGINE_ROLE_DIMENSIONS)]
    if dimensions.get(mn.ENGINE_ID):
        sets.append(list(mn.ENGINE_DIMENSIONS))
    return sets


def emf_document(values: Mapping[str, tuple[float, str]], dimensions: Mapping[str, str], *, log_group: str,
                 timestamp_ms: int | None = None) -> dict:
    return {
        "_aws": {
            "Timestamp": int(time.time() * 1000) if timestamp_ms is None else timestamp_ms,
            "LogGroupName": log_group,
            "CloudWatchMetrics": [{
                "Namespace": mn.ENGINE_NAMESPACE,
                "Dimensions": dimension_sets(dimensions),
                "Metrics": [{"Name": name, "Unit": unit} for name, (_, unit) in values.items()],
            }],
        },
        **dimensions,
        **{name: round(value, 6) for name, (value, _) in values.items()},
    }


def send(document: dict, address: tuple[str, int] = DEFAULT_EMF_ADDRESS, timeout: float = 5.0) -> None:
    with socket.create_connection(address, timeout=timeout) as conn:
        conn.sendall(json.dumps(document, separators=(",", ":")).encode() + b"\n")


def run(metrics_url: str, dimensions: Mapping[str, str], log_group: str, interval: float,
        address: tuple[str, int] = DEFAULT_EMF_ADDRESS, iterations: int | None = None) -> None:
    prev: Snapshot = {}
    done = 0
    while iterations is None or done < iterations:
        started = time.monotonic()
        try:
            with urllib.request.urlopen(metrics_url, timeout=10) as resp:
                cur = parse(resp.read().decode())
            values = interval_values(prev, cur)
            if values:
                send(emf_document(values, dimensions, log_group=log_group), address)
            prev = cur
        except OSError as exc:  # engine still loading, agent restarting: try again next interval
            print(f"turnkv emf bridge: {exc}", file=sys.stderr, flush=True)
        done += 1
        if iterations is None or done < iterations:
            time.sleep(max(0.0, interval - (time.monotonic() - started)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m turnkv.emf_bridge", description=__doc__.splitlines()[0])
    parser.add_argument("--metrics-url", default=f"http://127.0.0.1:{node_env.DEFAULT_PORT}/metrics")
    parser.add_argument("--deployment", required=True)
    parser.add_argument("--role", required=True, choices=["prefill", "decode"])
    parser.add_argument("--pool", required=True)
    parser.add_argument("--log-group", required=True)
    parser.add_argument("--engine-id", default="",
                        help="This engine's id: its metrics are published per engine too (a node of several engines)")
    parser.add_argument("--interval", type=float, default=60.0)
    parser.add_argument("--emf", default="127.0.0.1:25888", help="host:port of the CloudWatch agent's EMF listener")
    args = parser.parse_args(argv)
    host, _, port = args.emf.rpartition(":")
    dimensions = {mn.DEPLOYMENT: args.deployment, mn.ROLE: args.role, mn.POOL: args.pool}
    if args.engine_id:
        dimensions[mn.ENGINE_ID] = args.engine_id
    run(args.metrics_url, dimensions, args.log_group, args.interval, (host, int(port)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
