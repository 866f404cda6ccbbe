"""The contract between an engine node's user data (CDK, infra) and the AMI's systemd units.

The AMI installs ``turnkv-engine.service`` (``EnvironmentFile=/etc/turnkv/engine.env``, runs
``/opt/turnkv/venv/bin/turnkv engine run``) and ``turnkv-params-sync.service`` + ``.timer``
(``EnvironmentFile=/etc/turnkv/node.env``, runs ``turnkv params sync``). The CDK user data writes both
files. Every variable name and path lives here once, so both sides spell them the same way.

Pure: no I/O. ``render`` produces the file text, ``parse`` reads it back (the one parser of the node's env
files: ``turnkv engine run`` and ``turnkv doctor`` use it too). :meth:`EngineEnv.from_variables` is the one
validating reader of engine.env: defaults are the dataclass's (written once), every bad or missing variable is
named; ``engine_spec`` turns the result (plus the synced tunables) into :class:`turnkv.engine_args.EngineSpec`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from turnkv import engine_settings, media, neuron, params, platforms, wire
from turnkv.engine_args import EngineSpec, Mode, Role
from turnkv.engine_settings import EngineSettings

#: Paths on the node.
ETC_DIR = "/etc/turnkv"
ENGINE_ENV_FILE = f"{ETC_DIR}/engine.env"
NODE_ENV_FILE = f"{ETC_DIR}/node.env"
TUNABLES_FILE = params.DEFAULT_TUNABLES_FILE
VENV_BIN = "/opt/turnkv/venv/bin"
TURNKV_BIN = f"{VENV_BIN}/turnkv"
#: Where the engine keeps weights synced from TURNKV_MODEL_S3_URI (infra mounts instance NVMe here when there is some).
MODELS_DIR = "/opt/turnkv/models"
#: The AMI records its flavor here (gpu or neuron); what is unverified on a flavor stops the engine at start.
FLAVOR_FILE = "/var/lib/turnkv/ami/flavor"

#: systemd units the AMI installs (and the one the user data adds for Cloud Map registration).
ENGINE_SERVICE = "turnkv-engine.service"
PARAMS_SYNC_SERVICE = "turnkv-params-sync.service"
PARAMS_SYNC_TIMER = "turnkv-params-sync.timer"
REGISTER_SERVICE = "turnkv-register.service"
#: Drains the node when Auto Scaling terminates it (``turnkv engine drain``), then completes the lifecycle action of
#: the terminate hook named ``DRAIN_HOOK`` (``infra.constructs.engine_group`` creates it).
DRAIN_SERVICE = "turnkv-drain.service"
DRAIN_HOOK = "turnkv-drain"

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
#: The deployment's offer secret file (turnkv.wire); the node's user data writes the deployment's Secrets
#: Manager secret into it before the engine starts (infra.bootstrap.offer_secret_script).
OFFER_SECRET_FILE_VAR = wire.OFFER_SECRET_FILE_ENV
MODEL_S3_URI = "TURNKV_MODEL_S3_URI"
#: The model's engine settings (``turnkv.engine_settings.EngineSettings``; deploy config ``model``). Unset: vLLM's
#: defaults. EXTRA_ARGS is comma-separated (``--flag`` or ``--flag=value`` each).
KV_CACHE_DTYPE = "TURNKV_KV_CACHE_DTYPE"
TOOL_CALL_PARSER = "TURNKV_TOOL_CALL_PARSER"
REASONING_PARSER = "TURNKV_REASONING_PARSER"
TRUST_REMOTE_CODE = "TURNKV_TRUST_REMOTE_CODE"
GPU_MEMORY_UTILIZATION = "TURNKV_GPU_MEMORY_UTILIZATION"
MAX_NUM_SEQS = "TURNKV_MAX_NUM_SEQS"
EXTRA_ARGS = "TURNKV_EXTRA_ARGS"
#: The Secrets Manager secret (ARN or name) holding a Hugging Face token for a gated model: ``turnkv engine run``
#: fetches it at start into the engine's HF_TOKEN (process environment only; never written to a file).
HF_TOKEN_SECRET = "TURNKV_HF_TOKEN_SECRET"
#: Hosts the engine may fetch media URLs from (comma-separated exact names: vLLM ``--allowed-media-domains``); the
#: router reads the same variable (``turnkv.router_env.MEDIA_DOMAINS``). Unset: any internet host, checked by the
#: router (docs/router.md, Media URLs).
MEDIA_DOMAINS = "TURNKV_MEDIA_DOMAINS"
#: A prefill engine's vLLM CPU offloading tier, GiB of host memory (``EngineSpec.prefill_offload_gib``); written
#: only when set (deploy config ``connector.prefill_offload_gib``).
PREFILL_OFFLOAD_GIB = "TURNKV_PREFILL_OFFLOAD_GIB"
#: The most an engine's offload tier may take: every host memory size of the instance table fits below it.
MAX_PREFILL_OFFLOAD_GIB = 4096
#: vLLM reads this itself; written too so the engine advertises a routable address even if started by hand.
VLLM_SIDE_CHANNEL_HOST = "VLLM_NIXL_SIDE_CHANNEL_HOST"

#: node.env variables.
DEPLOYMENT = "TURNKV_DEPLOYMENT"
REGION = "AWS_REGION"

DEFAULT_PORT = 8000
DEFAULT_SIDE_CHANNEL_PORT = 5600
EFA_BACKENDS = ("LIBFABRIC",)

#: Several engines on one node (a tensor-parallel size below the node's accelerators): engine ``k`` runs as the
#: template units' instance ``k`` (``turnkv-engine@k.service`` reads ``/etc/turnkv/engine-k.env``), on its own
#: devices and ports (:func:`engine_slots`). A node of one engine keeps the single units and ``engine.env``.
ENGINE_SERVICE_TEMPLATE = "turnkv-engine@.service"
REGISTER_SERVICE_TEMPLATE = "turnkv-register@.service"
#: The devices an engine may use: GPUs (CUDA) or logical NeuronCores (vllm-neuron's device control variable,
#: ``turnkv.neuron.VISIBLE_DEVICES``). The Neuron runtime's own ``NEURON_RT_VISIBLE_CORES`` is still read (slot
#: files written before the native plugin), never written: the plugin maps its workers through its own variable.
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
NEURON_VISIBLE_DEVICES = neuron.VISIBLE_DEVICES
NEURON_RT_VISIBLE_CORES = "NEURON_RT_VISIBLE_CORES"


#: The slot's own Cloud Map instance id (the instance id, plus :func:`slot_suffix`): its registration unit reads it.
CLOUDMAP_INSTANCE_ID = "TURNKV_CLOUDMAP_INSTANCE_ID"


#: The most engines one node runs (``pools[].engines_per_node``); ``turnkv doctor`` looks for that many slot files.
MAX_ENGINES_PER_NODE = 64


def engine_env_file(slot: int | str) -> str:
    """What a node's engine ``slot`` sets over engine.env when the node runs several (``%i`` in a template unit)."""
    return f"{ETC_DIR}/engine-{slot}.env"


def unit_instance(template: str, slot: int | str) -> str:
    """``turnkv-engine@.service`` -> ``turnkv-engine@<slot>.service`` (``%i`` in a unit, ``{0..N}`` in bash)."""
    return template.replace("@.", f"@{slot}.")


def slot_suffix(slot: int) -> str:
    """What tells a node's engines apart in their engine id and Cloud Map instance id: nothing for the first (so a
    node of one engine keeps the ids it always had), ``-<slot>`` for the others. The deregistration Lambda
    (infra/lambdas/deregister.py, which cannot import turnkv) spells it the same way; a test ties them."""
    return "" if slot == 0 else f"-{slot}"


@dataclass(frozen=True)
class EngineSlot:
    """One engine of a node: its devices, its HTTP port and its NIXL side-channel port."""

    index: int
    devices: tuple[int, ...]
    port: int
    side_channel_port: int

    def variables(self, gpu: bool) -> dict[str, str]:
        """What this engine sets over the node's engine.env (its ports and devices); the instance fills in
        :data:`SLOT_RUNTIME_VARIABLES`."""
        return {PORT: str(self.port), SIDE_CHANNEL_PORT: str(self.side_channel_port), **self.device_variables(gpu)}

    def device_variables(self, gpu: bool) -> dict[str, str]:
        """The variable that confines the engine to its devices (CUDA's comma list, or vllm-neuron's range)."""
        if gpu:
            return {CUDA_VISIBLE_DEVICES: ",".join(map(str, self.devices))}
        return {NEURON_VISIBLE_DEVICES: f"{self.devices[0]}-{self.devices[-1]}"}


def visible_devices(env: Mapping[str, str]) -> tuple[int, ...] | None:
    """The devices an engine's variables confine it to (what :meth:`EngineSlot.device_variables` writes: a CUDA
    comma list, or a Neuron range ``a-b``; a comma list of numbers and ranges is read in either), or None when
    neither variable is set (the node's one engine uses every device). Raises NodeEnvError on a malformed value."""
    for name in (CUDA_VISIBLE_DEVICES, NEURON_VISIBLE_DEVICES, NEURON_RT_VISIBLE_CORES):
        raw = env.get(name, "").strip()
        if not raw:
            continue
        devices: list[int] = []
        for part in raw.split(","):
            low, sep, high = part.strip().partition("-")
            if not low.isdigit() or (sep and not high.isdigit()) or (sep and int(high) < int(low)):
                raise NodeEnvError(f"{name}={raw!r}: give device numbers (0,1) or a range (0-3)")
            devices.extend(range(int(low), int(high if sep else low) + 1))
        return tuple(devices)
    return None


def engine_slots(engines: int, tp_size: int, accelerators: int) -> tuple[EngineSlot, ...]:
    """The engines of one node: engine ``k`` takes devices ``k*tp .. k*tp+tp-1``, HTTP port ``DEFAULT_PORT + k``
    and side-channel ports from ``DEFAULT_SIDE_CHANNEL_PORT + k*tp`` (a block of ``tp`` each: vLLMs that listen
    once per TP rank use port + rank). The one source of a node's ports: user data, registration, the metrics
    bridge and the router's security-group rule (:func:`http_ports`) read them here."""
    if engines < 1 or tp_size < 1 or engines * tp_size > accelerators:
        raise NodeEnvError(f"{engines} engine(s) of tensor-parallel size {tp_size} do not fit a node of "
                           f"{accelerators} accelerators")
    return tuple(EngineSlot(k, tuple(range(k * tp_size, (k + 1) * tp_size)), DEFAULT_PORT + k,
                            DEFAULT_SIDE_CHANNEL_PORT + k * tp_size) for k in range(engines))


def http_ports(engines: int) -> tuple[int, int]:
    """The first and last HTTP port of a node running ``engines`` engines (the router reaches these)."""
    return DEFAULT_PORT, DEFAULT_PORT + max(1, engines) - 1


#: Variables only known on the running instance (its id and address); the user data fills them in.
RUNTIME_VARIABLES = (ENGINE_ID, SIDE_CHANNEL_HOST, VLLM_SIDE_CHANNEL_HOST)
#: The same for each engine of a node that runs several (each with :func:`slot_suffix` on the instance's ids).
SLOT_RUNTIME_VARIABLES = (ENGINE_ID, CLOUDMAP_INSTANCE_ID)

#: NIXL backend plugins an engine may name.
KNOWN_BACKENDS = frozenset({"LIBFABRIC", "UCX", "UCCL", "GDS", "GDS_MT", "POSIX", "OBJ", "MOONCAKE", "GPUNETIO"})
#: Variables engine.env must set (the others have the defaults of :class:`EngineEnv`).
REQUIRED = (ROLE, ENGINE_ID, MODEL, SIDE_CHANNEL_HOST)
#: The instance's own variables, which its user data writes at boot (``turnkv config engine-env`` prints every other
#: one): a dry run off the node shows the engine with these stand-ins where the file leaves them out.
INSTANCE_PLACEHOLDERS = {ENGINE_ID: "i-0123456789abcdef0", SIDE_CHANNEL_HOST: "10.0.0.10"}
_NOT_ROUTABLE = re.compile(r"^(localhost|127\.\d+\.\d+\.\d+|0\.0\.0\.0|::1?|\[::1?\])$", re.I)
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")

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
    settings: EngineSettings = field(default_factory=EngineSettings)
    hf_token_secret: str | None = None
    #: Platforms the deploy config lets engines start on although unverified (``platforms.ALLOW_ENV``); written
    #: only when set, so a GPU node's engine.env keeps its bytes.
    allow_unverified: tuple[str, ...] = ()
    media_domains: tuple[str, ...] = ()
    prefill_offload_gib: int = 0

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
        out.update(settings_variables(self.settings))
        if self.hf_token_secret:
            out[HF_TOKEN_SECRET] = self.hf_token_secret
        if self.allow_unverified:
            out[platforms.ALLOW_ENV] = ",".join(self.allow_unverified)
        if self.media_domains:
            out[MEDIA_DOMAINS] = ",".join(self.media_domains)
        if self.prefill_offload_gib and Role(self.role) is Role.PREFILL:
            out[PREFILL_OFFLOAD_GIB] = str(int(self.prefill_offload_gib))
        return out

    @classmethod
    def from_variables(cls, env: Mapping[str, str], source: str = ENGINE_ENV_FILE) -> EngineEnv:
        """Read engine.env variables (empty ones count as unset); raises NodeEnvError naming every problem (and
        ``source``, the file(s) they came from)."""
        env = {**ENGINE_DEFAULTS, **{k: v for k, v in env.items() if v != ""}}
        errors = [f"{name} is missing" for name in REQUIRED if not env.get(name)]
        role = env.get(ROLE, "")
        if role and role not in {r.value for r in Role}:
            errors.append(f"{ROLE}={role!r} must be prefill or decode")
        engine_id = env.get(ENGINE_ID, "")
        if engine_id and not _ID.match(engine_id):
            errors.append(f"{ENGINE_ID}={engine_id!r}: use letters, digits and ._:@- (at most 128)")
        mode = env[MODE]
        if mode not in {m.value for m in Mode}:
            errors.append(f"{MODE}={mode!r} must be pull or push")
        bidi = env[BIDIRECTIONAL].lower()
        if bidi not in {"true", "false"}:
            errors.append(f"{BIDIRECTIONAL}={env[BIDIRECTIONAL]!r} must be true or false")
        tp = _int(env, TP_SIZE, 1, 64, errors)
        max_len = _int(env, MAX_MODEL_LEN, 16, 10_000_000, errors)
        port = _int(env, PORT, 1, 65535, errors)
        offload = _int(env, PREFILL_OFFLOAD_GIB, 0, MAX_PREFILL_OFFLOAD_GIB, errors) if env.get(PREFILL_OFFLOAD_GIB) \
            else 0
        if offload and role != Role.PREFILL.value:
            errors.append(f"{PREFILL_OFFLOAD_GIB} is a prefill engine's setting (decode keeps turns in turnkv's host "
                          "tier: host_kv_budget_mib)")
        side_port = _int(env, SIDE_CHANNEL_PORT, 1, 65535, errors)
        if port == side_port:
            errors.append(f"{PORT} and {SIDE_CHANNEL_PORT} are both {port}")
        host = env.get(SIDE_CHANNEL_HOST, "")
        if host and _NOT_ROUTABLE.match(host):
            errors.append(f"{SIDE_CHANNEL_HOST}={host!r} is not routable: engines on other nodes must reach the "
                          "NIXL side channel there (use this node's private IP)")
        backends = tuple(b.strip().upper() for b in env[BACKENDS].split(",") if b.strip())
        unknown = [b for b in backends if b not in KNOWN_BACKENDS]
        if not backends or unknown:
            errors.append(f"{BACKENDS}={env[BACKENDS]!r}: give NIXL backends from {', '.join(sorted(KNOWN_BACKENDS))}")
        settings = _settings(env, errors)
        domains = tuple(d.strip().lower().rstrip(".") for d in env.get(MEDIA_DOMAINS, "").split(",") if d.strip())
        internal = [d for d in domains if media.internal_host(d)]
        if internal:
            errors.append(f"{MEDIA_DOMAINS}: {', '.join(internal)} name internal addresses; engines must not fetch "
                          "media from inside the network")
        if errors:
            raise NodeEnvError(f"{source}: " + "; ".join(errors))
        return cls(settings=settings, hf_token_secret=env.get(HF_TOKEN_SECRET) or None,
                   role=Role(role), engine_id=engine_id, model=env[MODEL],
                   served_model_name=env.get(SERVED_MODEL_NAME) or env[MODEL], side_channel_host=host,
                   mode=Mode(mode), bidirectional=bidi == "true", tp_size=tp, max_model_len=max_len, port=port,
                   side_channel_port=side_port, backends=backends, tunables_file=env[TUNABLES_FILE_VAR],
                   model_s3_uri=env.get(MODEL_S3_URI) or None,
                   offer_secret_file=env.get(OFFER_SECRET_FILE_VAR) or wire.DEFAULT_OFFER_SECRET_FILE,
                   media_domains=domains, prefill_offload_gib=offload)

    def spec(self, tunables: Mapping[str, int | float] | None = None, model_path: str | None = None,
             flavor: str = "") -> EngineSpec:
        """The EngineSpec ``turnkv engine run`` serves (on the node: all interfaces), for the AMI's ``flavor``."""
        engine_tunables = params.defaults(params.Scope.ENGINE)
        engine_tunables.update({k: v for k, v in (tunables or {}).items() if k in engine_tunables})
        return EngineSpec(
            role=Role(self.role), engine_id=self.engine_id, model=model_path or self.model,
            served_model_name=self.served_model_name or self.model, host="0.0.0.0", port=self.port,
            side_channel_host=self.side_channel_host, side_channel_port=self.side_channel_port,
            mode=Mode(self.mode), bidirectional=self.bidirectional, tensor_parallel_size=self.tp_size,
            max_model_len=self.max_model_len, backends=tuple(self.backends), tunables=engine_tunables,
            offer_secret_file=self.offer_secret_file, settings=self.settings, flavor=flavor,
            allowed_media_domains=tuple(self.media_domains), prefill_offload_gib=float(self.prefill_offload_gib))


def settings_variables(settings: EngineSettings) -> dict[str, str]:
    """engine.env variables of the settings that differ from vLLM's defaults (the rest are left out)."""
    out: dict[str, str] = {}
    if settings.kv_cache_dtype != EngineSettings.kv_cache_dtype:
        out[KV_CACHE_DTYPE] = settings.kv_cache_dtype
    if settings.tool_call_parser:
        out[TOOL_CALL_PARSER] = settings.tool_call_parser
    if settings.reasoning_parser:
        out[REASONING_PARSER] = settings.reasoning_parser
    if settings.trust_remote_code:
        out[TRUST_REMOTE_CODE] = "true"
    if settings.gpu_memory_utilization is not None:
        out[GPU_MEMORY_UTILIZATION] = f"{settings.gpu_memory_utilization:g}"
    if settings.max_num_seqs is not None:
        out[MAX_NUM_SEQS] = str(settings.max_num_seqs)
    if settings.extra_args:
        out[EXTRA_ARGS] = engine_settings.EXTRA_ARGS_SEPARATOR.join(settings.extra_args)
    return out


def _settings(env: Mapping[str, str], errors: list[str]) -> EngineSettings:
    """The engine settings of engine.env variables; each bad one goes to ``errors`` (its default stands in)."""
    values: dict[str, object] = {}

    def read(name: str, key: str, convert) -> None:
        raw = env.get(name)
        if not raw:
            return
        try:
            values[key] = convert(raw)
        except (ValueError, engine_settings.SettingError) as exc:
            errors.append(f"{name}={raw!r}: {exc}")

    def boolean(raw: str) -> bool:
        if raw.lower() not in {"true", "false"}:
            raise ValueError("must be true or false")
        return raw.lower() == "true"

    read(KV_CACHE_DTYPE, "kv_cache_dtype", engine_settings.kv_cache_dtype)
    read(TOOL_CALL_PARSER, "tool_call_parser", engine_settings.tool_call_parser)
    read(REASONING_PARSER, "reasoning_parser", engine_settings.reasoning_parser)
    read(TRUST_REMOTE_CODE, "trust_remote_code", boolean)
    read(GPU_MEMORY_UTILIZATION, "gpu_memory_utilization", lambda raw: engine_settings.gpu_memory_utilization(
        float(raw)))
    read(MAX_NUM_SEQS, "max_num_seqs", lambda raw: engine_settings.max_num_seqs(int(raw)))
    read(EXTRA_ARGS, "extra_args", lambda raw: engine_settings.extra_args(
        a for a in raw.split(engine_settings.EXTRA_ARGS_SEPARATOR) if a))
    return EngineSettings(**values)  # type: ignore[arg-type]


def _int(env: Mapping[str, str], name: str, low: int, high: int, errors: list[str]) -> int:
    raw = env.get(name, "")
    try:
        value = int(raw)
    except ValueError:
        errors.append(f"{name}={raw!r} is not an integer ({low}..{high})")
        return low
    if not low <= value <= high:
        errors.append(f"{name}={value} is out of range ({low}..{high})")
    return value


def _engine_defaults() -> dict[str, str]:
    """engine.env's optional variables and their values, taken from EngineEnv's field defaults."""
    sample = EngineEnv(role=Role.PREFILL, engine_id="x", model="x", served_model_name="x", side_channel_host="x")
    rendered = sample.variables()
    return {name: rendered[name] for name in (MODE, BIDIRECTIONAL, TP_SIZE, MAX_MODEL_LEN, PORT, SIDE_CHANNEL_PORT,
                                              BACKENDS, TUNABLES_FILE_VAR)}


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
    """``KEY=value`` lines (systemd EnvironmentFile syntax): comments and blank lines skipped, one pair of
    matching quotes around a value removed."""
    out: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        if not sep:
            raise NodeEnvError(f"line {number}: expected NAME=value, got {line!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        out[name.strip()] = value
    return out


def engine_spec(env: Mapping[str, str], tunables: Mapping[str, int | float] | None = None) -> EngineSpec:
    """The EngineSpec that ``turnkv engine run`` starts from an engine.env mapping (on the node: all interfaces)."""
    return EngineEnv.from_variables(env).spec(tunables)


#: engine.env's defaults, as written in the file (from EngineEnv's field defaults: one place).
ENGINE_DEFAULTS: dict[str, str] = _engine_defaults()
