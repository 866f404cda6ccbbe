import json

from turnkv import engine_args
from turnkv.engine_args import EngineSpec, Mode, Role


def spec(**kw):
    base = dict(role=Role.PREFILL, engine_id="p0", model="/m", port=8100, side_channel_port=5600)
    return EngineSpec(**{**base, **kw})


def kv_config(args):
    return json.loads(args[args.index("--kv-transfer-config") + 1])


def test_pull_bidirectional_defaults():
    args = engine_args.serve_args(spec(prefix_caching=False, enforce_eager=True))
    config = kv_config(args)
    assert config["kv_connector"] == "TurnkvPullConnector" and config["kv_connector_module_path"] == "connector.pull"
    assert config["engine_id"] == "p0"
    assert config["kv_load_failure_policy"] == "recompute"
    extra = config["kv_connector_extra_config"]
    assert extra["bidirectional_kv_xfer"] is True
    assert extra["decoder_kv_blocks_ttl"] == 480 and extra["kv_recompute_threshold"] == 64
    assert "--no-enable-prefix-caching" in args and "--enforce-eager" in args
    assert args[args.index("--block-size") + 1] == "128"


def test_push_mode_runs_turnkv_push_bidirectional_and_efa_backend():
    config = kv_config(engine_args.serve_args(spec(mode=Mode.PUSH, backends=("LIBFABRIC",))))
    assert config["kv_connector"] == "TurnkvPushConnector" and config["kv_connector_module_path"] == "connector.push"
    assert config["kv_connector_extra_config"]["bidirectional_kv_xfer"] is True
    assert config["kv_connector_extra_config"]["backends"] == ["LIBFABRIC"]


def test_upstream_push_connector_never_gets_bidirectional():
    config = kv_config(engine_args.serve_args(spec(mode=Mode.PUSH, connector="NixlPushConnector")))
    assert config["kv_connector"] == "NixlPushConnector" and "kv_connector_module_path" not in config
    assert config["kv_connector_extra_config"]["bidirectional_kv_xfer"] is False


def test_env_names_the_side_channel():
    env = engine_args.serve_env(spec(side_channel_host="10.0.0.5"))
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.0.5" and env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"


def test_engines_export_no_created_series_on_nodes_and_in_the_local_stack(tmp_path):
    """vLLM keeps prometheus_client's ``*_created`` sample beside every counter; the router drops its own. The
    engine's environment (``turnkv engine run`` and ``turnkv local up`` both take serve_env) turns them off, and
    the prometheus_client the engines import honours it."""
    import subprocess
    import sys

    from turnkv.local import stack

    env = engine_args.serve_env(spec())
    assert env[engine_args.PROMETHEUS_DISABLE_CREATED] == "True"
    assert engine_args.PROMETHEUS_DISABLE_CREATED == "PROMETHEUS_DISABLE_CREATED_SERIES"
    engines = [p for p in stack.plan(stack.StackConfig(state_dir=tmp_path)) if p.name != "router"]
    assert engines and all(p.env[engine_args.PROMETHEUS_DISABLE_CREATED] == "True" for p in engines)
    probe = ("from prometheus_client import CollectorRegistry, Counter, generate_latest\n"
             "r = CollectorRegistry(); Counter('x', 'x', registry=r).inc()\n"
             "print(generate_latest(r).decode())")
    shown = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                           env={"PATH": "/usr/bin:/bin", engine_args.PROMETHEUS_DISABLE_CREATED: "True"}).stdout
    default = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                             env={"PATH": "/usr/bin:/bin"}).stdout
    assert "x_total 1.0" in shown and "x_created" not in shown
    assert "x_created" in default  # the probe can see the series it checks for
