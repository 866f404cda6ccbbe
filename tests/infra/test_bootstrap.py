"""Engine node user data (infra/bootstrap.py): valid bash (bash -n, shellcheck), the env-file contract,
CloudWatch agent config with GPU, EFA and the EMF listener."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from infra import bootstrap
from turnkv import metric_names as mn
from turnkv import node_env
from turnkv.engine_args import Mode, Role

pytestmark = pytest.mark.infra


def _node(**kw) -> bootstrap.NodeBootstrap:
    base = dict(deployment="prod", region="us-east-2", pool="decode", role=Role.DECODE, gpu=True,
                model="Qwen/Qwen3-32B", served_model_name="qwen3-32b", mode=Mode.PULL, bidirectional=True,
                tp_size=8, max_model_len=32768, cloudmap_service_id="srv-abcdefgh12345678",
                log_group="/turnkv/prod/engines", model_s3_uri="s3://weights/qwen3/")
    base.update(kw)
    return bootstrap.NodeBootstrap(**base)


def _heredoc(script: str, path: str) -> str:
    m = re.search(rf"cat > {re.escape(path)} <<'TURNKV_EOF'\n(.*?)TURNKV_EOF\n", script, re.S)
    assert m, path
    return m.group(1)


@pytest.mark.parametrize("gpu", [True, False])
def test_user_data_is_valid_bash(tmp_path, gpu):
    script = bootstrap.user_data(_node(gpu=gpu))
    path = tmp_path / "user-data.sh"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True)
    register = tmp_path / "register.sh"
    register.write_text(_heredoc(script, bootstrap.REGISTER_SCRIPT))
    subprocess.run(["bash", "-n", str(register)], check=True)
    if shutil.which("shellcheck"):
        for p in (path, register):
            done = subprocess.run(["shellcheck", "-S", "warning", "-e", "SC1091", str(p)],
                                  capture_output=True, text=True)
            assert done.returncode == 0, done.stdout


def test_engine_env_written_by_user_data_follows_the_contract():
    script = bootstrap.user_data(_node())
    static = node_env.parse(_heredoc(script, f"{node_env.ENGINE_ENV_FILE}.new"))
    assert static[node_env.ROLE] == "decode" and static[node_env.BACKENDS] == "LIBFABRIC"
    assert static[node_env.TP_SIZE] == "8" and static[node_env.MODEL_S3_URI] == "s3://weights/qwen3/"
    assert static[node_env.TUNABLES_FILE_VAR] == "/etc/turnkv/tunables.json"
    assert not set(node_env.RUNTIME_VARIABLES) & set(static)
    # the runtime ones come from IMDS on the instance
    assert re.search(r"printf '%s=%s\\n' TURNKV_ENGINE_ID \"\$ENGINE_ID\" TURNKV_SIDE_CHANNEL_HOST \"\$IP\"", script)
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST \"$IP\"" in script
    node = node_env.parse(_heredoc(script, node_env.NODE_ENV_FILE))
    assert node == {"TURNKV_DEPLOYMENT": "prod", "AWS_REGION": "us-east-2"}
    # tunables before the engine, then the units in order
    order = [script.index(s) for s in ("params sync", "amazon-cloudwatch-agent-ctl",
                                       f"enable --now {node_env.PARAMS_SYNC_TIMER}",
                                       f"enable --now {node_env.ENGINE_SERVICE}",
                                       f"start --no-block {node_env.REGISTER_SERVICE}")]
    assert order == sorted(order)
    assert "X-aws-ec2-metadata-token" in script  # IMDSv2


def test_registration_attributes():
    script = bootstrap.register_script(_node(role=Role.PREFILL, tp_size=4))
    attrs = re.search(r'--attributes "([^"]+)"', script).group(1)
    pairs = dict(kv.split("=", 1) for kv in attrs.split(","))
    assert pairs["role"] == "prefill" and pairs["tp_size"] == "4" and pairs["side_channel_port"] == "5600"
    assert pairs["engine_id"] == "$ENGINE_ID" and pairs["side_channel_host"] == "$IP"
    assert pairs["AWS_INSTANCE_IPV4"] == "$IP" and pairs["AWS_INSTANCE_PORT"] == pairs["http_port"] == "8000"
    assert "deregister-instance" in script and "/health" in script


def test_cloudwatch_agent_config():
    cfg = bootstrap.agent_config(_node())
    collected = cfg["metrics"]["metrics_collected"]
    assert "nvidia_gpu" in collected and "utilization_gpu" in collected["nvidia_gpu"]["measurement"]
    assert set(mn.EFA_MEASUREMENTS) == set(collected["efa"]["measurement"])
    assert cfg["logs"]["metrics_collected"] == {"emf": {"service_address": "tcp://127.0.0.1:25888"}}
    assert "nvidia_gpu" not in bootstrap.agent_config(_node(gpu=False))["metrics"]["metrics_collected"]


def test_metrics_bridge_unit_runs_the_bridge_against_the_engine(monkeypatch):
    import turnkv.emf_bridge as bridge

    unit = bootstrap.metrics_unit(_node(pool="decode-a"))
    exec_start = re.search(r"^ExecStart=(.*?)\n(?=\S)", unit, re.M | re.S).group(1)
    argv = exec_start.replace("\\\n", " ").split()
    assert argv[:3] == ["/opt/turnkv/venv/bin/python", "-m", "turnkv.emf_bridge"]
    seen = {}
    monkeypatch.setattr(bridge, "run", lambda url, dims, log_group, interval, address: seen.update(
        url=url, dims=dims, log_group=log_group, address=address))
    assert bridge.main(argv[3:]) == 0
    assert seen == {"url": "http://127.0.0.1:8000/metrics", "log_group": "/turnkv/prod/engines",
                    "dims": {"Deployment": "prod", "Role": "decode", "Pool": "decode-a"},
                    "address": ("127.0.0.1", 25888)}
    assert "Restart=always" in unit
