"""An engine's Prometheus ``/metrics`` page, read in one place for every benchmark.

Fetching (async through aiohttp, or blocking through urllib) returns the page's text or None when the engine does
not answer; the readers below are pure functions of that text: one counter or gauge summed over matching labels,
every ``vllm:turnkv_*`` series keyed by tier/reason, and vLLM's ``vllm:cache_config_info`` labels.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

#: vLLM's cache-config info gauge: its labels carry the block count and block size the engine runs with.
CACHE_CONFIG_INFO = "vllm:cache_config_info"
#: Labels that tell turnkv's series apart (``turnkv_series``); others (engine, model_name) are summed over.
KEEP_LABELS = ("tier", "reason")


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def samples(text: str | None) -> list[Sample]:
    """Every sample of a /metrics page (none for None); ``_created`` timestamps are dropped."""
    if not text:
        return []
    from prometheus_client.parser import text_string_to_metric_families

    return [Sample(s.name, dict(s.labels), s.value) for family in text_string_to_metric_families(text)
            for s in family.samples if not s.name.endswith("_created")]


def total(text: str | None, name: str, **labels: str) -> float:
    """A counter's or gauge's sum over the series carrying these labels; NaN when there is no page (an engine
    that did not answer is not an engine that counted 0)."""
    if text is None:
        return float("nan")
    return sum(s.value for s in samples(text)
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def totals(text: str | None, names: dict[str, str]) -> dict[str, float]:
    """Several series at once: ``{key: metric name}`` -> ``{key: sum over labels}`` (0 for an absent series)."""
    wanted = {name: key for key, name in names.items()}
    out = dict.fromkeys(names, 0.0)
    for s in samples(text):
        if s.name in wanted:
            out[wanted[s.name]] += s.value
    return out


def series_key(name: str, labels: dict[str, str]) -> str:
    kept = ",".join(f'{k}="{labels[k]}"' for k in KEEP_LABELS if k in labels)
    return f"{name}{{{kept}}}" if kept else name


def turnkv_series(text: str | None, prefix: str = "vllm:turnkv_") -> dict[str, float]:
    """Every ``prefix`` sample of a page, summed by tier/reason (``name{tier="host"}`` -> value). Counters keep
    their ``_total`` name."""
    out: dict[str, float] = {}
    for s in samples(text):
        if s.name.startswith(prefix):
            key = series_key(s.name, s.labels)
            out[key] = out.get(key, 0.0) + s.value
    return out


@dataclass(frozen=True)
class CacheConfig:
    num_gpu_blocks: int
    block_size: int
    #: vLLM's KV cache bytes (0 when the label is missing).
    kv_cache_memory_bytes: float = 0.0


def cache_config(text: str | None) -> CacheConfig | None:
    """The engine's block count and block size from ``vllm:cache_config_info``, or None."""
    for s in samples(text):
        if s.name == CACHE_CONFIG_INFO:
            try:
                return CacheConfig(int(s.labels["num_gpu_blocks"]), int(s.labels["block_size"]),
                                   float(s.labels.get("kv_cache_memory_bytes", 0) or 0))
            except (KeyError, ValueError):
                return None
    return None


def metrics_url(base_url: str) -> str:
    return base_url.rstrip("/") + "/metrics"


async def fetch(session: Any, base_url: str, timeout: float = 10.0) -> str | None:
    """An engine's page through an ``aiohttp.ClientSession``, or None when it does not answer 200."""
    import aiohttp

    try:
        async with session.get(metrics_url(base_url), timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            return await resp.text() if resp.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, OSError):
        return None


def fetch_sync(base_url: str, timeout: float = 10.0) -> str | None:
    """The same, blocking (for benchmarks that are not async)."""
    try:
        with urllib.request.urlopen(metrics_url(base_url), timeout=timeout) as resp:
            return resp.read().decode() if resp.status == 200 else None
    except (urllib.error.URLError, OSError, ValueError):
        return None
