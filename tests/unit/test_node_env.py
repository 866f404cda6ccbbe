"""The engine node env-file contract (turnkv/node_env.py) round-trips into an EngineSpec."""

from __future__ import annotations

import pytest

from turnkv import node_env
from turnkv.engine_args import Mode, Role, kv_transfer_config


def _env(**kw) -> node_env.EngineEnv:
    base = dict(role=Role.DECODE, engine_id="prod-decode-i-0abc", model="Qwen/Qwen3-8B",
                served_model_name="qwen3", side_channel_host="10.0.3.7", tp_size=8, max_model_len=32768)
    base.update(kw)
    return node_env.EngineEnv(**base)


def test_render_parse_round_trip_names_every_contract_variable():
    text = node_env.render(_env(model_s3_uri="s3://bucket/models/qwen3/").variables())
    parsed = node_env.parse(text)
    assert parsed[node_env.ROLE] == "decode"
    assert parsed["TURNKV_SIDE_CHANNEL_PORT"] == "5600"
    assert parsed["TURNKV_PORT"] == "8000"
    assert parsed["TURNKV_BACKENDS"] == "LIBFABRIC"
    assert parsed["TURNKV_TUNABLES_FILE"] == "/etc/turnkv/tunables.json"
    assert parsed["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.3.7"
    assert parsed["TURNKV_MODEL_S3_URI"] == "s3://bucket/models/qwen3/"
    assert set(parsed) >= {"TURNKV_ROLE", "TURNKV_ENGINE_ID", "TURNKV_MODEL", "TURNKV_SERVED_MODEL_NAME",
                           "TURNKV_MODE", "TURNKV_BIDIRECTIONAL", "TURNKV_TP_SIZE", "TURNKV_MAX_MODEL_LEN"}


def test_runtime_variables_can_be_left_out_for_the_instance_to_fill():
    text = node_env.render(_env().variables(), skip=node_env.RUNTIME_VARIABLES)
    parsed = node_env.parse(text)
    assert node_env.ENGINE_ID not in parsed and node_env.SIDE_CHANNEL_HOST not in parsed
    assert parsed[node_env.MODEL] == "Qwen/Qwen3-8B"


@pytest.mark.parametrize("bad", ["a b", "x;rm -rf /", "$(id)", "`id`", "a\nB=c", "'q'"])
def test_unsafe_values_are_refused(bad):
    with pytest.raises(node_env.NodeEnvError, match="only letters"):
        node_env.render({"TURNKV_MODEL": bad})


def test_engine_spec_uses_synced_tunables_and_efa_backend():
    env = node_env.parse(node_env.render(_env(mode=Mode.PULL, bidirectional=True).variables()))
    spec = node_env.engine_spec(env, {"decoder_kv_blocks_ttl": 600, "conversation_ttl": 1})
    assert spec.role is Role.DECODE and spec.tensor_parallel_size == 8 and spec.host == "0.0.0.0"
    extra = kv_transfer_config(spec)["kv_connector_extra_config"]
    assert extra["backends"] == ["LIBFABRIC"]
    assert extra["decoder_kv_blocks_ttl"] == 600
    assert "conversation_ttl" not in spec.tunables


def test_engine_spec_names_missing_variables():
    with pytest.raises(node_env.NodeEnvError, match="TURNKV_SIDE_CHANNEL_HOST"):
        node_env.engine_spec({"TURNKV_ROLE": "prefill", "TURNKV_ENGINE_ID": "x", "TURNKV_MODEL": "m"})


def test_node_env_file():
    assert node_env.parse(node_env.render(node_env.NodeEnv("prod", "us-east-2").variables())) == {
        "TURNKV_DEPLOYMENT": "prod", "AWS_REGION": "us-east-2"}


def test_what_infra_writes_is_what_the_node_reads():
    """One spec: EngineEnv written by the user data (infra) parses back, validated, into the same EngineEnv."""
    env = _env(mode=Mode.PUSH, bidirectional=False)
    assert node_env.EngineEnv.from_variables(node_env.parse(node_env.render(env.variables()))) == env
    with pytest.raises(node_env.NodeEnvError, match="TURNKV_TP_SIZE=0 is out of range"):
        node_env.EngineEnv.from_variables({**env.variables(), node_env.TP_SIZE: "0"})


def test_a_node_of_several_engines_gives_each_its_devices_and_ports():
    """TP 4 on an 8-GPU node: two engines, GPUs 0-3 and 4-7, HTTP 8000/8001, side channels from 5600 and 5604
    (a block of TP ports each: vLLMs that listen once per rank use port + rank)."""
    first, second = node_env.engine_slots(2, 4, 8)
    assert first.variables(gpu=True) == {"TURNKV_PORT": "8000", "TURNKV_SIDE_CHANNEL_PORT": "5600",
                                         "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert second.variables(gpu=True) == {"TURNKV_PORT": "8001", "TURNKV_SIDE_CHANNEL_PORT": "5604",
                                          "CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    # Trainium: the Neuron runtime's core range
    assert second.device_variables(gpu=False) == {"NEURON_VISIBLE_DEVICES": "4-7"}
    ones = node_env.engine_slots(8, 1, 8)
    assert [s.devices for s in ones] == [(k,) for k in range(8)]
    assert [s.port for s in ones] == list(range(8000, 8008)) and node_env.http_ports(8) == (8000, 8007)
    # no engine's side channel block overlaps another's, nor any HTTP port
    ports = [p for s in ones for p in range(s.side_channel_port, s.side_channel_port + 1)] + [s.port for s in ones]
    assert len(set(ports)) == len(ports)
    (only,) = node_env.engine_slots(1, 8, 8)
    assert (only.port, only.side_channel_port, only.devices) == (8000, 5600, tuple(range(8)))
    assert node_env.http_ports(1) == (8000, 8000)


@pytest.mark.parametrize(("engines", "tp"), [(0, 4), (3, 4), (2, 8), (1, 16)])
def test_engines_that_do_not_fit_the_node_are_refused(engines, tp):
    with pytest.raises(node_env.NodeEnvError, match="do not fit a node of 8 accelerators"):
        node_env.engine_slots(engines, tp, 8)


def test_a_slot_file_over_engine_env_is_what_the_engine_reads():
    """systemd loads engine.env, then the slot's file (later wins): the spec gets the slot's ports and id."""
    base = _env().variables()
    slot = node_env.engine_slots(2, 4, 8)[1]
    merged = {**base, **slot.variables(gpu=True), node_env.ENGINE_ID: "prod-decode-i-0abc-1"}
    spec = node_env.engine_spec(merged)
    assert (spec.port, spec.side_channel_port, spec.engine_id) == (8001, 5604, "prod-decode-i-0abc-1")
    assert node_env.engine_env_file(1) == "/etc/turnkv/engine-1.env"
    assert node_env.unit_instance(node_env.ENGINE_SERVICE_TEMPLATE, 1) == "turnkv-engine@1.service"
    assert [node_env.slot_suffix(k) for k in range(3)] == ["", "-1", "-2"]


def test_the_devices_a_slot_writes_read_back():
    """What EngineSlot.device_variables writes (CUDA list, Neuron range) is what visible_devices reads."""
    for slot in node_env.engine_slots(4, 2, 8):
        for gpu in (True, False):
            assert node_env.visible_devices(slot.device_variables(gpu)) == slot.devices
    assert node_env.visible_devices({}) is None and node_env.visible_devices({"CUDA_VISIBLE_DEVICES": ""}) is None
    assert node_env.visible_devices({"NEURON_RT_VISIBLE_CORES": "0-1,4"}) == (0, 1, 4)
    for bad in ("a", "3-1", "0,,1", "-1"):
        with pytest.raises(node_env.NodeEnvError, match="CUDA_VISIBLE_DEVICES"):
            node_env.visible_devices({"CUDA_VISIBLE_DEVICES": bad})


def test_a_validation_error_names_the_files_it_came_from():
    with pytest.raises(node_env.NodeEnvError, match=r"^/etc/turnkv/engine\.env: TURNKV_ROLE is missing"):
        node_env.EngineEnv.from_variables({})
    with pytest.raises(node_env.NodeEnvError, match=r"^/etc/turnkv/engine-1\.env over /etc/turnkv/engine\.env: "):
        node_env.EngineEnv.from_variables({}, source="/etc/turnkv/engine-1.env over /etc/turnkv/engine.env")


def test_the_media_allow_list_reaches_vllm_and_refuses_internal_hosts():
    """engine.env's TURNKV_MEDIA_DOMAINS (the router reads the same variable) becomes --allowed-media-domains."""
    from turnkv.engine_args import serve_args

    env = _env(media_domains=("images.example.com", "cdn.example.net"))
    parsed = node_env.parse(node_env.render(env.variables()))
    assert parsed[node_env.MEDIA_DOMAINS] == "images.example.com,cdn.example.net"
    args = serve_args(node_env.EngineEnv.from_variables(parsed).spec())
    at = args.index("--allowed-media-domains")
    assert args[at + 1: at + 3] == ["images.example.com", "cdn.example.net"]
    with pytest.raises(node_env.NodeEnvError, match="internal"):
        node_env.EngineEnv.from_variables({**parsed, node_env.MEDIA_DOMAINS: "images.example.com,2852039166"})
    assert "--allowed-media-domains" not in serve_args(node_env.EngineEnv.from_variables(
        node_env.parse(node_env.render(_env().variables()))).spec())
