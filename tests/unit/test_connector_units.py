"""Connector pieces that run inside vLLM, tested without an engine."""

import asyncio
import json
import types

import pytest

from connector import compat, idle, plugin, streaming
from turnkv import versions


def test_unsupported_vllm_is_refused_naming_the_supported_versions():
    assert compat.check_vllm_version(f"{versions.VLLM_CPU}+cpu") == f"{versions.VLLM_CPU}+cpu"
    assert compat.check_vllm_version(versions.VLLM_GPU) == versions.VLLM_GPU
    assert compat.check_vllm_version("0.29.0+cpu") == "0.29.0+cpu"  # the Neuron image's vLLM
    for unsupported in ("0.31.2", "0.33.0", "0.11.0"):
        with pytest.raises(compat.UnsupportedVllmError) as info:
            compat.check_vllm_version(unsupported)
        assert "supports vLLM 0.29.0 and 0.32.0 (gpu image 0.32.0, neuron image 0.29.0" in str(info.value)
        assert f"{unsupported} is installed" in str(info.value)


def test_patch_selection(monkeypatch):
    monkeypatch.setenv("TURNKV_PATCHES", "cpu, streaming")
    assert plugin._enabled("cpu") and plugin._enabled("streaming") and not plugin._enabled("idle")
    monkeypatch.setenv("TURNKV_PATCHES", "all")
    assert plugin._enabled("idle")


def test_idle_only_when_nothing_is_running():
    def core(unfinished, batch=(), push=False):
        connector = types.SimpleNamespace(has_pending_push_work=lambda: push)
        scheduler = types.SimpleNamespace(get_num_unfinished_requests=lambda: unfinished, connector=connector)
        return types.SimpleNamespace(scheduler=scheduler, batch_queue=list(batch))

    assert idle.only_holding_blocks(core(0))
    assert not idle.only_holding_blocks(core(1))
    assert not idle.only_holding_blocks(core(0, batch=[1]))
    assert not idle.only_holding_blocks(core(0, push=True))


def test_idle_tick_setting(monkeypatch):
    monkeypatch.setenv("TURNKV_IDLE_TICK_MS", "20")
    assert idle.idle_tick_seconds() == 0.02
    monkeypatch.setenv("TURNKV_IDLE_TICK_MS", "nonsense")
    assert idle.idle_tick_seconds() == 0.1
    monkeypatch.delenv("TURNKV_WORKER_SPIN_MS", raising=False)
    assert idle.worker_spin_seconds() == 0.002


def test_stream_gets_a_final_params_chunk_before_done():
    params = {"do_remote_decode": True, "remote_block_ids": [[3]]}

    async def engine_outputs():
        yield types.SimpleNamespace(kv_transfer_params=None)
        yield types.SimpleNamespace(kv_transfer_params=params)

    async def original(self, request, result_generator, request_id, model_name):
        async for _ in result_generator:
            yield 'data: {"choices": [{"delta": {"content": "x"}}]}\n\n'
        yield streaming.DONE

    wrapped = streaming._wrap(original, "chat.completion.chunk", 2)

    async def collect():
        return [c async for c in wrapped(None, object(), engine_outputs(), "req-1", "tiny")]

    chunks = asyncio.run(collect())
    assert chunks[-1] == streaming.DONE
    final = json.loads(chunks[-2][len("data: "):])
    assert final["kv_transfer_params"] == params and final["choices"] == [] and final["id"] == "req-1"


def test_stats_carry_turnkv_counters_through_aggregation():
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

    from connector.stats import TurnkvKVConnectorStats

    ours = TurnkvKVConnectorStats()
    assert ours.is_empty()
    ours.record("turnkv_proof_mismatches", 1)
    assert not ours.is_empty()
    worker = TurnkvKVConnectorStats.wrap(NixlKVConnectorStats())
    worker.aggregate(ours)
    assert worker.data["turnkv_proof_mismatches"] == [1]
    rebuilt = TurnkvKVConnectorStats(data=json.loads(json.dumps(worker.data)))
    assert rebuilt.data["turnkv_proof_mismatches"] == [1]


def _prom_metrics():
    """The connector's Prometheus metrics on a registry of their own (vLLM's ``multiprocess_mode`` dropped)."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from connector.stats import TurnkvPromMetrics

    registry = CollectorRegistry()

    def bind(cls):
        return lambda *a, **kw: cls(*a, registry=registry, **{k: v for k, v in kw.items()
                                                                if k != "multiprocess_mode"})

    types_ = {Counter: bind(Counter), Gauge: bind(Gauge), Histogram: bind(Histogram)}
    return registry, TurnkvPromMetrics(types.SimpleNamespace(kv_transfer_config=None), types_, ["engine"],
                                       {0: ["0"]})


def test_decision_reasons_reach_prometheus_as_one_labelled_counter():
    from connector.stats import TurnkvKVConnectorStats

    registry, metrics = _prom_metrics()
    stats = TurnkvKVConnectorStats()
    for reason in ("load", "load", "slower", "faster"):
        stats.record_reason(reason)
    stats.record("turnkv_decision_queue_requests", 3)
    metrics.observe(json.loads(json.dumps(stats.data)), 0)
    value = registry.get_sample_value
    assert value("vllm:turnkv_decision_reasons_total", {"engine": "0", "reason": "load"}) == 2
    assert value("vllm:turnkv_decision_reasons_total", {"engine": "0", "reason": "slower"}) == 1
    assert value("vllm:turnkv_decision_reasons_total", {"engine": "0", "reason": "probe"}) == 0
    assert value("vllm:turnkv_decision_queue_requests", {"engine": "0"}) == 3


def test_pull_and_recompute_decisions_reach_prometheus_as_one_counter_with_a_decision_label():
    from connector.stats import TurnkvKVConnectorStats
    from turnkv import metric_names as mn

    registry, metrics = _prom_metrics()
    stats = TurnkvKVConnectorStats()
    for decision in ("pull", "recompute", "recompute"):
        stats.record_label("turnkv_decisions", decision)
    metrics.observe(json.loads(json.dumps(stats.data)), 0)
    value = registry.get_sample_value
    assert mn.VLLM_DECISIONS == "vllm:turnkv_decisions"
    assert value("vllm:turnkv_decisions_total", {"engine": "0", "decision": "pull"}) == 1
    assert value("vllm:turnkv_decisions_total", {"engine": "0", "decision": "recompute"}) == 2
    names = {s.name for family in registry.collect() for s in family.samples}
    assert not {"vllm:turnkv_decisions_pull_total", "vllm:turnkv_decisions_recompute_total"} & names


def test_docs_name_every_connector_counter_with_total():
    import re
    from pathlib import Path

    from connector.stats import COUNTERS, LABELLED, REASONS_METRIC

    root = Path(__file__).resolve().parents[2]
    names = [*(c[0] for c in COUNTERS.values()), *(c[0] for c in LABELLED.values()), REASONS_METRIC[0]]
    for doc in [*(root / "docs").glob("*.md"), root / "README.md"]:
        text = doc.read_text()
        for name in names:
            assert not re.search(re.escape(name) + r"(?![a-z_<])", text), f"{doc.name} names {name} without _total"
