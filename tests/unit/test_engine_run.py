"""`turnkv engine run` (turnkv.engine_run and its CLI): engine.env -> EngineSpec -> `vllm serve` argv/env, without
starting vLLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from turnkv import engine_run as engine
from turnkv import params
from turnkv.commands import engine as engine_cli
from turnkv.engine_args import EngineSpec, Mode, Role, serve_args, serve_env

REPO = Path(__file__).resolve().parents[2]
FULL = {
    "TURNKV_ROLE": "decode",
    "TURNKV_ENGINE_ID": "prod-decode-i-0123456789abcdef0",
    "TURNKV_MODEL": "/opt/turnkv/models/qwen3-32b",
    "TURNKV_SERVED_MODEL_NAME": "qwen3-32b",
    "TURNKV_MODE": "push",
    "TURNKV_BIDIRECTIONAL": "false",
    "TURNKV_TP_SIZE": "8",
    "TURNKV_MAX_MODEL_LEN": "32768",
    "TURNKV_PORT": "8000",
    "TURNKV_SIDE_CHANNEL_HOST": "10.0.12.34",
    "TURNKV_SIDE_CHANNEL_PORT": "5600",
    "TURNKV_BACKENDS": "LIBFABRIC",
    "TURNKV_TUNABLES_FILE": "/etc/turnkv/tunables.json",
}


def test_full_env_to_spec():
    spec = engine.spec_from_env(FULL)
    assert spec == EngineSpec(
        role=Role.DECODE, engine_id="prod-decode-i-0123456789abcdef0", model="/opt/turnkv/models/qwen3-32b",
        served_model_name="qwen3-32b", host="0.0.0.0", port=8000, side_channel_host="10.0.12.34",
        side_channel_port=5600, mode=Mode.PUSH, bidirectional=False, tensor_parallel_size=8, max_model_len=32768,
        backends=("LIBFABRIC",), tunables=params.defaults(params.Scope.ENGINE),
        offer_secret_file="/etc/turnkv/offer-secret")
    # the engines sign and verify offers with the deployment's secret (turnkv.wire)
    assert engine.serve_env(spec)["TURNKV_OFFER_SECRET_FILE"] == "/etc/turnkv/offer-secret"
    other = engine.spec_from_env({**FULL, "TURNKV_OFFER_SECRET_FILE": "/run/secret"})
    assert other.offer_secret_file == "/run/secret"


def test_defaults_fill_optional_variables():
    minimal = {k: FULL[k] for k in engine.REQUIRED}
    spec = engine.spec_from_env({**minimal, "TURNKV_SERVED_MODEL_NAME": "", "TURNKV_MODEL_S3_URI": ""})
    assert (spec.mode, spec.bidirectional, spec.tensor_parallel_size, spec.port, spec.side_channel_port,
            spec.backends) == (Mode.PULL, True, 1, 8000, 5600, ("LIBFABRIC",))
    assert spec.served_model_name == FULL["TURNKV_MODEL"]


def test_missing_variables_are_all_named():
    with pytest.raises(engine.EngineEnvError) as err:
        engine.spec_from_env({"TURNKV_MODE": "pull"})
    message = str(err.value)
    for name in ("TURNKV_ROLE", "TURNKV_ENGINE_ID", "TURNKV_MODEL", "TURNKV_SIDE_CHANNEL_HOST"):
        assert f"{name} is missing" in message


@pytest.mark.parametrize(("name", "value", "expected"), [
    ("TURNKV_ROLE", "both", "TURNKV_ROLE='both' must be prefill or decode"),
    ("TURNKV_MODE", "pull-push", "TURNKV_MODE='pull-push' must be pull or push"),
    ("TURNKV_BIDIRECTIONAL", "yes", "TURNKV_BIDIRECTIONAL='yes' must be true or false"),
    ("TURNKV_TP_SIZE", "eight", "TURNKV_TP_SIZE='eight' is not an integer (1..64)"),
    ("TURNKV_TP_SIZE", "0", "TURNKV_TP_SIZE=0 is out of range (1..64)"),
    ("TURNKV_PORT", "70000", "TURNKV_PORT=70000 is out of range (1..65535)"),
    ("TURNKV_SIDE_CHANNEL_PORT", "8000", "TURNKV_PORT and TURNKV_SIDE_CHANNEL_PORT are both 8000"),
    ("TURNKV_SIDE_CHANNEL_HOST", "localhost", "TURNKV_SIDE_CHANNEL_HOST='localhost' is not routable"),
    ("TURNKV_SIDE_CHANNEL_HOST", "127.0.0.1", "is not routable"),
    ("TURNKV_BACKENDS", "LIBFABRIC,EFA", "TURNKV_BACKENDS='LIBFABRIC,EFA': give NIXL backends from"),
    ("TURNKV_ENGINE_ID", "bad id", "TURNKV_ENGINE_ID='bad id'"),
])
def test_invalid_values_are_named(name, value, expected):
    with pytest.raises(engine.EngineEnvError, match=r"^/etc/turnkv/engine\.env: ") as err:
        engine.spec_from_env({**FULL, name: value})
    assert expected in str(err.value)


def test_tunables_file_overrides_defaults_and_ignores_router_tunables():
    files = {"/t.json": json.dumps({"kv_lease_duration": 45, "decoder_kv_blocks_ttl": 600, "conversation_ttl": 400})}
    values, note = engine.load_tunables("/t.json", files.get)
    assert values["kv_lease_duration"] == 45 and values["decoder_kv_blocks_ttl"] == 600
    assert "conversation_ttl" not in values and note == "tunables from /t.json"
    spec = engine.spec_from_env(FULL, values)
    assert json.loads(serve_args(spec)[serve_args(spec).index("--kv-transfer-config") + 1])[
        "kv_connector_extra_config"]["kv_lease_duration"] == 45


def test_missing_tunables_file_means_defaults():
    values, note = engine.load_tunables("/nope.json", {}.get)
    assert values == params.defaults(params.Scope.ENGINE) and "catalog defaults" in note


@pytest.mark.parametrize(("text", "expected"), [
    ("{not json", "not JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"kv_lease_duration": 1}', "kv_lease_duration: 1 is out of range"),
    ('{"no_such_knob": 1}', "unknown tunable 'no_such_knob'"),
])
def test_bad_tunables_file_is_named(text, expected):
    with pytest.raises(engine.EngineEnvError, match=r"TURNKV_TUNABLES_FILE=/t\.json") as err:
        engine.load_tunables("/t.json", {"/t.json": text}.get)
    assert expected in str(err.value)


def test_prepare_syncs_the_model_from_s3_and_serves_it_from_disk():
    ran = []
    argv, env, notes = engine.prepare({**FULL, "TURNKV_MODEL_S3_URI": "s3://models/qwen3-32b/"}, {}.get,
                                      run=lambda cmd: ran.append(list(cmd)) or 0)
    assert ran == [["flock", engine.MODEL_SYNC_LOCK, "aws", "s3", "sync", "--only-show-errors",
                    "s3://models/qwen3-32b/", "/opt/turnkv/models/qwen3-32b"]]
    assert argv[1:3] == ["serve", "/opt/turnkv/models/qwen3-32b"]
    assert argv[argv.index("--served-model-name") + 1] == "qwen3-32b"
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.12.34"
    assert any("model from s3://models/qwen3-32b/" in n for n in notes)


def test_prepare_reports_a_failed_or_bad_model_sync():
    with pytest.raises(engine.EngineEnvError, match="failed with exit code 1"):
        engine.prepare({**FULL, "TURNKV_MODEL_S3_URI": "s3://models/x/"}, {}.get, run=lambda cmd: 1)
    with pytest.raises(engine.EngineEnvError, match="must be an s3:// URL"):
        engine.prepare({**FULL, "TURNKV_MODEL_S3_URI": "https://x/"}, {}.get, run=lambda cmd: 0)


def test_hub_offline_only_when_the_weights_are_local():
    """Weights synced from S3 (or a local path) load offline; a Hugging Face id is downloaded through NAT."""
    _, local, _ = engine.prepare({**FULL, "TURNKV_MODEL_S3_URI": "s3://weights/qwen3-32b/"}, {}.get,
                                 run=lambda cmd: 0)
    assert local["HF_HUB_OFFLINE"] == "1"
    _, hub, _ = engine.prepare({**FULL, "TURNKV_MODEL": "Qwen/Qwen3-32B"}, {}.get, run=lambda cmd: 0)
    assert "HF_HUB_OFFLINE" not in hub


def test_argv_and_env_are_engine_args():
    argv, env, _ = engine.prepare(FULL, {}.get, run=lambda cmd: 0)
    spec = engine.spec_from_env(FULL)
    assert argv[1:] == serve_args(spec) and env == serve_env(spec)
    assert Path(argv[0]).name == "vllm"


@pytest.fixture
def clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("TURNKV_"):
            monkeypatch.delenv(name)
    return monkeypatch


def test_cli_execs_vllm_with_env_and_flags(clean_env, monkeypatch):
    from turnkv.cli import app

    for name, value in FULL.items():
        clean_env.setenv(name, value)
    clean_env.setenv("TURNKV_TUNABLES_FILE", "/nonexistent/tunables.json")
    execs = []
    monkeypatch.setattr(engine_cli.os, "execvpe", lambda file, argv, env: execs.append((file, argv, env)))
    result = CliRunner().invoke(app, ["engine", "run", "--tp-size", "4", "--role", "prefill"])
    assert result.exit_code == 0, result.output
    ((file, argv, env),) = execs
    assert file == argv[0] and argv[1] == "serve"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "4"
    assert '"engine_id":"prod-decode-i-0123456789abcdef0"' in argv[argv.index("--kv-transfer-config") + 1]
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.12.34" and env["HF_HUB_OFFLINE"] == "1"
    assert "prefill engine" in result.output


def test_cli_env_file_and_dry_run(clean_env, tmp_path):
    from turnkv.cli import app

    env_file = tmp_path / "engine.env"
    env_file.write_text("# test\n" + "".join(f"{k}={v}\n" for k, v in FULL.items())
                        + f"TURNKV_TUNABLES_FILE={tmp_path}/t.json\n")
    (tmp_path / "t.json").write_text(json.dumps({"kv_recompute_threshold": 128}))
    result = CliRunner().invoke(app, ["engine", "run", "--env-file", str(env_file), "--dry-run"])
    assert result.exit_code == 0, result.output
    body = json.loads(result.output[result.output.index("{"):result.output.rindex("}") + 1])
    assert '"kv_recompute_threshold":128' in body["argv"][body["argv"].index("--kv-transfer-config") + 1]


def test_cli_names_the_bad_variable_and_exits_2(clean_env):
    from turnkv.cli import app

    clean_env.setenv("TURNKV_ROLE", "prefill")
    result = CliRunner().invoke(app, ["engine", "run", "--dry-run"])
    assert result.exit_code == 2
    assert "TURNKV_ENGINE_ID is missing" in result.output and "TURNKV_SIDE_CHANNEL_HOST is missing" in result.output


def test_template_and_unit_speak_the_same_variables():
    names = {getattr(engine_cli, n) for n in ("ROLE", "ENGINE_ID", "MODEL", "SERVED_MODEL_NAME", "MODE",
                                               "BIDIRECTIONAL", "TP_SIZE", "MAX_MODEL_LEN", "PORT",
                                               "SIDE_CHANNEL_HOST", "SIDE_CHANNEL_PORT", "BACKENDS", "TUNABLES_FILE",
                                               "MODEL_S3_URI")}
    template = (REPO / "ami/scripts/files/engine.env.template").read_text()
    in_template = {line.split("=", 1)[0] for line in template.splitlines() if line and not line.startswith("#")}
    assert in_template == names
    defaults = engine.parse_env_file(template)
    for name, value in engine.DEFAULTS.items():
        if name not in {"TURNKV_TP_SIZE", "TURNKV_MAX_MODEL_LEN"}:  # the template suggests p5en-sized values
            assert defaults[name] == value, name
    unit = (REPO / "ami/scripts/files/turnkv-engine.service").read_text()
    assert "EnvironmentFile=/etc/turnkv/engine.env\n" in unit
    assert "ExecStart=/opt/turnkv/venv/bin/turnkv engine run\n" in unit
    sync = (REPO / "ami/scripts/files/turnkv-params-sync.service").read_text()
    assert "EnvironmentFile=/etc/turnkv/node.env\n" in sync
    assert ("ExecStart=/opt/turnkv/venv/bin/turnkv params sync --deployment ${TURNKV_DEPLOYMENT} "
            "--region ${AWS_REGION} --out /etc/turnkv/tunables.json\n") in sync
    assert "TURNKV_DEPLOYMENT=" in (REPO / "ami/scripts/files/node.env.template").read_text()


def test_names_and_spec_agree_with_node_env():
    """turnkv/node_env.py (branch infra) writes engine.env; once merged, both sides must agree."""
    node_env = pytest.importorskip("turnkv.node_env", reason="turnkv/node_env.py arrives with branch infra")
    for name in ("ROLE", "ENGINE_ID", "MODEL", "SERVED_MODEL_NAME", "MODE", "BIDIRECTIONAL", "TP_SIZE",
                 "MAX_MODEL_LEN", "PORT", "SIDE_CHANNEL_HOST", "SIDE_CHANNEL_PORT", "BACKENDS", "MODEL_S3_URI"):
        assert getattr(engine_cli, name) == getattr(node_env, name), name
    assert engine_cli.TUNABLES_FILE == engine.TUNABLES_FILE == node_env.TUNABLES_FILE_VAR
    assert engine_cli.ENGINE_ENV_FILE == node_env.ENGINE_ENV_FILE
    assert engine.spec_from_env(FULL) == node_env.engine_spec(FULL)


def test_neuron_node_stops_at_start_naming_what_is_unverified_without_a_restart_loop():
    files = {engine.FLAVOR_FILE: "neuron\n"}
    with pytest.raises(engine.EngineEnvError, match="unverified on neuron") as err:
        engine.prepare(FULL, files.get, run=lambda cmd: 0)
    assert "bi-directional" in str(err.value) and "TURNKV_ALLOW_UNVERIFIED=neuron" in str(err.value)
    allowed = {**FULL, "TURNKV_ALLOW_UNVERIFIED": "neuron"}
    with pytest.raises(engine.EngineEnvError, match="push mode on Neuron: the vllm-neuron DI docs run read mode only"):
        engine.prepare(allowed, files.get, run=lambda cmd: 0)  # FULL is push: refused on Neuron, also exit 2
    argv, env, _ = engine.prepare({**allowed, "TURNKV_MODE": "pull"}, files.get, run=lambda cmd: 0)
    assert argv[1] == "serve"
    # What the cited facts (turnkv.neuron) ask of a Neuron engine: the plugin's platform allow-listed, device-memory
    # KV buffers, libfabric off shared memory, decode's warmup skipped on prefill only (decode recomputes a failed
    # READ, so it keeps prefill's graphs), and the bucket configuration prefix caching needs.
    assert env["VLLM_PLUGINS"] == "turnkv,turnkv-leases,neuron" and env["FI_EFA_ENABLE_SHM_TRANSFER"] == "0"
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config["kv_buffer_device"] == "cuda" and config["kv_connector_extra_config"]["backends"] == ["LIBFABRIC"]
    assert "VLLM_NEURON_SKIP_PREFILL_WARMUP" not in env
    assert ("VLLM_NEURON_SKIP_DECODE_WARMUP" in env) == (FULL["TURNKV_ROLE"] == "prefill")
    assert "kv_segment_size_buckets" in argv[argv.index("--additional-config") + 1]
    gpu_argv, gpu_env, _ = engine.prepare(FULL, {engine.FLAVOR_FILE: "gpu\n"}.get, run=lambda cmd: 0)
    assert gpu_env["VLLM_PLUGINS"] == "turnkv,turnkv-leases" and "kv_buffer_device" not in gpu_argv[
        gpu_argv.index("--kv-transfer-config") + 1]
    engine.prepare(FULL, {engine.FLAVOR_FILE: "gpu\n"}.get, run=lambda cmd: 0)  # GPU: verified, starts
    # `turnkv engine run` exits 2 on a refused configuration; systemd must not restart it.
    unit = (REPO / "ami/scripts/files/turnkv-engine.service").read_text()
    assert "\nRestartPreventExitStatus=2\n" in unit and "\nRestart=on-failure\n" in unit


def test_one_parser_for_every_engine_env_reader():
    from turnkv import doctor, node_env

    text = "TURNKV_MODEL='/m'\nTURNKV_ROLE=\"prefill\"\n# comment\nTURNKV_PORT=8000\n"
    expected = {"TURNKV_MODEL": "/m", "TURNKV_ROLE": "prefill", "TURNKV_PORT": "8000"}
    assert node_env.parse(text) == engine.parse_env_file(text) == doctor.parse_env_file(text) == expected
    assert engine.DEFAULTS is node_env.ENGINE_DEFAULTS


def test_the_engines_of_a_node_sync_the_weights_one_at_a_time(tmp_path, monkeypatch):
    """Several engines on a node share one model folder: their syncs run under one flock(1), so the second starts
    when the first is done (and then finds nothing to copy), instead of both downloading the same files."""
    import shutil
    import subprocess
    import threading
    import time

    if not shutil.which("flock"):
        pytest.skip("flock(1) not installed")
    log = tmp_path / "log"
    fake = tmp_path / "bin" / "aws"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "start $$" >> {log}\nsleep 0.3\necho "end $$" >> {log}\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:/usr/bin:/bin")
    monkeypatch.setattr(engine, "MODEL_SYNC_LOCK", str(tmp_path / "sync.lock"))
    codes = []
    threads = [threading.Thread(target=lambda: codes.append(engine.sync_model(
        "s3://models/x/", str(tmp_path / "x"), lambda cmd: subprocess.run(list(cmd)).returncode)))
        for _ in range(2)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    events = [line.split()[0] for line in log.read_text().splitlines()]
    assert events == ["start", "end", "start", "end"] and time.monotonic() - started >= 0.6


def test_the_engine_env_a_config_gives_runs_dry_as_the_help_says(tmp_path):
    """Issue #49: `turnkv config engine-env FILE > F; turnkv engine run --env-file F --dry-run`, as both helps say,
    failed naming /etc/turnkv/engine.env: F leaves out the instance's id and address (user data writes them at
    boot). The dry run shows stand-ins for them and says so; a real run's error names the file it read."""
    import yaml

    from tests.infra import configs
    from turnkv.cli import app
    from turnkv.node_env import INSTANCE_PLACEHOLDERS

    deploy, env_file = tmp_path / "deploy.yaml", tmp_path / "engine.env"
    deploy.write_text(yaml.safe_dump(configs.GPU))
    runner = CliRunner()
    printed = runner.invoke(app, ["config", "engine-env", str(deploy)])
    assert printed.exit_code == 0, printed.output
    env_file.write_text(printed.stdout)
    dry = runner.invoke(app, ["engine", "run", "--env-file", str(env_file), "--dry-run", "--flavor", "gpu"])
    assert dry.exit_code == 0, dry.output
    assert "stand-ins here: " + ", ".join(INSTANCE_PLACEHOLDERS.values()) in dry.stderr
    assert json.loads(dry.stdout)["argv"][1] == "serve"
    env_file.write_text("TURNKV_ROLE=prefill\n")
    real = runner.invoke(app, ["engine", "run", "--env-file", str(env_file)])
    assert real.exit_code == 2 and f"{env_file}: TURNKV_ENGINE_ID is missing" in real.stderr
