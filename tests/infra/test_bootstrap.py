"""Engine node user data (infra/bootstrap.py): valid bash (bash -n, shellcheck), the env-file contract,
CloudWatch agent config with GPU, EFA and the EMF listener."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

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
    # the engine's weight sync (aws s3 sync) needs the region: through the S3 gateway endpoint, not us-east-1
    assert "AWS_REGION 'us-east-2' >> /etc/turnkv/engine.env.new" in script
    node = node_env.parse(_heredoc(script, node_env.NODE_ENV_FILE))
    assert node == {"TURNKV_DEPLOYMENT": "prod", "AWS_REGION": "us-east-2"}
    # tunables before the engine, then the units in order
    order = [script.index(s) for s in ("params sync", "amazon-cloudwatch-agent-ctl",
                                       f"systemctl enable {node_env.PARAMS_SYNC_TIMER}",
                                       f"start {node_env.PARAMS_SYNC_TIMER}",
                                       f"start {node_env.ENGINE_SERVICE}",
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


def test_each_engines_metrics_bridge_names_its_engine(monkeypatch):
    """A node of several engines: each turnkv-metrics@k scrapes its engine's port and publishes with that engine's
    id (from its slot file), so CloudWatch tells the node's engines apart."""
    import turnkv.emf_bridge as bridge

    unit = bootstrap.slot_metrics_unit(_node(pool="decode-a", tp_size=4, engines=2))
    exec_start = re.search(r"^ExecStart=(.*?)\n(?=\S)", unit, re.M | re.S).group(1).replace("\\\n", " ")
    seen = []
    monkeypatch.setattr(bridge, "run", lambda url, dims, log_group, interval, address: seen.append((url, dims)))
    script = bootstrap.user_data(_node(pool="decode-a", tp_size=4, engines=2))
    for line, path in re.findall(r"^printf '%s=%s\\n' (.*) > (/etc/turnkv/engine-\d\.env)$", script, re.M):
        words = line.replace('"$ENGINE_ID', '"i-0abc').replace('"', "").split()
        slot_env = dict(zip(words[::2], words[1::2], strict=True))
        argv = re.sub(r"\$\{(\w+)\}", lambda m, env=slot_env: env[m.group(1)], exec_start).split()
        assert bridge.main(argv[3:]) == 0, path
    assert [url for url, _ in seen] == ["http://127.0.0.1:8000/metrics", "http://127.0.0.1:8001/metrics"]
    assert [dims.get(mn.ENGINE_ID) for _, dims in seen] == ["i-0abc", "i-0abc-1"]
    assert all({mn.DEPLOYMENT: "prod", mn.ROLE: "decode", mn.POOL: "decode-a"}.items() <= dims.items()
               for _, dims in seen)


def test_engine_register_and_metrics_logs_reach_cloudwatch_logs():
    """The agent ships files, not journald: each unit's output goes to its own file (a systemd drop-in written
    before the units start), and the agent config collects exactly those files, one stream each."""
    import fnmatch

    node = _node()
    script = bootstrap.user_data(node)
    collected = bootstrap.agent_config(node)["logs"]["logs_collected"]["files"]["collect_list"]
    for unit in (node_env.ENGINE_SERVICE, node_env.REGISTER_SERVICE, bootstrap.METRICS_SERVICE):
        dropin = _heredoc(script, f"/etc/systemd/system/{unit}.d/10-turnkv-logs.conf")
        (target,) = set(re.findall(r"^Standard(?:Output|Error)=append:(\S+)$", dropin, re.M))
        entries = [e for e in collected if fnmatch.fnmatch(target, e["file_path"])]
        assert len(entries) == 1, (unit, target)
        assert entries[0]["log_group_name"] == node.log_group
        assert script.index(f"{unit}.d/10-turnkv-logs.conf") < script.index("systemctl daemon-reload")
    assert len({e["log_stream_name"] for e in collected}) == len(collected)
    assert "copytruncate" in _heredoc(script, "/etc/logrotate.d/turnkv")


NVME_STUBS = {
    "mountpoint": '[[ "$FAKE_DLAMI_NVME" == 1 && "$2" == /opt/dlami/nvme ]]',
    "lsblk": 'for i in $(seq 1 "$FAKE_NVME_DISKS"); do echo "/dev/nvme${i}n1 Amazon EC2 NVMe Instance Storage"; done\n'
             'echo "/dev/nvme0n1 Amazon Elastic Block Store"',
    "mdadm": "", "mkfs.ext4": "", "mount": "", "install": "", "blkid": "echo 0b1c-uuid",
}


def _nvme(tmp_path, dlami: bool, disks: int) -> list[str]:
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    log = tmp_path / "calls.log"
    log.write_text("")
    for name, body in NVME_STUBS.items():
        (stubs / name).write_text(f'#!/bin/bash\necho "{name} $*" >> "{log}"\n{body}\n')
        (stubs / name).chmod(0o755)
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "FAKE_DLAMI_NVME": "1" if dlami else "0", "FAKE_NVME_DISKS": str(disks)}
    fstab = tmp_path / "fstab"
    fstab.write_text("")
    script = bootstrap.NVME_SCRIPT.replace(bootstrap.FSTAB, str(fstab))
    subprocess.run(["bash", "-euo", "pipefail", "-c", script], env=env, check=True)
    calls = [c for c in log.read_text().splitlines() if not c.startswith(("mountpoint", "lsblk", "blkid"))]
    return calls + [f"fstab: {line}" for line in fstab.read_text().splitlines()]


def test_weights_go_to_the_instance_nvme_when_there_is_some(tmp_path):
    models = bootstrap.MODELS_DIR
    dlami = _nvme(tmp_path, dlami=True, disks=8)
    assert dlami[-2] == f"mount --bind /opt/dlami/nvme/turnkv-models {models}"
    # the mounts survive a reboot (user data does not run again): fstab, nofail
    assert dlami[-1] == (f"fstab: /opt/dlami/nvme/turnkv-models {models} none "
                         "bind,nofail,x-systemd.requires-mounts-for=/opt/dlami/nvme 0 0")
    calls = _nvme(tmp_path, dlami=False, disks=8)
    assert "fstab: UUID=0b1c-uuid /mnt/turnkv-nvme ext4 noatime,nofail 0 2" in calls
    calls = [c for c in calls if not c.startswith("fstab: ")]
    assert calls[0].startswith("mdadm --create /dev/md/turnkv --run --level=0 --raid-devices=8 /dev/nvme1n1")
    assert "mkfs.ext4 -q -F -E nodiscard /dev/md/turnkv" in calls
    assert calls[-1] == f"mount --bind /mnt/turnkv-nvme/turnkv-models {models}"
    calls = [c for c in _nvme(tmp_path, dlami=False, disks=1) if not c.startswith("fstab: ")]
    assert not any(c.startswith("mdadm") for c in calls) and "mkfs.ext4 -q -F -E nodiscard /dev/nvme1n1" in calls
    assert _nvme(tmp_path, dlami=False, disks=0) == []  # no instance store: the root volume, nothing mounted
    assert models == __import__("turnkv.engine_run", fromlist=["MODELS_DIR"]).MODELS_DIR


def test_a_failing_user_data_marks_the_instance_unhealthy(tmp_path):
    """The exit trap runs on any failure after it is set: the group replaces a node that will never serve."""
    script = bootstrap.user_data(_node())
    start = script.index("mark_unhealthy() {")
    end = script.index("trap on_exit EXIT") + len("trap on_exit EXIT")
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    calls = tmp_path / "aws-calls"
    (fake_bin / "aws").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (fake_bin / "aws").chmod(0o755)
    env = {"PATH": f"{fake_bin}:/usr/bin:/bin", "INSTANCE_ID": "i-0abc"}
    for tail, fails in (("false", True), ("true", False)):
        calls.unlink(missing_ok=True)
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", f"{script[start:end]}\n{tail}\n"], env=env,
                              capture_output=True, text=True)
        assert (done.returncode != 0) == fails
        if fails:
            assert calls.read_text().split() == ["autoscaling", "set-instance-health", "--region", "us-east-2",
                                                 "--instance-id", "i-0abc", "--health-status", "Unhealthy",
                                                 "--no-should-respect-grace-period"]
        else:
            assert not calls.exists()


def _slots_script(**kw) -> str:
    return bootstrap.user_data(_node(tp_size=4, engines=2, signal_stack="turnkv-prod-serving",
                                     signal_resource="EngineGroupDecode", **kw))


@pytest.mark.parametrize("engines,tp", [(2, 4), (8, 1)])
def test_a_node_of_several_engines_is_valid_bash_and_fits_ec2s_user_data_limit(tmp_path, engines, tp):
    script = bootstrap.user_data(_node(
        tp_size=tp, engines=engines, signal_stack="turnkv-prod-serving", signal_resource="EngineGroupDecode",
        group="turnkv-prod-decode-block",  # the drain agent's line (issue 46) is measured too
        # tokens resolve at deploy time: stand-ins as long as the real values
        cloudmap_service_id="srv-abcdefghijklmnop",
        offer_secret_id="arn:aws:secretsmanager:us-east-2:123456789012:secret:turnkv-prod/engine-offer-secret-AbCdEf"))
    # EC2: user data is limited to 16 KB before base64 encoding.
    assert len(script.encode()) < 16 * 1024
    assert f"engine drain --group turnkv-prod-decode-block --timeout 900 --engines {engines}" in script
    paths = {"user-data.sh": script, "register.sh": _heredoc(script, bootstrap.REGISTER_SCRIPT)}
    for name, text in paths.items():
        (tmp_path / name).write_text(text)
        subprocess.run(["bash", "-n", str(tmp_path / name)], check=True)
        if shutil.which("shellcheck"):
            done = subprocess.run(["shellcheck", "-S", "warning", "-e", "SC1091", str(tmp_path / name)],
                                  capture_output=True, text=True)
            assert done.returncode == 0, done.stdout


def test_each_engine_gets_its_devices_ports_ids_and_template_units():
    script = _slots_script()
    # engine.env is the node's shared file, as for one engine; each slot's file sets what differs
    static = node_env.parse(_heredoc(script, f"{node_env.ENGINE_ENV_FILE}.new"))
    assert static[node_env.TP_SIZE] == "4" and static[node_env.PORT] == "8000"
    files = dict(re.findall(r"^printf '%s=%s\\n' (.*) > (/etc/turnkv/engine-\d\.env)$", script, re.M))
    assert sorted(files.values()) == ["/etc/turnkv/engine-0.env", "/etc/turnkv/engine-1.env"]
    by_file = {path: line for line, path in files.items()}
    assert by_file["/etc/turnkv/engine-0.env"] == (
        'TURNKV_PORT 8000 TURNKV_SIDE_CHANNEL_PORT 5600 CUDA_VISIBLE_DEVICES 0,1,2,3 '
        'TURNKV_ENGINE_ID "$ENGINE_ID" TURNKV_CLOUDMAP_INSTANCE_ID "$INSTANCE_ID"')
    assert by_file["/etc/turnkv/engine-1.env"] == (
        'TURNKV_PORT 8001 TURNKV_SIDE_CHANNEL_PORT 5604 CUDA_VISIBLE_DEVICES 4,5,6,7 '
        'TURNKV_ENGINE_ID "$ENGINE_ID-1" TURNKV_CLOUDMAP_INSTANCE_ID "$INSTANCE_ID-1"')
    # the AMI's engine unit as a template: engine.env, then the slot's file over it
    unit = _heredoc(script, "/etc/systemd/system/turnkv-engine@.service")
    assert ("EnvironmentFile=/etc/turnkv/engine.env\nEnvironmentFile=/etc/turnkv/engine-%i.env\n" in unit
            and "ConditionPathExists=/etc/turnkv/engine-%i.env\n" in unit)
    assert "ExecStart=/opt/turnkv/venv/bin/turnkv engine run\n" in unit and "RestartPreventExitStatus=2\n" in unit
    register_unit = _heredoc(script, "/etc/systemd/system/turnkv-register@.service")
    assert "ExecStart=/usr/local/sbin/turnkv-register register %i\n" in register_unit
    assert "ExecStop=/usr/local/sbin/turnkv-register deregister %i\n" in register_unit
    metrics = _heredoc(script, "/etc/systemd/system/turnkv-metrics@.service")
    assert "--metrics-url http://127.0.0.1:${TURNKV_PORT}/metrics" in metrics
    assert "EnvironmentFile=/etc/turnkv/engine-%i.env" in metrics
    # every engine enabled and started; the single units are not
    assert ("systemctl enable turnkv-params-sync.timer turnkv-engine@{0..1}.service turnkv-register@{0..1}.service "
            "turnkv-metrics@{0..1}.service") in script  # turnkv-drain.service follows where the pool names its group
    assert "systemctl start turnkv-engine@{0..1}.service\n" in script
    assert "systemctl start --no-block turnkv-register@{0..1}.service turnkv-metrics@{0..1}.service" in script
    assert "systemctl start turnkv-engine.service" not in script
    # one log stream per engine
    streams = [f["log_stream_name"] for f in bootstrap.agent_config(_node(tp_size=4, engines=2))
               ["logs"]["logs_collected"]["files"]["collect_list"]]
    assert streams == [f"{{instance_id}}/{n}" for n in ("user-data", "engine-0", "engine-1", "register", "metrics",
                                                        "params-sync")]
    assert "append:/var/log/turnkv/engine-%i.log" in script


def test_each_engine_registers_itself_with_its_own_port_and_the_node_signals_once_all_are_in():
    register = _heredoc(_slots_script(), bootstrap.REGISTER_SCRIPT)
    attrs = dict(kv.split("=", 1) for kv in re.search(r'--attributes "([^"]+)"', register).group(1).split(","))
    assert attrs["AWS_INSTANCE_PORT"] == attrs["http_port"] == "$PORT"
    assert attrs["side_channel_port"] == "$TURNKV_SIDE_CHANNEL_PORT" and attrs["tp_size"] == "4"
    assert '--instance-id "$CLOUDMAP_ID"' in register and 'CLOUDMAP_ID="$TURNKV_CLOUDMAP_INSTANCE_ID"' in register
    assert '. "/etc/turnkv/engine-$SLOT.env"' in register
    assert 'curl -fsS -m 5 "http://127.0.0.1:$PORT/health"' in register
    assert "if ((n >= 2)) && [[ ! -e /run/turnkv/signalled ]]" in register and "flock 9" in register
    assert "mark_unhealthy" in register and "deregister-instance" in register


def test_one_engine_per_node_keeps_the_user_data_of_before():
    """TP 8 on p5en: one engine, the single units and engine.env, as before (a changed launch template would roll
    every node of an existing deployment)."""
    one = bootstrap.user_data(_node(engines=1))
    assert "turnkv-engine@" not in one and "engine-0.env" not in one
    assert "systemctl start turnkv-engine.service" in one
    assert bootstrap.user_data(_node()) == one


def test_the_engine_template_follows_the_amis_unit_or_stops_the_synth():
    with pytest.raises(ValueError, match=r"no longer reads /etc/turnkv/engine\.env"):
        bootstrap.engine_template_unit("[Service]\nEnvironmentFile=/etc/turnkv/other.env\n")


# --- A dead engine reaches Cloud Map and the group -------------------------------------------------------------
# The rendered register script runs for real against a real HTTP "engine" on 127.0.0.1 (killed with SIGKILL), with
# fakes for what only exists on an instance: IMDS (curl for 169.254.169.254), the AWS CLI (records its calls),
# systemctl (the engine unit's state, which the test sets as systemd would) and sleep (fast). The unit semantics
# (BindsTo=: systemd stops this unit, running ExecStop, when the engine fails or stops, and restarts it with the
# engine's automatic restart) are systemd's; the test plays that part and checks the rendered units with
# `systemd-analyze verify`.

FAKES = {
    "curl": 'case "$*" in\n'
            '  *169.254.169.254/latest/api/token*) echo tok ;;\n'
            '  *169.254.169.254/latest/meta-data/instance-id*) echo i-0abc ;;\n'
            '  *169.254.169.254*) echo "fake curl: unexpected IMDS call: $*" >&2; exit 22 ;;\n'
            '  *) exec /usr/bin/curl "$@" ;;\nesac',
    "aws": 'echo "$*" >> "$FAKE/calls"',
    "systemctl": 'case "$*" in\n'
                 '  "show -p ActiveState --value $FAKE_UNIT") cat "$FAKE/state" ;;\n'
                 '  "show -p Result --value $FAKE_UNIT") cat "$FAKE/result" ;;\n'
                 '  is-system-running) cat "$FAKE/system" ;;\n'
                 '  *) echo "fake systemctl: unexpected: $*" >&2; exit 64 ;;\nesac',
    "sleep": 'echo "$1" >> "$FAKE/sleeps"; exec /bin/sleep 0.05',
}


class Node:
    """One rendered register unit with its script, run the way systemd runs it (ExecStart, then ExecStop)."""

    def __init__(self, tmp_path, engines: int):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.dir = tmp_path
        node = _node(port=self.port, engines=engines, tp_size=8 // engines, signal_stack="turnkv-prod-serving",
                     signal_resource="EngineGroupDecode")
        script = bootstrap.user_data(node)
        (tmp_path / "etc").mkdir()
        (tmp_path / "etc" / "engine.env").write_text(
            "TURNKV_ENGINE_ID=prod-decode-i-0abc\nTURNKV_SIDE_CHANNEL_HOST=10.0.0.5\n")
        unit = bootstrap.SLOT_REGISTER_UNIT if engines > 1 else bootstrap.REGISTER_UNIT
        self.unit_text = unit
        self.slot = "0" if engines > 1 else ""
        if engines > 1:
            (tmp_path / "etc" / "engine-0.env").write_text(
                f"TURNKV_PORT={self.port}\nTURNKV_SIDE_CHANNEL_PORT=5600\nTURNKV_ENGINE_ID=prod-decode-i-0abc\n"
                "TURNKV_CLOUDMAP_INSTANCE_ID=i-0abc\n")
        register = _heredoc(script, bootstrap.REGISTER_SCRIPT)
        register = register.replace("/etc/turnkv/", f"{tmp_path}/etc/").replace("/run/turnkv", f"{tmp_path}/run")
        self.script = tmp_path / "turnkv-register"
        self.script.write_text(register)
        self.script.chmod(0o755)
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        for name, body in FAKES.items():
            (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
            (bin_dir / name).chmod(0o755)
        engine_unit = (node_env.unit_instance(node_env.ENGINE_SERVICE_TEMPLATE, 0) if engines > 1
                       else node_env.ENGINE_SERVICE)
        self.env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE": str(tmp_path), "FAKE_UNIT": engine_unit}
        self.set_engine("activating", "success")
        (tmp_path / "system").write_text("running\n")
        (tmp_path / "www").mkdir()
        (tmp_path / "www" / "health").write_text("")
        self.engine: subprocess.Popen | None = None
        self.main: subprocess.Popen | None = None

    def set_engine(self, state: str, result: str) -> None:
        (self.dir / "state").write_text(state + "\n")
        (self.dir / "result").write_text(result + "\n")

    def start_engine(self) -> None:
        import sys

        self.engine = subprocess.Popen([sys.executable, "-m", "http.server", "-b", "127.0.0.1", str(self.port),
                                        "-d", str(self.dir / "www")], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
        self.set_engine("active", "success")

    def kill_engine(self) -> None:
        self.engine.kill()
        self.engine.wait()

    def _command(self, key: str) -> list[str]:
        line = re.search(rf"^{key}=(.*)$", self.unit_text, re.M).group(1)
        argv = line.replace(bootstrap.REGISTER_SCRIPT, str(self.script)).replace("%i", "0").split()
        return argv

    def exec_start(self) -> None:
        self.main = subprocess.Popen(self._command("ExecStart"), env=self.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)

    def exec_stop(self) -> str:
        done = subprocess.run(self._command("ExecStop"), env=self.env, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout + done.stderr

    def wait_registered(self) -> list[str]:
        """Registered; one engine signals the rolling update at once, one of two waits for the other."""
        registered = ["register-instance"] if self.slot else ["register-instance", "signal-resource"]
        self.wait_for(registered[-1])
        assert self.calls() == registered
        return registered

    def calls(self) -> list[str]:
        path = self.dir / "calls"
        return [c.split()[1] for c in path.read_text().splitlines()] if path.exists() else []

    def wait_for(self, call: str, timeout: float = 30) -> None:
        import time

        deadline = time.monotonic() + timeout
        while call not in self.calls():
            assert time.monotonic() < deadline, (call, self.calls())
            assert self.main.poll() is None, self.main.stdout.read()
            time.sleep(0.05)

    def close(self) -> None:
        for p in (self.engine, self.main):
            if p and p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture(params=[1, 2], ids=["one-engine", "two-engines"])
def engine_node(tmp_path, request):
    node = Node(tmp_path, request.param)
    yield node
    node.close()


def test_a_hung_engine_is_deregistered_and_its_node_marked_unhealthy(engine_node):
    """The engine process is killed under a unit systemd still sees as active (a hang looks the same to /health):
    the register unit's watchdog marks the node unhealthy and exits; ExecStop deregisters."""
    n = engine_node
    n.start_engine()
    n.exec_start()
    registered = n.wait_registered()
    n.kill_engine()
    assert n.main.wait(timeout=30) == 1  # the watchdog returned: systemd now runs ExecStop
    n.exec_stop()
    assert n.calls() == [*registered, "set-instance-health", "deregister-instance"]
    health = next(c for c in (n.dir / "calls").read_text().splitlines() if "set-instance-health" in c)
    assert "--instance-id i-0abc --health-status Unhealthy --no-should-respect-grace-period" in health
    assert bootstrap.WATCH_INTERVAL_S * bootstrap.WATCH_MISSES <= 180  # out of Cloud Map within 3 minutes


@pytest.mark.parametrize("state,result,system,marked", [
    ("failed", "exit-code", "running", True),       # exit 2 (RestartPreventExitStatus) or the restart limit hit
    ("activating", "success", "running", False),    # Restart=on-failure: BindsTo restarts this unit with it
    ("inactive", "success", "running", False),      # an operator's `systemctl stop turnkv-engine`
    ("failed", "exit-code", "stopping", False),     # shutdown / scale-in: the instance goes anyway
])
def test_an_engine_that_exits_is_deregistered_and_a_failed_one_replaced(engine_node, state, result, system, marked):
    """The engine dies (SIGKILL) and systemd, by BindsTo=, stops the register unit: ExecStart is terminated, ExecStop
    deregisters, and marks the node unhealthy only when the engine unit failed for good on a running system."""
    import signal

    n = engine_node
    n.start_engine()
    n.exec_start()
    registered = n.wait_registered()
    n.kill_engine()
    n.set_engine(state, result)
    (n.dir / "system").write_text(system + "\n")
    n.main.send_signal(signal.SIGTERM)
    n.main.wait(timeout=10)
    out = n.exec_stop()
    tail = n.calls()[len(registered):]
    assert tail == (["deregister-instance", "set-instance-health"] if marked else ["deregister-instance"])
    if marked:
        unit = "turnkv-engine@0.service" if n.slot else "turnkv-engine.service"
        assert f"{unit} failed (exit-code)" in out


def test_registration_stops_waiting_when_the_engine_failed(engine_node):
    """An engine that fails before it ever serves (exit 2 on a refused config) ends the wait at once, not after
    2 h: FAILURE to a rolling update, the node marked unhealthy."""
    n = engine_node
    n.set_engine("failed", "exit-code")
    n.exec_start()
    assert n.main.wait(timeout=30) == 1
    assert "never became healthy" in n.main.stdout.read()
    assert n.calls() == ["signal-resource", "set-instance-health"]
    assert "--status FAILURE" in (n.dir / "calls").read_text()
    assert len((n.dir / "sleeps").read_text().split()) <= 1 if (n.dir / "sleeps").exists() else True


def test_register_units_are_bound_to_their_engine_and_verify(tmp_path):
    """The rendered units: BindsTo= (not Wants=) the engine, a long-running ExecStart (the watchdog), ExecStop
    deregisters; and systemd's own verifier accepts them next to the AMI's engine unit and its template."""
    slot_engine = node_env.unit_instance(node_env.ENGINE_SERVICE_TEMPLATE, "%i")
    for unit, engine in ((bootstrap.REGISTER_UNIT, node_env.ENGINE_SERVICE),
                         (bootstrap.SLOT_REGISTER_UNIT, slot_engine)):
        assert f"BindsTo={engine}\n" in unit and f"After={engine} " in unit and "Wants=" not in unit
        assert "Type=exec\n" in unit and "RemainAfterExit" not in unit and "ExecStop=" in unit
    ami_unit = bootstrap.AMI_ENGINE_UNIT.read_text()
    assert "StartLimitBurst=" in ami_unit and "StartLimitIntervalSec=" in ami_unit
    assert "StartLimitBurst=" in bootstrap.engine_template_unit()
    if not shutil.which("systemd-analyze") or not Path("/usr/lib/systemd/system/sysinit.target").exists():
        pytest.skip("systemd-analyze (with the system's units) not installed")
    root = tmp_path / "root"
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    units = root / "etc/systemd/system"
    units.mkdir(parents=True)
    (units / node_env.ENGINE_SERVICE).write_text(ami_unit)
    (units / node_env.ENGINE_SERVICE_TEMPLATE).write_text(bootstrap.engine_template_unit())
    (units / node_env.REGISTER_SERVICE).write_text(bootstrap.REGISTER_UNIT)
    (units / node_env.REGISTER_SERVICE_TEMPLATE).write_text(bootstrap.SLOT_REGISTER_UNIT)
    for exe in (bootstrap.REGISTER_SCRIPT, "/opt/turnkv/bin/turnkv-efa-wait", "/opt/turnkv/venv/bin/turnkv"):
        path = root / exe.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
    done = subprocess.run(["systemd-analyze", "verify", "--man=no", f"--root={root}",
                           f"/etc/systemd/system/{node_env.ENGINE_SERVICE}",
                           f"/etc/systemd/system/{node_env.REGISTER_SERVICE}",
                           "turnkv-engine@0.service", "turnkv-register@0.service"], capture_output=True, text=True)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr


def test_the_models_engine_settings_reach_every_engines_argv_through_engine_env():
    """Deploy config ``model`` -> engine.env in the user data -> ``turnkv engine run``'s argv (the same reader the
    node runs): a tool-call parser with auto tool choice, fp8 KV, remote code, the allow-listed extras."""
    from turnkv import engine_run
    from turnkv.engine_settings import EngineSettings

    settings = EngineSettings(kv_cache_dtype="fp8", tool_call_parser="hermes", reasoning_parser="qwen3",
                              trust_remote_code=True, gpu_memory_utilization=0.9, max_num_seqs=128,
                              extra_args=("--max-num-batched-tokens=8192", "--enable-chunked-prefill"))
    secret = "arn:aws:secretsmanager:us-east-2:123456789012:secret:turnkv/hf-token-AbCdEf"
    for engines, tp in ((1, 8), (2, 4)):
        script = bootstrap.user_data(_node(settings=settings, hf_token_secret=secret, engines=engines, tp_size=tp))
        static = node_env.parse(_heredoc(script, f"{node_env.ENGINE_ENV_FILE}.new"))
        assert static[node_env.KV_CACHE_DTYPE] == "fp8" and static[node_env.TOOL_CALL_PARSER] == "hermes"
        assert static[node_env.EXTRA_ARGS] == "--max-num-batched-tokens=8192,--enable-chunked-prefill"
        assert static[node_env.HF_TOKEN_SECRET] == secret and "hf_" not in script  # the name, never a token
        variables = {**static, node_env.ENGINE_ID: "e", node_env.SIDE_CHANNEL_HOST: "10.0.0.5"}
        argv, env, _ = engine_run.prepare(variables, read_text=lambda path: None, run=lambda cmd: 0, sync=False)
        tail = argv[argv.index("--enable-prefix-caching") + 1:]
        assert tail == ["--kv-cache-dtype", "fp8", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        "--reasoning-parser", "qwen3", "--trust-remote-code", "--gpu-memory-utilization", "0.9",
                        "--max-num-seqs", "128", "--max-num-batched-tokens=8192", "--enable-chunked-prefill"]
        assert env[engine_run.HF_TOKEN] == engine_run.REDACTED
    plain = node_env.parse(_heredoc(bootstrap.user_data(_node()), f"{node_env.ENGINE_ENV_FILE}.new"))
    assert not {node_env.KV_CACHE_DTYPE, node_env.TOOL_CALL_PARSER, node_env.HF_TOKEN_SECRET} & set(plain)


def test_the_deploy_configs_media_allow_list_reaches_every_engine():
    """``media_domains`` of the deploy config: engine.env's TURNKV_MEDIA_DOMAINS (vLLM --allowed-media-domains on
    every engine), as the router's environment carries it; none set, none written."""
    from infra.config import DeploymentConfig
    from tests.infra import configs

    config = DeploymentConfig.model_validate(configs.PUSH)
    assert config.media_domains == ("images.example.com", "cdn.example.net")
    node = bootstrap.pool_bootstrap(config, config.pools[0])
    static = node_env.parse(_heredoc(bootstrap.user_data(node), f"{node_env.ENGINE_ENV_FILE}.new"))
    assert static[node_env.MEDIA_DOMAINS] == "images.example.com,cdn.example.net"
    assert node.engine_env().spec().allowed_media_domains == ("images.example.com", "cdn.example.net")
    plain = DeploymentConfig.model_validate(configs.GPU)
    static = node_env.parse(_heredoc(bootstrap.user_data(bootstrap.pool_bootstrap(plain, plain.pools[0])),
                                     f"{node_env.ENGINE_ENV_FILE}.new"))
    assert node_env.MEDIA_DOMAINS not in static
