"""Trainium with no Trainium here: a stand-in for the native vllm-neuron platform, built from the cited facts in
``turnkv.neuron``, drives turnkv's start-up checks and upstream vLLM's own NIXL device table; the engine argv and
environment of a trn2 node; and docs/trainium.md's table is the facts module's."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from tests.unit.neuron_standin import NativeNeuronPlatform
from turnkv import engine_args, neuron, node_env, platforms
from turnkv.engine_settings import EngineSettings

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def on_neuron(monkeypatch):
    import vllm.platforms

    monkeypatch.setattr(vllm.platforms, "_current_platform", NativeNeuronPlatform())
    monkeypatch.delenv(platforms.ALLOW_ENV, raising=False)


def test_the_connector_names_the_native_platform_neuron_and_starts_only_when_allowed(on_neuron):
    from connector import compat, cpu

    assert compat.current_platform_name() == "neuron"
    assert not cpu._is_cpu_platform()  # no CPU-only patches on a Neuron engine
    with pytest.raises(platforms.UnverifiedPlatformError):
        compat.check_platform()
    compat.check_platform(env={platforms.ALLOW_ENV: "neuron"})


def test_upstream_nixl_accepts_the_kv_buffer_turnkv_configures_on_neuron(monkeypatch):
    """vLLM's NIXL worker refuses a device type / kv_buffer_device pair missing from ``_NIXL_SUPPORTED_DEVICE``, which
    it extends with the platform's ``get_nixl_supported_devices()`` at import: re-imported under the stand-in, the
    real table takes what ``engine_args`` writes for a Neuron engine, and not vLLM's host-buffer default."""
    import vllm.platforms
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import utils  # its imports made on the real platform

    monkeypatch.setattr(vllm.platforms, "_current_platform", NativeNeuronPlatform())
    try:
        table = importlib.reload(utils)._NIXL_SUPPORTED_DEVICE
        spec = engine_args.EngineSpec(role=engine_args.Role.DECODE, engine_id="d", model="m", port=8000,
                                      side_channel_port=5600, backends=neuron.NIXL_BACKENDS, flavor="neuron")
        buffer = engine_args.kv_transfer_config(spec)["kv_buffer_device"]
        assert buffer in table[neuron.DEVICE_TYPE]
        assert "cpu" not in table[neuron.DEVICE_TYPE]  # the host-buffer path upstream would take is not offered
    finally:
        monkeypatch.undo()
        importlib.reload(utils)


def _trn2(role, **kw) -> engine_args.EngineSpec:
    return engine_args.EngineSpec(role=role, engine_id="i-1-2", model="Qwen/Qwen3-32B", port=8002,
                                  side_channel_port=5632, tensor_parallel_size=16, max_model_len=32768,
                                  backends=neuron.NIXL_BACKENDS, flavor="neuron", **kw)


@pytest.mark.parametrize("role", list(engine_args.Role))
def test_a_trn2_engine_argv_and_environment_for_each_role(role):
    spec = _trn2(role)
    env = engine_args.serve_env(spec)
    assert env["VLLM_PLUGINS"].split(",") == ["turnkv", "turnkv-leases", neuron.PLATFORM_PLUGIN]
    assert env["FI_EFA_ENABLE_SHM_TRANSFER"] == "0"
    assert env[neuron.BIDIRECTIONAL_ENV] == "1"  # the plugin's D->P switch (its DI design doc)
    # Decode keeps prefill's graphs: a failed READ recomputes the prompt there (kv_load_failure_policy: recompute).
    assert "VLLM_NEURON_SKIP_PREFILL_WARMUP" not in env
    assert ("VLLM_NEURON_SKIP_DECODE_WARMUP" in env) == (role is engine_args.Role.PREFILL)
    assert {k: env[k] for k in neuron.TIMEOUTS} == neuron.TIMEOUTS
    assert env[neuron.CACHE_ROOT_ENV] == neuron.CACHE_ROOT
    args = engine_args.serve_args(spec)
    config = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert config["kv_buffer_device"] == "cuda" and config["kv_connector_extra_config"]["backends"] == ["LIBFABRIC"]
    assert config["kv_connector_extra_config"]["bidirectional_kv_xfer"] is True
    assert config["kv_load_failure_policy"] == "recompute"
    # Prefix caching with segmented prefill, as the Llama-3.3-70B tutorial runs it: one segment size, the prefill
    # bucket and --max-num-batched-tokens equal to it, the decode batch bucket equal to --max-num-seqs.
    assert "--enable-prefix-caching" in args
    extra = json.loads(args[args.index("--additional-config") + 1])["neuron_config"]
    assert extra == {"kv_segment_size_buckets": [8192], "num_batched_tokens_buckets": [8192], "num_seqs_buckets": [8]}
    assert args[args.index("--max-num-batched-tokens") + 1] == "8192" and args[args.index("--max-num-seqs") + 1] == "8"
    assert 8192 % int(args[args.index("--block-size") + 1]) == 0


def test_the_bucket_configuration_follows_the_model_length_block_size_and_batch():
    assert neuron.segment_size(32768, 128) == 8192 and neuron.segment_size(4096, 128) == 4096
    assert neuron.segment_size(3000, 128) == 2048 and neuron.segment_size(256, 32) == 512
    with pytest.raises(ValueError, match="divides none"):
        neuron.segment_size(8192, 3000)
    spec = _trn2(engine_args.Role.DECODE, settings=EngineSettings(max_num_seqs=4))
    args = engine_args.serve_args(spec)
    assert json.loads(args[args.index("--additional-config") + 1])["neuron_config"]["num_seqs_buckets"] == [4]
    assert args.count("--max-num-seqs") == 1
    with pytest.raises(ValueError, match="turnkv sets the bucket configuration"):
        engine_args.serve_args(_trn2(engine_args.Role.PREFILL, extra_args=("--max-num-batched-tokens=2048",)))
    # Off Neuron nothing changes.
    gpu = engine_args.EngineSpec(role=engine_args.Role.DECODE, engine_id="g", model="m", port=8000,
                                 side_channel_port=5600, flavor="gpu")
    assert "--additional-config" not in engine_args.serve_args(gpu)


def test_push_is_refused_on_neuron_and_a_gpu_engine_is_unchanged():
    with pytest.raises(ValueError, match="read mode only"):
        engine_args.kv_transfer_config(engine_args.EngineSpec(
            role=engine_args.Role.PREFILL, engine_id="p", model="m", port=8000, side_channel_port=5600,
            mode=engine_args.Mode.PUSH, flavor="neuron"))
    gpu = engine_args.EngineSpec(role=engine_args.Role.DECODE, engine_id="g", model="m", port=8000,
                                 side_channel_port=5600, flavor="gpu")
    env = engine_args.serve_env(gpu)
    assert env["VLLM_PLUGINS"] == "turnkv,turnkv-leases"
    assert not any(k.startswith(("VLLM_NEURON", "FI_EFA")) or k == neuron.CACHE_ROOT_ENV for k in env)
    assert "kv_buffer_device" not in engine_args.kv_transfer_config(gpu)


def test_trn2_engine_slots_use_the_plugins_device_variable():
    slots = node_env.engine_slots(4, 16, 64)
    assert [s.device_variables(gpu=False) for s in slots] == [
        {neuron.VISIBLE_DEVICES: f"{16 * k}-{16 * k + 15}"} for k in range(4)]
    assert node_env.visible_devices({neuron.VISIBLE_DEVICES: "16-31"}) == tuple(range(16, 32))
    # Slot files written before the native plugin still read.
    assert node_env.visible_devices({node_env.NEURON_RT_VISIBLE_CORES: "0-1"}) == (0, 1)


def test_the_docs_table_is_the_facts_module():
    page = (REPO / "docs/trainium.md").read_text()
    assert neuron.markdown_table() in page, "regenerate: python -c 'from turnkv import neuron; " \
                                            "print(neuron.markdown_table())'"


def test_a_neuron_engine_says_whether_it_compiles_and_the_node_outwaits_it(tmp_path):
    from infra import bootstrap
    from infra.constructs import engine_group
    from turnkv import engine_run

    empty = engine_run.compile_note(str(tmp_path))
    assert "is empty: this engine compiles its graphs before it serves" in empty
    (tmp_path / "neuronxcc-2.22").mkdir()
    assert "graphs present" in engine_run.compile_note(str(tmp_path))
    # The register unit's wait for a first /health (720 polls, 10 s apart) outlasts the engine's own ready budget,
    # and CloudFormation's signal wait (one hour) the ready budget too: a compiling node is not replaced.
    text = bootstrap.register_script(bootstrap.pool_bootstrap(*_trn2_pool()))
    assert "seq 1 720" in text and "sleep 10" in text and engine_run.HEALTH_WAIT_S == 720 * 10
    ready = int(neuron.TIMEOUTS["VLLM_ENGINE_READY_TIMEOUT_S"])
    assert ready < engine_run.HEALTH_WAIT_S and ready < engine_group.SIGNAL_TIMEOUT.to_seconds()


def _trn2_pool():
    import yaml

    from infra.config import from_mapping
    from infra.wheel import REPO_ROOT

    config = from_mapping(yaml.safe_load((REPO_ROOT / "deploy/trn2.yaml").read_text()))
    return config, config.pools[1]


@pytest.mark.parametrize("role", list(engine_args.Role))
def test_the_dry_run_names_the_upstream_source_of_every_neuron_setting(role):
    named = " ".join(neuron.setting_sources())
    for key in engine_args.neuron_env(_trn2(role)):
        assert key in named, key
    for flag in engine_args.NEURON_FLAGS:
        assert flag in named
    assert all(source.strip() for source in neuron.setting_sources().values())
