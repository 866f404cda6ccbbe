"""bench.engine_metrics: the one reader of engines' /metrics pages the benchmarks share."""

from __future__ import annotations

import math

from bench import engine_metrics as em

PAGE = """# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="8192",kv_cache_memory_bytes="2147483648"} 1.0
# TYPE vllm:turnkv_pulls counter
vllm:turnkv_pulls_total{engine="0",tier="device"} 3.0
vllm:turnkv_pulls_total{engine="1",tier="device"} 2.0
vllm:turnkv_pulls_created{engine="0",tier="device"} 1.7e9
vllm:turnkv_pulls_total{engine="0",tier="host"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0"} 0.25
"""


def test_counters_and_gauges_are_summed_over_matching_labels():
    assert em.total(PAGE, "vllm:turnkv_pulls_total") == 6.0
    assert em.total(PAGE, "vllm:turnkv_pulls_total", tier="device") == 5.0
    assert em.total(PAGE, "vllm:kv_cache_usage_perc") == 0.25
    assert em.total(PAGE, "vllm:absent_total") == 0.0
    assert math.isnan(em.total(None, "vllm:turnkv_pulls_total"))  # no page is not a zero count


def test_turnkv_series_keeps_tier_and_drops_created_timestamps():
    series = em.turnkv_series(PAGE)
    assert series == {'vllm:turnkv_pulls_total{tier="device"}': 5.0, 'vllm:turnkv_pulls_total{tier="host"}': 1.0}
    assert em.totals(PAGE, {"pulls": "vllm:turnkv_pulls_total", "none": "vllm:x_total"}) == {"pulls": 6.0,
                                                                                             "none": 0.0}


def test_cache_config_reads_vllms_labels():
    assert em.cache_config(PAGE) == em.CacheConfig(8192, 16, 2147483648.0)
    assert em.cache_config("vllm:num_requests_running 0\n") is None
    assert em.cache_config(None) is None
    assert em.cache_config('vllm:cache_config_info{block_size="x",num_gpu_blocks="1"} 1\n') is None
