"""Engine node user data and CloudWatch agent config, as pure text/dicts (tested with ``bash -n``).

The AMI's units do the running (see ``turnkv/node_env.py``); this script only writes the two env files,
syncs the tunables once, configures the CloudWatch agent, adds the Cloud Map registration unit, and
starts the units. Values that come from CloudFormation (the Cloud Map service id) may be CDK tokens:
they are only ever placed inside single quotes or quoted heredocs.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from infra.config import DeploymentConfig, PoolConfig
from infra.instances import INSTANCE_TYPES, Flavor
from infra.roll import group_name
from turnkv import metric_names as mn
from turnkv import node_env
from turnkv.engine_args import Mode, Role
from turnkv.engine_settings import EngineSettings

AGENT_CONFIG_PATH = "/opt/aws/amazon-cloudwatch-agent/etc/turnkv-agent.json"
REGISTER_SCRIPT = "/usr/local/sbin/turnkv-register"
USER_DATA_LOG = "/var/log/turnkv/user-data.log"
EMF_PORT = 25888
METRICS_SERVICE = "turnkv-metrics.service"
LOG_DIR = "/var/log/turnkv"
#: The units whose output goes to CloudWatch Logs: each writes its own file (a systemd drop-in), which the agent
#: ships as its own stream (``<instance id>/<file>``). journald alone is not read by the agent.
LOGGED_UNITS = {node_env.ENGINE_SERVICE: "engine", node_env.REGISTER_SERVICE: "register",
                METRICS_SERVICE: "metrics", node_env.PARAMS_SYNC_SERVICE: "params-sync"}
METRICS_SERVICE_TEMPLATE = "turnkv-metrics@.service"
#: The AMI's engine unit: a node of several engines runs it as a template (``turnkv-engine@<slot>``), each instance
#: reading its slot's file over engine.env (``engine_template_unit``).
AMI_ENGINE_UNIT = Path(__file__).resolve().parents[1] / "ami" / "scripts" / "files" / node_env.ENGINE_SERVICE
#: Several engines: one log file per engine; the registration and metrics units of all engines share one each.
SLOT_LOGGED_UNITS = {node_env.ENGINE_SERVICE_TEMPLATE: "engine-%i", node_env.REGISTER_SERVICE_TEMPLATE: "register",
                     METRICS_SERVICE_TEMPLATE: "metrics", node_env.PARAMS_SYNC_SERVICE: "params-sync"}
#: Units enabled together before any starts: a failed start cannot leave a later one un-enabled (systemd brings
#: each back at the next boot), and the register unit waits for the engine on its own.
UNITS = (node_env.PARAMS_SYNC_TIMER, node_env.ENGINE_SERVICE, node_env.REGISTER_SERVICE, METRICS_SERVICE)


def mark_unhealthy_function(region: str) -> str:
    """Shell function: tell Auto Scaling this instance is unhealthy, now (grace period ignored), so the group
    replaces it. The group's EC2 health check alone never sees an engine that does not serve."""
    return f"""mark_unhealthy() {{
  echo "marking $INSTANCE_ID unhealthy: $1" >&2
  aws autoscaling set-instance-health --region '{region}' --instance-id "$INSTANCE_ID" \\
    --health-status Unhealthy --no-should-respect-grace-period || true
}}"""


#: The watchdog: after registration the register unit keeps polling the engine's /health; this many misses in a row
#: (at WATCH_INTERVAL_S apart) and the engine counts as hung: out of Cloud Map, the node marked unhealthy.
WATCH_INTERVAL_S = 30
WATCH_MISSES = 4


def watch_function(url: str) -> str:
    """Shell: ``engine_failed`` (the engine unit gave up: exit 2 or its restart limit) and ``watchdog`` (the health
    watchdog run after registration; returns only when the engine stopped answering). A crash never reaches the
    watchdog: the register unit is ``BindsTo=`` the engine, so systemd stops it (ExecStop deregisters) or, while
    the engine restarts, restarts it with the engine."""
    return f"""engine_failed() {{ [[ "$(systemctl show -p ActiveState --value "$ENGINE_UNIT")" == failed ]]; }}
watchdog() {{
  local misses=0
  while sleep {WATCH_INTERVAL_S}; do
    if curl -fsS -m 10 "{url}" >/dev/null; then misses=0; elif ((++misses >= {WATCH_MISSES})); then return; fi
  done
}}"""


#: ExecStop's check: the engine failed for good while the node is up (not a shutdown, not an operator's stop).
ENGINE_GAVE_UP = ('if engine_failed && [[ "$(systemctl is-system-running)" != stopping ]]; then\n'
                  '      mark_unhealthy "$ENGINE_UNIT failed ($(systemctl show -p Result --value "$ENGINE_UNIT"))"\n'
                  '    fi')


#: Where the engine keeps synced weights (turnkv.node_env.MODELS_DIR): on instance NVMe when there is some.
MODELS_DIR = node_env.MODELS_DIR


@dataclass(frozen=True)
class NodeBootstrap:
    deployment: str
    region: str
    pool: str
    role: Role
    gpu: bool
    model: str
    served_model_name: str
    mode: Mode
    bidirectional: bool
    tp_size: int
    max_model_len: int
    cloudmap_service_id: str
    log_group: str
    model_s3_uri: str | None = None
    #: CloudFormation resource signal once the engine is registered (a rolling update waits for it): the
    #: serving stack's name and the pool's Auto Scaling group logical id. Empty: no signal.
    signal_stack: str = ""
    signal_resource: str = ""
    #: The Secrets Manager secret (id or ARN) holding the deployment's offer secret, written to the engine's
    #: offer-secret file before it starts. Empty: none (offers unsigned, prefill recomputes every turn).
    offer_secret_id: str = ""
    port: int = node_env.DEFAULT_PORT
    side_channel_port: int = node_env.DEFAULT_SIDE_CHANNEL_PORT
    #: Engines this node runs (``DeploymentConfig.engines_per_node``) and the accelerators they divide: one keeps
    #: the single units and engine.env; several run as template-unit instances, each on its own devices and ports.
    engines: int = 1
    accelerators: int = 8
    #: ``connector.allow_unverified`` of the deploy config (Neuron pools: ``("neuron",)``).
    allow_unverified: tuple[str, ...] = ()
    #: The model's engine settings (deploy config ``model``), carried in engine.env to every engine.
    settings: EngineSettings = field(default_factory=EngineSettings)
    #: Secrets Manager secret (name or ARN, as configured) the engine reads its Hugging Face token from at start.
    hf_token_secret: str = ""
    #: ``connector.prefill_offload_gib`` (prefill pools only: decode's engine.env never carries it).
    prefill_offload_gib: int = 0
    #: Hosts the engines may fetch media from (deploy config ``media_domains``; vLLM ``--allowed-media-domains``).
    media_domains: tuple[str, ...] = ()
    #: The pool's Auto Scaling group and its drain bound (``pools[].drain_timeout_s``): ``turnkv-drain.service``
    #: completes the terminate hook's action in that group once the node drained. No group: no drain unit.
    group: str = ""
    drain_timeout_s: int = 900

    @property
    def slots(self) -> tuple[node_env.EngineSlot, ...]:
        return node_env.engine_slots(self.engines, self.tp_size, self.accelerators)

    def engine_env(self, engine_id: str = "", host: str = "") -> node_env.EngineEnv:
        return node_env.EngineEnv(
            role=self.role, engine_id=engine_id, model=self.model, served_model_name=self.served_model_name,
            side_channel_host=host, mode=self.mode, bidirectional=self.bidirectional, tp_size=self.tp_size,
            max_model_len=self.max_model_len, port=self.port, side_channel_port=self.side_channel_port,
            backends=node_env.EFA_BACKENDS, model_s3_uri=self.model_s3_uri, settings=self.settings,
            hf_token_secret=self.hf_token_secret or None, allow_unverified=self.allow_unverified,
            prefill_offload_gib=self.prefill_offload_gib if Role(self.role) is Role.PREFILL else 0,
            media_domains=self.media_domains)


def pool_bootstrap(config: DeploymentConfig, pool: PoolConfig, *, cloudmap_service_id: str = "", log_group: str = "",
                   signal_stack: str = "", signal_resource: str = "", offer_secret_id: str = "") -> NodeBootstrap:
    """A pool's node bootstrap from the deploy config: the serving stack passes its deploy-time ids (CDK tokens);
    ``turnkv config engine-env`` none (they are not in engine.env)."""
    profile = INSTANCE_TYPES[pool.instance_type]
    model = config.model
    return NodeBootstrap(
        deployment=config.name, region=config.region, pool=pool.name, role=pool.role,
        gpu=profile.flavor is Flavor.GPU, model=model.id, served_model_name=model.name, mode=config.connector.mode,
        bidirectional=config.connector.bidirectional, tp_size=model.tensor_parallel_size,
        max_model_len=model.max_model_len, cloudmap_service_id=cloudmap_service_id, log_group=log_group,
        model_s3_uri=model.s3_uri, signal_stack=signal_stack, signal_resource=signal_resource,
        offer_secret_id=offer_secret_id, engines=config.engines_per_node(pool), accelerators=profile.accelerators,
        settings=model.engine_settings, hf_token_secret=model.hf_token_secret or "",
        allow_unverified=config.connector.allow_unverified, prefill_offload_gib=config.connector.prefill_offload_gib,
        media_domains=config.media_domains, group=group_name(config.prefix, pool.name),
        drain_timeout_s=pool.drain_timeout_s)


def static_engine_env(b: NodeBootstrap) -> str:
    """engine.env as the user data writes it, short of the instance's own values (:data:`node_env.RUNTIME_VARIABLES`,
    filled in from IMDS on the node)."""
    return node_env.render(b.engine_env().variables(), skip=node_env.RUNTIME_VARIABLES)


def log_names(b: NodeBootstrap) -> tuple[str, ...]:
    """The files under LOG_DIR the agent ships, each as its own stream."""
    if b.engines == 1:
        return ("user-data", *LOGGED_UNITS.values())
    names = [name.replace("%i", str(slot.index)) if "%i" in name else name
             for name in SLOT_LOGGED_UNITS.values() for slot in (b.slots if "%i" in name else b.slots[:1])]
    return ("user-data", *names)


def agent_config(b: NodeBootstrap) -> dict:
    """CloudWatch agent: GPU (nvidia_gpu) and EFA metrics, and the EMF listener on tcp:25888 that the engine
    metrics bridge (and anything else on the node) writes to."""
    dims = [["InstanceId"], [mn.DEPLOYMENT, mn.ROLE]]
    metrics: dict = {
        "namespace": mn.AGENT_NAMESPACE,
        "append_dimensions": {"InstanceId": "${aws:InstanceId}", "AutoScalingGroupName": "${aws:AutoScalingGroupName}"},
        "aggregation_dimensions": dims,
        "metrics_collected": {
            "efa": {"measurement": list(mn.EFA_MEASUREMENTS), "metrics_collection_interval": 60,
                    "append_dimensions": {mn.DEPLOYMENT: b.deployment, mn.ROLE: b.role.value}},
            "mem": {"measurement": ["mem_used_percent"]},
            "disk": {"measurement": ["used_percent"], "resources": ["/"]},
        },
    }
    if b.gpu:
        metrics["metrics_collected"]["nvidia_gpu"] = {
            "measurement": ["utilization_gpu", "utilization_memory", "memory_used", "memory_total",
                            "temperature_gpu", "power_draw"],
            "metrics_collection_interval": 60,
            "append_dimensions": {mn.DEPLOYMENT: b.deployment, mn.ROLE: b.role.value},
        }
    return {
        "agent": {"metrics_collection_interval": 60, "run_as_user": "root", "region": b.region},
        "metrics": metrics,
        "logs": {
            "metrics_collected": {
                "emf": {"service_address": f"tcp://127.0.0.1:{EMF_PORT}"},
            },
            "logs_collected": {"files": {"collect_list": [
                {"file_path": f"{LOG_DIR}/{name}.log", "log_group_name": b.log_group,
                 "log_stream_name": f"{{instance_id}}/{name}", "retention_in_days": 30}
                for name in log_names(b)
            ]}},
        },
    }


def drain_command(b: NodeBootstrap) -> str:
    """Starts ``turnkv-drain.service`` (a transient unit: user data is near EC2's 16 KB on a node of eight engines):
    it waits for the terminate hook, drains the node's engines and completes the action (``turnkv.drain``). The
    deployment and region come from node.env; its output goes to the register log (the same story: in and out of
    Cloud Map). Not fatal: without it the hook's timeout still bounds the termination. Empty without a group."""
    if not b.group:
        return ""
    unit = node_env.DRAIN_SERVICE.removesuffix(".service")
    return (f"systemd-run -q -u {unit} -p Restart=always -p RestartSec=10 -p EnvironmentFile={node_env.NODE_ENV_FILE} "
            f"-p StandardOutput=append:{LOG_DIR}/register.log {node_env.TURNKV_BIN} engine drain --group {b.group} "
            f"--timeout {b.drain_timeout_s} --engines {b.engines} || echo 'no drain agent: the hook times out'\n")


def metrics_unit(b: NodeBootstrap) -> str:
    """``turnkv-metrics.service``: the engine's Prometheus metrics to EMF (``turnkv.emf_bridge``)."""
    return f"""[Unit]
Description=turnkv: engine metrics (vLLM /metrics) to CloudWatch EMF on tcp:{EMF_PORT}
After={node_env.ENGINE_SERVICE} amazon-cloudwatch-agent.service

[Service]
ExecStart={node_env.VENV_BIN}/python -m turnkv.emf_bridge --metrics-url http://127.0.0.1:{b.port}/metrics \\
  --deployment {b.deployment} --role {b.role.value} --pool {b.pool} --log-group {b.log_group} \\
  --emf 127.0.0.1:{EMF_PORT}
Restart=always
RestartSec=30

[Install]
WantedBy=multi-user.target
"""


def register_script(b: NodeBootstrap) -> str:
    """Waits for the engine's /health (or its unit's failure), registers in Cloud Map, then watches /health;
    ``deregister`` on stop, marking the node unhealthy when the engine unit failed for good."""
    attrs = (f"AWS_INSTANCE_IPV4=$IP,AWS_INSTANCE_PORT={b.port},role={b.role.value},engine_id=$ENGINE_ID,"
             f"side_channel_host=$IP,side_channel_port={b.side_channel_port},tp_size={b.tp_size},"
             f"http_port={b.port},pool={b.pool}")
    signal = ""
    if b.signal_stack and b.signal_resource:
        signal = f"""
# Tell CloudFormation this instance serves (a rolling update of the group waits for it; outside an update
# there is nothing to signal and the call fails harmlessly).
signal() {{
  aws cloudformation signal-resource --region "$REGION" --stack-name '{b.signal_stack}' \\
    --logical-resource-id '{b.signal_resource}' --unique-id "$INSTANCE_ID" --status "$1" >/dev/null 2>&1 || true
}}"""
    ok_signal = "\n        signal SUCCESS" if signal else ""
    fail_signal = "\n    signal FAILURE" if signal else ""
    return f"""#!/bin/bash
# turnkv: register this engine in Cloud Map once it is healthy; deregister on stop.
set -euo pipefail
. {node_env.ENGINE_ENV_FILE}
SERVICE_ID='{b.cloudmap_service_id}'
REGION='{b.region}'
TOKEN=$(curl -sS -X PUT http://169.254.169.254/latest/api/token -H 'X-aws-ec2-metadata-token-ttl-seconds: 300')
INSTANCE_ID=$(curl -sS -H "X-aws-ec2-metadata-token: $TOKEN" http://169.254.169.254/latest/meta-data/instance-id)
IP="$TURNKV_SIDE_CHANNEL_HOST"
ENGINE_ID="$TURNKV_ENGINE_ID"
ENGINE_UNIT={node_env.ENGINE_SERVICE}
{mark_unhealthy_function(b.region)}{signal}
{watch_function(f"http://127.0.0.1:{b.port}/health")}
case "${{1:-register}}" in
  register)
    # Loading weights and compiling can take a long time on first boot; a failed engine ends the wait.
    for _ in $(seq 1 720); do
      if curl -fsS -m 5 "http://127.0.0.1:{b.port}/health" >/dev/null; then
        aws servicediscovery register-instance --region "$REGION" --service-id "$SERVICE_ID" \\
          --instance-id "$INSTANCE_ID" --attributes "{attrs}"
        echo "registered $INSTANCE_ID ($ENGINE_ID) in Cloud Map"{ok_signal}
        watchdog
        mark_unhealthy "the engine stopped answering /health"
        exit 1
      fi
      engine_failed && break
      sleep 10
    done
    echo "engine never became healthy; not registering" >&2{fail_signal}
    mark_unhealthy "the engine never became healthy; not registered in Cloud Map"
    exit 1
    ;;
  deregister)
    aws servicediscovery deregister-instance --region "$REGION" --service-id "$SERVICE_ID" \\
      --instance-id "$INSTANCE_ID" || true
    {ENGINE_GAVE_UP}
    ;;
esac
"""


#: Bound to the engine's life (``BindsTo=``): the engine stopping or failing stops this unit, whose ExecStop
#: deregisters (and marks the node unhealthy when the engine failed for good); the engine's automatic restart
#: restarts it (deregister, then register once healthy again). ExecStart stays running as the health watchdog.
REGISTER_UNIT = f"""[Unit]
Description=turnkv: register this engine in Cloud Map when healthy, deregister on stop
After={node_env.ENGINE_SERVICE} network-online.target
BindsTo={node_env.ENGINE_SERVICE}

[Service]
Type=exec
ExecStart={REGISTER_SCRIPT} register
ExecStop={REGISTER_SCRIPT} deregister

[Install]
WantedBy=multi-user.target
"""


def slot_register_script(b: NodeBootstrap) -> str:
    """A node of several engines: ``turnkv-register register|deregister <slot>`` for one engine. It waits for that
    engine's /health and registers it as its own Cloud Map instance (its slot's id, port and side-channel port,
    from its env file); the rolling update's signal goes once every engine of the node is registered."""
    attrs = (f"AWS_INSTANCE_IPV4=$IP,AWS_INSTANCE_PORT=$PORT,role={b.role.value},engine_id=$ENGINE_ID,"
             f"side_channel_host=$IP,side_channel_port=$TURNKV_SIDE_CHANNEL_PORT,tp_size={b.tp_size},"
             f"http_port=$PORT,pool={b.pool}")
    signal = ""
    if b.signal_stack and b.signal_resource:
        signal = f"""
# Tell CloudFormation this instance serves once all {b.engines} engines are registered (once: a lock and a marker).
signal() {{
  aws cloudformation signal-resource --region "$REGION" --stack-name '{b.signal_stack}' \\
    --logical-resource-id '{b.signal_resource}' --unique-id "$INSTANCE_ID" --status "$1" >/dev/null 2>&1 || true
}}
registered() {{
  install -d /run/turnkv && touch "/run/turnkv/registered-$SLOT"
  (
    flock 9
    n=$(find /run/turnkv -name 'registered-*' | wc -l)
    if ((n >= {b.engines})) && [[ ! -e /run/turnkv/signalled ]]; then touch /run/turnkv/signalled; signal SUCCESS; fi
  ) 9>/run/turnkv/signal.lock
}}"""
    ok_signal = "\n        registered" if signal else ""
    fail_signal = "\n    signal FAILURE" if signal else ""
    return f"""#!/bin/bash
# turnkv: register engine <slot> of this node in Cloud Map once it is healthy; deregister on stop.
set -euo pipefail
SLOT="${{2:?usage: turnkv-register register|deregister SLOT}}"
. {node_env.ENGINE_ENV_FILE}
# shellcheck source=/dev/null
. "{node_env.engine_env_file("$SLOT")}"
SERVICE_ID='{b.cloudmap_service_id}'
REGION='{b.region}'
TOKEN=$(curl -sS -X PUT http://169.254.169.254/latest/api/token -H 'X-aws-ec2-metadata-token-ttl-seconds: 300')
INSTANCE_ID=$(curl -sS -H "X-aws-ec2-metadata-token: $TOKEN" http://169.254.169.254/latest/meta-data/instance-id)
IP="$TURNKV_SIDE_CHANNEL_HOST"
ENGINE_ID="$TURNKV_ENGINE_ID"
PORT="$TURNKV_PORT"
CLOUDMAP_ID="${node_env.CLOUDMAP_INSTANCE_ID}"
ENGINE_UNIT="{node_env.unit_instance(node_env.ENGINE_SERVICE_TEMPLATE, "$SLOT")}"
{mark_unhealthy_function(b.region)}{signal}
{watch_function("http://127.0.0.1:$PORT/health")}
case "$1" in
  register)
    for _ in $(seq 1 720); do
      if curl -fsS -m 5 "http://127.0.0.1:$PORT/health" >/dev/null; then
        aws servicediscovery register-instance --region "$REGION" --service-id "$SERVICE_ID" \\
          --instance-id "$CLOUDMAP_ID" --attributes "{attrs}"
        echo "registered $CLOUDMAP_ID ($ENGINE_ID) in Cloud Map"{ok_signal}
        watchdog
        mark_unhealthy "engine $SLOT stopped answering /health"
        exit 1
      fi
      engine_failed && break
      sleep 10
    done
    echo "engine $SLOT never became healthy; not registering" >&2{fail_signal}
    mark_unhealthy "engine $SLOT never became healthy; not registered in Cloud Map"
    exit 1
    ;;
  deregister)
    aws servicediscovery deregister-instance --region "$REGION" --service-id "$SERVICE_ID" \\
      --instance-id "$CLOUDMAP_ID" || true
    {ENGINE_GAVE_UP}
    ;;
esac
"""


SLOT_REGISTER_UNIT = f"""[Unit]
Description=turnkv: register engine %i in Cloud Map when healthy, deregister on stop
After={node_env.unit_instance(node_env.ENGINE_SERVICE_TEMPLATE, "%i")} network-online.target
BindsTo={node_env.unit_instance(node_env.ENGINE_SERVICE_TEMPLATE, "%i")}

[Service]
Type=exec
ExecStart={REGISTER_SCRIPT} register %i
ExecStop={REGISTER_SCRIPT} deregister %i

[Install]
WantedBy=multi-user.target
"""


def slot_metrics_unit(b: NodeBootstrap) -> str:
    """``turnkv-metrics@<slot>.service``: engine ``slot``'s metrics to EMF (its port and engine id from its env
    file). The engine id adds a per-engine dimension set, so the node's engines are not merged in CloudWatch; the
    single unit above leaves it out (its user data, and so every existing node's launch template, is unchanged)."""
    return f"""[Unit]
Description=turnkv: engine %i metrics (vLLM /metrics) to CloudWatch EMF on tcp:{EMF_PORT}
After={node_env.unit_instance(node_env.ENGINE_SERVICE_TEMPLATE, "%i")} amazon-cloudwatch-agent.service

[Service]
EnvironmentFile={node_env.ENGINE_ENV_FILE}
EnvironmentFile={node_env.engine_env_file("%i")}
ExecStart={node_env.VENV_BIN}/python -m turnkv.emf_bridge --metrics-url http://127.0.0.1:${{TURNKV_PORT}}/metrics \\
  --deployment {b.deployment} --role {b.role.value} --pool {b.pool} --log-group {b.log_group} \\
  --engine-id ${{{node_env.ENGINE_ID}}} --emf 127.0.0.1:{EMF_PORT}
Restart=always
RestartSec=30

[Install]
WantedBy=multi-user.target
"""


def engine_template_unit(ami_unit: str | None = None) -> str:
    """``turnkv-engine@.service``: the AMI's engine unit (one source), each instance reading its slot's file over
    engine.env and starting only once that file exists. Comments dropped (user data is limited to 16 KB)."""
    text = AMI_ENGINE_UNIT.read_text() if ami_unit is None else ami_unit
    env_line = f"EnvironmentFile={node_env.ENGINE_ENV_FILE}\n"
    condition = f"ConditionPathExists={node_env.ENGINE_ENV_FILE}\n"
    if env_line not in text or condition not in text:
        raise ValueError(f"{AMI_ENGINE_UNIT.name} no longer reads {node_env.ENGINE_ENV_FILE} as expected: "
                         "update infra.bootstrap.engine_template_unit with it")
    slot_file = node_env.engine_env_file("%i")
    text = text.replace(condition, f"ConditionPathExists={slot_file}\n")
    text = text.replace(env_line, f"{env_line}EnvironmentFile={slot_file}\n")
    text = re.sub(r"^Description=(.*)$", r"Description=\1, engine %i", text, count=1, flags=re.M)
    return "".join(line + "\n" for line in text.splitlines() if line and not line.startswith("#"))


def slot_env_files(b: NodeBootstrap) -> str:
    """Shell writing each engine's file over engine.env: its ports and devices, then its engine id and Cloud Map
    instance id (the instance's, with ``node_env.slot_suffix``)."""
    lines = []
    for slot in b.slots:
        static = " ".join(f"{k} {node_env.check_value(k, v)}" for k, v in slot.variables(b.gpu).items())
        suffix = node_env.slot_suffix(slot.index)
        path = node_env.engine_env_file(slot.index)
        lines.append(f"printf '%s=%s\\n' {static} {node_env.ENGINE_ID} \"$ENGINE_ID{suffix}\" "
                     f"{node_env.CLOUDMAP_INSTANCE_ID} \"$INSTANCE_ID{suffix}\" > {path}")
    head = f"\n# This node runs {b.engines} engines, each on its own devices and ports over engine.env.\n"
    return head + "\n".join(lines)


def log_dropin(name: str) -> str:
    """systemd drop-in: the unit's stdout and stderr appended to its own file (which the agent ships)."""
    return f"""[Service]
StandardOutput=append:{LOG_DIR}/{name}.log
StandardError=append:{LOG_DIR}/{name}.log
"""


LOGROTATE = f"""{LOG_DIR}/*.log {{
  daily
  rotate 3
  maxsize 512M
  missingok
  notifempty
  compress
  copytruncate
}}
"""

#: Weights on the instance store: the DLAMI assembles and mounts its NVMe instance store at /opt/dlami/nvme; a
#: parent image without that mounts them here (RAID 0 over all of them). No instance store: the root volume.
#: User data runs at first boot only: the mounts go to fstab too (by filesystem UUID, nofail), so a reboot keeps the
#: weights on NVMe (the instance store keeps its data across a reboot) instead of re-syncing them to the root volume.
FSTAB = "/etc/fstab"
NVME_SCRIPT = f"""nvme=""
if mountpoint -q /opt/dlami/nvme; then
  nvme=/opt/dlami/nvme
else
  mapfile -t disks < <(lsblk -dpno NAME,MODEL | awk '/Amazon EC2 NVMe Instance Storage/ {{print $1}}')
  if ((${{#disks[@]}} > 0)); then
    dev="${{disks[0]}}"
    if ((${{#disks[@]}} > 1)); then
      mdadm --create /dev/md/turnkv --run --level=0 --raid-devices="${{#disks[@]}}" "${{disks[@]}}"
      dev=/dev/md/turnkv
    fi
    mkfs.ext4 -q -F -E nodiscard "$dev"
    nvme=/mnt/turnkv-nvme
    install -d "$nvme"
    mount -o noatime "$dev" "$nvme"
    echo "UUID=$(blkid -s UUID -o value "$dev") $nvme ext4 noatime,nofail 0 2" >> {FSTAB}
  fi
fi
if [[ -n "$nvme" ]]; then
  install -d "$nvme/turnkv-models" {MODELS_DIR}
  mount --bind "$nvme/turnkv-models" {MODELS_DIR}
  echo "$nvme/turnkv-models {MODELS_DIR} none bind,nofail,x-systemd.requires-mounts-for=$nvme 0 0" >> {FSTAB}
  echo "model weights on instance NVMe ($nvme)"
else
  echo "no instance NVMe: model weights on the root volume"
fi"""


def offer_secret_script(b: NodeBootstrap) -> str:
    """Shell that writes the deployment's offer secret (Secrets Manager) to the engine's offer-secret file,
    readable by root only. Without it the engine would run but never reuse KV, so a failure stops the boot."""
    if not b.offer_secret_id:
        return ""
    path = b.engine_env().offer_secret_file
    return f"""
# The deployment's offer secret: decode signs its KV offers with it, prefill reads only offers it verifies.
umask 077
mkdir -p "$(dirname '{path}')"
for attempt in 1 2 3 4 5; do
  if aws secretsmanager get-secret-value --region '{b.region}' --secret-id '{b.offer_secret_id}' \\
      --query SecretString --output text > '{path}.new' && test -s '{path}.new'; then
    mv '{path}.new' '{path}'; break
  fi
  echo "offer secret fetch failed (attempt $attempt); retrying"; sleep $((attempt * 5))
done
rm -f '{path}.new'
test -s '{path}' || {{ echo "no offer secret; refusing to start the engine"; exit 1; }}
umask 022
"""


def _units(b: NodeBootstrap) -> tuple[str, str, str, str]:
    """Shell installing the node's registration and metrics units, the units to enable, the engine unit(s) to
    start and the units started after them without waiting: the single units for one engine, the template units'
    instances (``@0``, ``@1``, ...) for several."""
    if b.engines == 1:
        install = f"""cat > /etc/systemd/system/{node_env.REGISTER_SERVICE} <<'TURNKV_EOF'
{REGISTER_UNIT}TURNKV_EOF
cat > /etc/systemd/system/{METRICS_SERVICE} <<'TURNKV_EOF'
{metrics_unit(b)}TURNKV_EOF"""
        return install, " ".join(UNITS), node_env.ENGINE_SERVICE, f"{node_env.REGISTER_SERVICE} {METRICS_SERVICE}"
    each = f"{{0..{b.engines - 1}}}"  # bash brace expansion: one instance per slot
    install = f"""cat > /etc/systemd/system/{node_env.ENGINE_SERVICE_TEMPLATE} <<'TURNKV_EOF'
{engine_template_unit()}TURNKV_EOF
cat > /etc/systemd/system/{node_env.REGISTER_SERVICE_TEMPLATE} <<'TURNKV_EOF'
{SLOT_REGISTER_UNIT}TURNKV_EOF
cat > /etc/systemd/system/{METRICS_SERVICE_TEMPLATE} <<'TURNKV_EOF'
{slot_metrics_unit(b)}TURNKV_EOF"""
    engines = node_env.unit_instance(node_env.ENGINE_SERVICE_TEMPLATE, each)
    followers = " ".join(node_env.unit_instance(t, each)
                         for t in (node_env.REGISTER_SERVICE_TEMPLATE, METRICS_SERVICE_TEMPLATE))
    return install, f"{node_env.PARAMS_SYNC_TIMER} {engines} {followers}", engines, followers


#: EC2: user data is limited to 16 KB before base64 encoding; a larger launch template fails only at deploy.
USER_DATA_LIMIT = 16 * 1024
#: CDK tokens (``${Token[...]}``) resolve at deploy time: the size guard renders with stand-ins instead.
_TOKEN = re.compile(r"\$\{Token\[[^\]]+\]\}")


def deploy_time_stand_ins(config: DeploymentConfig) -> dict[str, str]:
    """The longest values the user data's deploy-time tokens take: a Cloud Map service id (srv- and 16
    characters), the offer secret's ARN (its name, and the 6 characters Secrets Manager appends), the log
    group's name (the serving stack's)."""
    return {"cloudmap_service_id": "srv-" + "x" * 16,
            "offer_secret_id": f"arn:aws-us-gov:secretsmanager:{config.region}:{'0' * 12}:secret:"
                               f"{config.prefix}/engine-offer-secret-AbCdEf",
            "log_group": engine_log_group(config)}


def engine_log_group(config: DeploymentConfig) -> str:
    """The engines' CloudWatch log group (the serving stack creates it)."""
    return f"/turnkv/{config.name}/engines"


def user_data_size(config: DeploymentConfig, pool: PoolConfig, engines: int | None = None) -> int:
    """Bytes of ``pool``'s user data with its deploy-time values at their longest (``engines`` a node: the pool's)."""
    from dataclasses import replace

    b = pool_bootstrap(config, pool, **deploy_time_stand_ins(config))
    if engines is not None:
        b = replace(b, engines=engines)
    return len(user_data(b).encode())


def user_data_problems(config: DeploymentConfig) -> list[tuple[str, str]]:
    """``turnkv config validate``'s check of EC2's user-data limit, with the fix: the most engines a node of that
    pool can run within it (``pools[].engines_per_node``), or a larger tensor-parallel size."""
    problems = []
    for i, pool in enumerate(config.pools):
        engines = config.engines_per_node(pool)
        size = user_data_size(config, pool)
        if size <= USER_DATA_LIMIT:
            continue
        fits = next((n for n in range(engines - 1, 0, -1) if user_data_size(config, pool, n) <= USER_DATA_LIMIT), 0)
        fix = (f"set pools[{i}].engines_per_node: {fits} (the node's other accelerators stay idle) or raise "
               f"model.tensor_parallel_size to {_tp_for(config, pool, fits)}" if fits else
               "shorten model.id / model.served_model_name")
        problems.append((f"pools[{i}]", f"a {pool.instance_type} node of {engines} engines needs {size} bytes of user "
                                        f"data, over EC2's {USER_DATA_LIMIT}-byte limit; {fix}"))
    return problems


def _tp_for(config: DeploymentConfig, pool: PoolConfig, engines: int) -> int:
    """The smallest power-of-two tensor-parallel size at which the instance's accelerators give at most ``engines``."""
    accelerators = INSTANCE_TYPES[pool.instance_type].accelerators
    tp = config.model.tensor_parallel_size
    while accelerators // tp > engines:
        tp *= 2
    return tp


def checked_user_data(b: NodeBootstrap, stand_ins: dict[str, str]) -> str:
    """``user_data(b)``, after the size check at synth: rendered with ``stand_ins`` (worst-case literal values for
    the fields that are CDK tokens, by field name), it must fit EC2's limit, and no token may be left unmeasured."""
    from dataclasses import replace

    script = user_data(b)
    probe = user_data(replace(b, **stand_ins))
    if _TOKEN.search(probe):
        raise ValueError(f"user data of pool {b.pool}: a CDK token has no stand-in for the size check "
                         f"({_TOKEN.search(probe).group(0)}); add its field to stand_ins")
    size = len(probe.encode())
    if size > USER_DATA_LIMIT:
        raise ValueError(f"user data of pool {b.pool} is {size} bytes with its deploy-time values, over EC2's "
                         f"{USER_DATA_LIMIT}-byte limit ({b.engines} engines a node); lower pools[].engines_per_node, "
                         f"or shorten model.id / model.served_model_name")
    return script


def user_data(b: NodeBootstrap) -> str:
    multi = b.engines > 1
    static_env = static_engine_env(b)
    node_file = node_env.render(node_env.NodeEnv(b.deployment, b.region).variables())
    # Several engines: compact JSON (user data is limited to 16 KB; a node of eight engines lists more logs).
    agent = json.dumps(agent_config(b), separators=(",", ":")) if multi else json.dumps(agent_config(b), indent=1)
    dropin_cmds = "\n".join(
        f"install -d /etc/systemd/system/{unit}.d\n"
        f"cat > /etc/systemd/system/{unit}.d/10-turnkv-logs.conf <<'TURNKV_EOF'\n{log_dropin(name)}TURNKV_EOF"
        for unit, name in (SLOT_LOGGED_UNITS if multi else LOGGED_UNITS).items())
    install_units, enable, engines, followers = _units(b)
    slot_files = slot_env_files(b) if multi else ""
    register = slot_register_script(b) if multi else register_script(b)
    sync = (f"{node_env.TURNKV_BIN} params sync --deployment {b.deployment} --region {b.region} "
            f"--out {node_env.TUNABLES_FILE}")
    return f"""#!/bin/bash
# turnkv engine node ({b.role.value}, pool {b.pool}); contract: turnkv/node_env.py
set -euo pipefail
install -d -m 0755 /etc/turnkv /var/log/turnkv
exec > >(tee -a {USER_DATA_LOG}) 2>&1
echo "turnkv user data start $(date -Is)"

TOKEN=$(curl -sS -X PUT http://169.254.169.254/latest/api/token -H 'X-aws-ec2-metadata-token-ttl-seconds: 300')
imds() {{ curl -fsS -H "X-aws-ec2-metadata-token: $TOKEN" "http://169.254.169.254/latest/meta-data/$1"; }}
INSTANCE_ID=$(imds instance-id)
# The address of card 0's interface (the only one with an IP): HTTP and the NIXL side channel.
IP=$(imds local-ipv4)
ENGINE_ID="{b.deployment}-{b.role.value}-$INSTANCE_ID"
# Any failure from here on leaves a node that will never serve: have the group replace it.
{mark_unhealthy_function(b.region)}
on_exit() {{
  local rc=$?
  if ((rc != 0)); then mark_unhealthy "user data failed (exit $rc)"; fi
}}
trap on_exit EXIT

cat > {node_env.NODE_ENV_FILE} <<'TURNKV_EOF'
{node_file}TURNKV_EOF

cat > {node_env.ENGINE_ENV_FILE}.new <<'TURNKV_EOF'
{static_env}TURNKV_EOF
printf '%s=%s\\n' {node_env.ENGINE_ID} "$ENGINE_ID" {node_env.SIDE_CHANNEL_HOST} "$IP" \\
  {node_env.VLLM_SIDE_CHANNEL_HOST} "$IP" {node_env.REGION} '{b.region}' >> {node_env.ENGINE_ENV_FILE}.new
mv {node_env.ENGINE_ENV_FILE}.new {node_env.ENGINE_ENV_FILE}{slot_files}

# Tunables from SSM before the engine starts (the timer keeps the file fresh afterwards).
for attempt in 1 2 3 4 5; do
  if {sync}; then break; fi
  echo "params sync failed (attempt $attempt); retrying"; sleep $((attempt * 5))
done
test -s {node_env.TUNABLES_FILE} || {{ echo "no tunables file; refusing to start the engine"; exit 1; }}
{offer_secret_script(b)}
# CloudWatch agent: GPU and EFA metrics, EMF listener on tcp:{EMF_PORT} (engine metrics arrive there).
cat > {AGENT_CONFIG_PATH} <<'TURNKV_EOF'
{agent}
TURNKV_EOF
/opt/aws/amazon-cloudwatch-agent/bin/amazon-cloudwatch-agent-ctl -a fetch-config -m ec2 -s \\
  -c file:{AGENT_CONFIG_PATH} || echo "cloudwatch agent failed to start; continuing without metrics"

# Cloud Map registration once healthy; deregistration on stop (the lifecycle hook's Lambda does it too).
cat > {REGISTER_SCRIPT} <<'TURNKV_EOF'
{register}TURNKV_EOF
chmod 0755 {REGISTER_SCRIPT}
{install_units}

# Each unit's output to its own file under {LOG_DIR} (shipped to CloudWatch Logs by the agent), rotated.
{dropin_cmds}
cat > /etc/logrotate.d/turnkv <<'TURNKV_EOF'
{LOGROTATE}TURNKV_EOF

# Model weights on local NVMe when the instance has some.
{NVME_SCRIPT}

systemctl daemon-reload
systemctl enable {enable}
systemctl start {node_env.PARAMS_SYNC_TIMER}
systemctl start {engines}
systemctl start --no-block {followers}
{drain_command(b)}echo "turnkv user data done $(date -Is)"
"""
