"""A prefill engine's vLLM CPU offloading tier beside turnkv's connector (issue #36: "combine what helps").

Deploy config ``connector.prefill_offload_gib`` -> user data's engine.env -> ``turnkv engine run``'s argv: a
``MultiConnector`` of turnkv's connector and vLLM's ``OffloadingConnector``, checked against vLLM 0.32 itself (its
config class, its connector factory, and what its own ``--kv-offloading-size`` writes). The tier cannot start on
vLLM's CPU build (it needs CUDA), so this is as far as it runs here."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import yaml

from infra import bootstrap
from infra.config import ConfigError, from_mapping
from infra.wheel import REPO_ROOT
from tests.infra import configs
from turnkv import engine_args, engine_run, node_env, wire
from turnkv.engine_args import EngineSpec, Role

pytestmark = pytest.mark.infra


def _spec(role: Role = Role.PREFILL, **kw) -> EngineSpec:
    return EngineSpec(role=role, engine_id="prefill-0", model="m", port=8100, side_channel_port=5600, **kw)


def test_an_offload_tier_makes_a_multiconnector_vllm_accepts():
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    config = engine_args.kv_transfer_config(_spec(prefill_offload_gib=64))
    assert config["kv_connector"] == "MultiConnector" and config["engine_id"] == "prefill-0"
    assert config["kv_load_failure_policy"] == "recompute"
    parsed = KVTransferConfig(**config)
    assert KVConnectorFactory.get_connector_class(parsed).__name__ == "MultiConnector"
    children = config["kv_connector_extra_config"]["connectors"]
    classes = [KVConnectorFactory.get_connector_class(KVTransferConfig(engine_id="prefill-0", **c)).__name__
               for c in children]
    # turnkv's first: vLLM lets the first child that matches load a request, and only turnkv's matches a replayed
    # offer (decode's turn, past prefill's own prefix hit); everything else falls through to the offload tier
    assert classes == ["TurnkvPullConnector", "OffloadingConnector"]
    alone = {k: v for k, v in engine_args.kv_transfer_config(_spec()).items()
             if k not in ("engine_id", "kv_load_failure_policy")}
    # the same connector, told that a sibling stores computed blocks: no pull is read inline (connector.inline)
    alone["kv_connector_extra_config"] = {**alone["kv_connector_extra_config"], wire.OFFLOAD_SIBLING_KEY: True}
    assert children[0] == alone
    assert children[1]["kv_connector_extra_config"] == {"cpu_bytes_to_use": 64 * 2**30}


def test_the_offload_child_is_what_vllms_own_flag_writes():
    """``--kv-offloading-backend native --kv-offloading-size 64`` alone would write this connector and key (and
    replace turnkv's): the child must be the same, so the tier is the one vLLM ships."""
    from vllm.config import VllmConfig

    vllm_side = SimpleNamespace(cache_config=SimpleNamespace(kv_offloading_size=64, kv_offloading_backend="native"),
                                kv_transfer_config=None)
    VllmConfig._post_init_kv_transfer_config(vllm_side)
    ours = engine_args.kv_transfer_config(_spec(prefill_offload_gib=64))["kv_connector_extra_config"]["connectors"][1]
    assert vllm_side.kv_transfer_config.kv_connector == ours["kv_connector"]
    assert vllm_side.kv_transfer_config.kv_role == ours["kv_role"]
    assert vllm_side.kv_transfer_config.kv_connector_extra_config == ours["kv_connector_extra_config"]


def test_the_offload_tier_is_refused_off_prefill_and_on_neuron():
    with pytest.raises(ValueError, match="prefill engine's setting"):
        engine_args.kv_transfer_config(_spec(role=Role.DECODE, prefill_offload_gib=8))
    with pytest.raises(ValueError, match="CUDA-alike"):
        engine_args.kv_transfer_config(_spec(prefill_offload_gib=8, flavor="neuron"))
    assert engine_args.kv_transfer_config(_spec())["kv_connector"] == "TurnkvPullConnector"  # 0: no tier


def _with_offload(gib: int, raw: dict = configs.GPU) -> dict:
    return configs.variant(raw, **{"connector.prefill_offload_gib": gib})


def test_the_deploy_config_carries_it_to_prefill_engines_only():
    c = from_mapping(_with_offload(1024))  # p5en: 2,048 GiB, one TP-8 engine: half of it
    assert c.connector.prefill_offload_gib == 1024
    prefill = next(p for p in c.pools if p.role is Role.PREFILL)
    decode = next(p for p in c.pools if p.role is Role.DECODE)
    static = node_env.parse(_engine_env(c, prefill))
    assert static[node_env.PREFILL_OFFLOAD_GIB] == "1024"
    assert node_env.PREFILL_OFFLOAD_GIB not in node_env.parse(_engine_env(c, decode))
    variables = {**static, node_env.ENGINE_ID: "prefill-0", node_env.SIDE_CHANNEL_HOST: "10.0.0.5"}
    argv, _, _ = engine_run.prepare(variables, read_text=lambda path: None, run=lambda cmd: 0, sync=False)
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "MultiConnector"
    assert config["kv_connector_extra_config"]["connectors"][1]["kv_connector_extra_config"] == {
        "cpu_bytes_to_use": 1024 * 2**30}
    assert config["kv_connector_extra_config"]["connectors"][0]["kv_connector_extra_config"]["backends"] == [
        "LIBFABRIC"]


def _engine_env(c, pool) -> str:
    """engine.env as the pool's user data writes it (the heredoc ``turnkv engine run`` reads on the node)."""
    script = bootstrap.user_data(bootstrap.pool_bootstrap(c, pool))
    path = re.escape(f"{node_env.ENGINE_ENV_FILE}.new")
    found = re.search(rf"cat > {path} <<'TURNKV_EOF'\n(.*?)TURNKV_EOF\n", script, re.S)
    assert found
    return found.group(1)


def test_an_offload_tier_past_the_nodes_memory_or_on_neuron_is_refused():
    with pytest.raises(ConfigError) as info:
        from_mapping(_with_offload(1025))
    problems = dict(info.value.problems)
    assert "use at most 1024" in problems["connector.prefill_offload_gib"]
    with pytest.raises(ConfigError):
        from_mapping(_with_offload(-1))
    trn2 = yaml.safe_load((REPO_ROOT / "deploy/trn2.yaml").read_text())
    from_mapping(trn2)  # the shipped Trainium config is valid as it is
    with pytest.raises(ConfigError) as info:
        from_mapping(_with_offload(64, trn2))
    assert "CUDA-alike" in dict(info.value.problems)["connector.prefill_offload_gib"]


def test_engine_env_refuses_the_tier_on_decode():
    env = {node_env.ROLE: "decode", node_env.ENGINE_ID: "d", node_env.MODEL: "m", node_env.SERVED_MODEL_NAME: "m",
           node_env.SIDE_CHANNEL_HOST: "10.0.0.5", node_env.PREFILL_OFFLOAD_GIB: "8"}
    with pytest.raises(node_env.NodeEnvError, match="prefill engine's setting"):
        node_env.EngineEnv.from_variables(env)
    prefill = node_env.EngineEnv.from_variables({**env, node_env.ROLE: "prefill"})
    assert prefill.prefill_offload_gib == 8 and prefill.spec().prefill_offload_gib == 8


def test_turnkvs_connectors_are_in_vllms_registry_after_the_plugin_loads():
    """A MultiConnector rebuilds its children's stats in the API server by registered class name; unregistered,
    every metrics interval raised there and the server answered 500 (found by tests/e2e/test_multi_connector.py)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from connector import plugin

    plugin.register_connectors()
    assert plugin.register_connectors() == []  # once per process
    for name, _ in engine_args.CONNECTORS.values():
        assert KVConnectorFactory.get_connector_class_by_name(name).__name__ == name
