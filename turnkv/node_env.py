"""The contract between an engine node's user data (CDK, infra) and the AMI's systemd units.

The AMI installs ``turnkv-engine.service`` (``EnvironmentFile=/etc/turnkv/engine.env``, runs
``/opt/turnkv/venv/bin/turnkv engine run``) and ``turnkv-params-sync.service`` + ``.timer``
(``EnvironmentFile=/etc/turnkv/node.env``, runs ``turnkv params sync``). The CDK user data writes both
files. Every variable name and path lives here once, so both sides spell them the same way.

Pure: no I/O. ``render`` produces the file text, ``parse`` reads it back, ``engine_spec`` turns the
engine file (plus the synced tunables) into :class:`turnkv.engine_args.EngineSpec`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from turnkv import params, wire
from turnkv.engine_args import EngineSpec, Mode, Role

#: Paths on the node.
ETC_DIR = "/etc/turnkv"
ENGINE_ENV_FILE = f"{ETC_DIR}/engine.env"
NODE_ENV_FILE = f"{ETC_DIR}/node.env"
TUNABLES_FILE = params.DEFAULT_TUNABLES_FILE
VENV_BIN = "/opt/turnkv/venv/bin"
TURNKV_BIN = f"{VENV_BIN}/turnkv"

#: systemd units the AMI installs (and the one the user data adds for Cloud Map registration).
ENGINE_SERVICE = "turnkv-engine.service"
PARAMS_SYNC_SERVICE = "turnkv-params-sync.service"
PARAMS_SYNC_TIMER = "turnkv-params-sync.timer"
REGISTER_SERVICE = "turnkv-register.service"

#: engine.env variables.
ROLE = "TURNKV_ROLE"
ENGINE_ID = "TURNKV_ENGINE_ID"
MODEL = "TURNKV_MODEL"
SERVED_MODEL_NAME = "TURNKV_SERVED_MODEL_NAME"
MODE = "TURNKV_MODE"
BIDIRECTIONAL = "TURNKV_BIDIRECTIONAL"
TP_SIZE = "TURNKV_TP_SIZE"
MAX_MODEL_LEN = "TURNKV_MAX_MODEL_LEN"
PORT = "TURNKV_PORT"
SIDE_CHANNEL_HOST = "TURNKV_SIDE_CHANNEL_HOST"
SIDE_CHANNEL_PORT = "TURNKV_SIDE_CHANNEL_PORT"
BACKENDS = "TURNKV_BACKENDS"
TUNABLES_FILE_VAR = params.TUNABLES_FILE_ENV
#: The deployment's offer secret file (turnkv.wire); the node writes the Secrets Manager secret named by
#: TURNKV_OFFER_SECRET_ID into it before the engine starts.
OFFER_SECRET_FILE_VAR = wire.OFFER_SECRET_FILE_ENV
MODEL_S3_URI = "TURNKV_MODEL_S3_URI"
#: vLLM reads this itself; written too so the engine advertises a routable address even if started by hand.
VLLM_SIDE_CHANNEL_HOST = "VLLM_NIXL_SIDE_CHANNEL_HOST"

#: node.env variables.
DEPLOYMENT = "TURNKV_DEPLOYMENT"
REGION = "AWS_REGION"

DEFAULT_PORT = 8000
DEFAULT_SIDE_CHANNEL_PORT = 5600
EFA_BACKENDS = ("LIBFABRIC",)

#: Variables only known on the running instance (its id and address); the user data fills them in.
RUNTIME_VARIABLES = (ENGINE_ID, SIDE_CHANNEL_HOST, VLLM_SIDE_CHANNEL_HOST)

# Values are written unquoted; keep them to characters that neither systemd nor a shell reinterprets.
_SAFE_VALUE = re.compile(r"^[A-Za-z0-9_.,:/@+=\-]*$")
_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")


class NodeEnvError(ValueError):
    """A value that cannot be written to an env file, or a file that misses a variable."""


@dataclass(frozen=True)
class EngineEnv:
    role: Role
    engine_id: str
    model: str
    served_model_name: str
    side_channel_host: str
    mode: Mode = Mode.PULL
    bidirectional: bool = True
    tp_size: int = 1
    max_model_len: int = 8192
    port: int = DEFAULT_PORT
    side_channel_port: int = DEFAULT_SIDE_CHANNEL_PORT
    backends: tuple[str, ...] = EFA_BACKENDS
    tunables_file: str = TUNABLES_FILE
    model_s3_uri: str | None = None
    offer_secret_file: str = wire.DEFAULT_OFFER_SECRET_FILE

    def variables(self) -> dict[str, str]:
        out = {
            ROLE: Role(self.role).value,
            ENGINE_ID: self.engine_id,
            MODEL: self.model,
            SERVED_MODEL_NAME: self.served_model_name,
            MODE: Mode(self.mode).value,
            BIDIRECTIONAL: "true" if self.bidirectional else "false",
            TP_SIZE: str(int(self.tp_size)),
            MAX_MODEL_LEN: str(int(self.max_model_len)),
            PORT: str(int(self.port)),
            SIDE_CHANNEL_HOST: self.side_channel_host,
            SIDE_CHANNEL_PORT: str(int(self.side_channel_port)),
            BACKENDS: ",".join(self.backends),
            TUNABLES_FILE_VAR: self.tunables_file,
            OFFER_SECRET_FILE_VAR: self.offer_secret_file,
            VLLM_SIDE_CHANNEL_HOST: self.side_channel_host,
        }
        if self.model_s3_uri:
            out[MODEL_S3_URI] = self.model_s3_uri
        return out


@dataclass(frozen=True)
class NodeEnv:
    deployment: str
    region: str

    def variables(self) -> dict[str, str]:
        return {DEPLOYMENT: self.deployment, REGION: self.region}


def check_value(name: str, value: str) -> str:
    if not _NAME.match(name):
        raise NodeEnvError(f"{name!r} is not a valid environment variable name")
    if not _SAFE_VALUE.match(value):
        raise NodeEnvError(f"{name}={value!r}: only letters, digits and _.,:/@+=- are allowed in node env values")
    return value


def render(variables: Mapping[str, str], *, skip: tuple[str, ...] = ()) -> str:
    """``KEY=value`` lines for a systemd ``EnvironmentFile`` (also sourceable by bash)."""
    return "".join(f"{k}={check_value(k, v)}\n" for k, v in variables.items() if k not in skip)


def parse(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        if not sep:
            raise NodeEnvError(f"line {number}: expected NAME=value, got {line!r}")
        out[name.strip()] = value.strip().strip('"')
    return out


def engine_spec(env: Mapping[str, str], tunables: Mapping[str, int | float] | None = None) -> EngineSpec:
    """The EngineSpec that ``turnkv engine run`` starts from an engine.env mapping (on the node: all interfaces)."""
    missing = [n for n in (ROLE, ENGINE_ID, MODEL, SIDE_CHANNEL_HOST) if not env.get(n)]
    if missing:
        raise NodeEnvError(f"{ENGINE_ENV_FILE} misses {', '.join(missing)}")
    engine_tunables = params.defaults(params.Scope.ENGINE)
    engine_tunables.update({k: v for k, v in (tunables or {}).items() if k in engine_tunables})
    return EngineSpec(
        role=Role(env[ROLE]),
        engine_id=env[ENGINE_ID],
        model=env[MODEL],
        served_model_name=env.get(SERVED_MODEL_NAME) or env[MODEL],
        host="0.0.0.0",
        port=int(env.get(PORT, DEFAULT_PORT)),
        side_channel_host=env[SIDE_CHANNEL_HOST],
        side_channel_port=int(env.get(SIDE_CHANNEL_PORT, DEFAULT_SIDE_CHANNEL_PORT)),
        mode=Mode(env.get(MODE, Mode.PULL.value)),
        bidirectional=env.get(BIDIRECTIONAL, "true").lower() == "true",
        tensor_parallel_size=int(env.get(TP_SIZE, 1)),
        max_model_len=int(env.get(MAX_MODEL_LEN, 8192)),
        backends=tuple(b for b in env.get(BACKENDS, ",".join(EFA_BACKENDS)).split(",") if b),
        tunables=engine_tunables,
        offer_secret_file=env.get(OFFER_SECRET_FILE_VAR) or wire.DEFAULT_OFFER_SECRET_FILE,
    )
