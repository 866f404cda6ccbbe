"""The local stack: real vLLM engines (prefill, decode) and the router on 127.0.0.1.

``plan`` (pure) turns a :class:`StackConfig` into process specs; :class:`Supervisor` starts them in
their own process groups, waits for health, records them in ``state.json`` under the state folder,
and stops whole groups on ``down`` or on any start-up failure, so nothing is left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from pathlib import Path

from turnkv import engine_args, params, router_env, wire
from turnkv import engine_settings as es
from turnkv.engine_args import EngineSpec, Mode, Role
from turnkv.engine_settings import EngineSettings
from turnkv.local import engine_env
from turnkv.local import model as model_maker
from turnkv.plan import ratios

#: The checkout this turnkv runs from (holds ``connector/``, which the engines load).
SOURCE_ROOT = Path(__file__).resolve().parents[2]
#: Overrides where the local stack lives by default (``--state-dir`` overrides it).
STATE_DIR_ENV = "TURNKV_STATE_DIR"
SERVED_MODEL_NAME = "tiny"
#: The engines' hot-reloaded tunables file in the state folder (:func:`tunables_file`).
TUNABLES_FILE = "tunables.json"


def default_state_dir(env: Mapping[str, str] | None = None, root: Path = SOURCE_ROOT,
                      home: Path | None = None) -> Path:
    """Where the local stack lives without ``--state-dir``: the same folder from every working directory.
    ``$TURNKV_STATE_DIR``, else ``.turnkv`` in the checkout turnkv runs from (the README's clone), else
    ``~/.turnkv`` (an installed package). It was ``.turnkv`` under the working directory: `local status` or `local
    down` from another folder said "no local stack" while three engines kept running (issue #49)."""
    env = os.environ if env is None else env
    if env.get(STATE_DIR_ENV):
        return Path(env[STATE_DIR_ENV]).expanduser().resolve()
    if (root / "pyproject.toml").is_file() and (root / "connector").is_dir():
        return root / ".turnkv"
    return (home or Path.home()) / ".turnkv"


def state_folder(given: Path | None) -> Path:
    """A command's ``--state-dir`` as given, else the default every command shares (:func:`default_state_dir`)."""
    return default_state_dir() if given is None else given


class StackError(RuntimeError):
    """A start-up or shutdown problem, phrased for the person at the terminal."""


class Accelerator(StrEnum):
    """Where the local stack's engines run."""

    CPU = "cpu"
    CUDA = "cuda"


ACCELERATORS = tuple(a.value for a in Accelerator)


@dataclass(frozen=True)
class ExtraRouter:
    """One more router over the stack's engines, with flags and router tunables of its own: several router
    configurations (API keys, short replay windows) served by one engine boot, the costly part."""

    name: str
    port: int
    args: tuple[str, ...] = ()
    #: Router-scope tunables (catalog names) on top of the stack's.
    tunables: dict[str, int | float] = field(default_factory=dict)


@dataclass
class StackConfig:
    state_dir: Path = field(default_factory=default_state_dir)
    router_port: int = router_env.PORT
    prefill_port: int = router_env.LOCAL_PREFILL_PORT
    decode_port: int = router_env.LOCAL_DECODE_PORT
    side_channel_base: int = router_env.LOCAL_SIDE_CHANNEL_BASE
    mode: Mode = Mode.PULL
    #: Prefix caching on prefill, as deployed (``EngineSpec``'s default). The A/B benchmarks and the engine suites
    #: that measure reuse run the seeds' setting (off: prefill recomputes what it does not pull).
    prefill_prefix_caching: bool = EngineSpec.prefix_caching
    #: Also start a prefill engine with prefix caching and a second router over it (the benchmark's best case).
    best_case: bool = False
    #: Engine tunables (catalog names) such as decoder_kv_blocks_ttl.
    tunables: dict[str, int | float] = field(default_factory=dict)
    kv_cache_gib: int = 2
    #: The deploy config's engine settings (``model``: KV cache dtype, parsers, ...), on every engine as on a node.
    engine_settings: EngineSettings = field(default_factory=EngineSettings)
    #: Extra ``vllm serve`` flags for every engine (tests use --trust-request-chat-template).
    engine_extra_args: tuple[str, ...] = ()
    #: ... and for the decode engines only (bench.shapes: an n-gram drafter on decode, as deployments run it).
    decode_extra_args: tuple[str, ...] = ()
    startup_timeout: float = 240.0
    #: Engines per role (ports prefill_port + i, decode_port + i; side channels after the first two).
    prefill_engines: int = 1
    decode_engines: int = 1
    #: Extra `turnkv router serve` arguments (--store, --api-keys-file, --mode, ...).
    router_args: tuple[str, ...] = ()
    #: Connector class instead of the mode's (upstream "NixlPushConnector" for plain push); bidirectional off.
    connector: str | None = None
    #: Router flags carry each prefill engine's identity (engine_id, side channel) for concurrent push.
    router_identity: bool = False
    extra_routers: tuple[ExtraRouter, ...] = ()
    model_spec: model_maker.ModelSpec = field(default_factory=model_maker.ModelSpec)
    #: Per-role shape (the target's unequal shapes, run here: bench.shapes): tensor parallelism (vLLM's CPU
    #: backend runs one rank per core) and KV block size; None: the engine default.
    prefill_tp: int = 1
    decode_tp: int = 1
    prefill_block_size: int | None = None
    decode_block_size: int | None = None
    #: Where the engines run: "cpu" (vLLM's CPU build, the suites and the demo) or "cuda" (the CUDA wheel in a
    #: venv of its own: ``make gpu-smoke``), every engine sharing the GPUs in ``cuda_devices``.
    accelerator: Accelerator = Accelerator.CPU
    cuda_devices: str = "0"
    #: Each engine's share of GPU memory (``--gpu-memory-utilization``): the stack's engines share one GPU.
    gpu_memory_utilization: float = 0.25
    #: ``--enforce-eager``: on for the CPU suites (the CPU backend's graph compile only costs start-up time);
    #: ``make gpu-smoke`` turns it off, so CUDA graphs and the attention backend vLLM picks run as on a p5en.
    enforce_eager: bool = True
    #: Also start the peer-best arm (what a user would run instead of turnkv): a prefill engine of its own with
    #: prefix caching on and ``peer_prefill_blocks`` of KV cache (its device cache plus the memory vLLM's CPU
    #: offloading tier would take: that tier does not run on vLLM's CPU build), behind a router of its own over the
    #: same decode engines; its clients send ``X-TurnKV-Reuse: off`` (no decode-to-prefill reuse).
    peer: bool = False
    #: GiB of vLLM's CPU offloading tier beside turnkv's connector on the prefill engines (``MultiConnector``, as
    #: ``connector.prefill_offload_gib`` deploys it); the tier needs CUDA (``make gpu-smoke``), 0 on CPU engines.
    prefill_offload_gib: float = 0.0
    #: Exact KV block counts (vLLM ``--num-gpu-blocks-override``) per engine kind, to hold the stack at a target
    #: fleet's memory ratios (``turnkv.plan.ratios``); None: what the KV cache space holds.
    prefill_blocks: int | None = None
    peer_prefill_blocks: int | None = None
    decode_blocks: int | None = None
    #: Every engine's ``--max-model-len`` (None: the model's): small block counts need a short maximum, since vLLM
    #: refuses a cache that cannot hold one request of the maximum length.
    max_model_len: int | None = None

    @property
    def best_router_port(self) -> int:
        return self.router_port + 1

    @property
    def best_prefill_port(self) -> int:
        return self.prefill_port + 1

    @property
    def peer_router_port(self) -> int:
        return self.router_port + 2

    @property
    def peer_prefill_port(self) -> int:
        return self.prefill_port + 2

    @property
    def peer_side_channel_port(self) -> int:
        """Unused by the others: prefill i >= 1 takes base + 2 + 2i, decode i >= 1 base + 3 + 2i."""
        return self.side_channel_base + 3

    @property
    def model_dir(self) -> Path:
        return self.state_dir / "models" / f"tiny-{self.model_spec.fingerprint}"


def at_ratios(config: StackConfig, sizes: ratios.LocalSizes) -> StackConfig:
    """``config`` held at a target fleet's memory ratios (``turnkv.plan.ratios.scale``): exact block counts per
    engine kind, decode's retention share and host tier, and a maximum model length the smallest cache can hold
    (vLLM refuses a cache shorter than one request of the maximum length). Other tunables are kept."""
    fields = sizes.stack_fields()
    # vLLM keeps one block back (its null block): 16 blocks of 128 serve a request of 1,920 tokens, not 2,048.
    smallest = min(sizes.prefill_blocks, sizes.peer_prefill_blocks, sizes.decode_blocks)
    longest = min(config.model_spec.max_position_embeddings, (smallest - 1) * sizes.block_tokens)
    return replace(config, prefill_blocks=fields["prefill_blocks"], peer_prefill_blocks=fields["peer_prefill_blocks"],
                   decode_blocks=fields["decode_blocks"], max_model_len=longest,
                   tunables={**config.tunables, **fields["tunables"]})  # type: ignore[dict-item]


@dataclass
class ProcessSpec:
    name: str
    argv: list[str]
    env: dict[str, str]
    port: int
    health_url: str
    log: Path
    extra_ports: tuple[int, ...] = ()
    kind: str = "engine"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def offer_secret_path(config: StackConfig) -> Path:
    """The stack's offer secret (``turnkv.wire``): created by ``up``, shared by its engines."""
    return config.state_dir.resolve() / "offer-secret"


def ensure_offer_secret(path: Path) -> None:
    """Create the deployment's offer secret once (0600); engines of later ``up`` runs keep it."""
    if path.exists() and path.read_bytes().strip():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")



def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def rank_cores(cores: list[int], first: int, ranks: int) -> list[int]:
    """The cores an engine's tensor-parallel ranks run on, one each from ``first`` on (wrapping: on a 2-core
    machine a TP-2 engine shares a core with the other role's engine)."""
    start = cores.index(first) if first in cores else 0
    return [cores[(start + i) % len(cores)] for i in range(ranks)]


def _device_env(config: StackConfig, ranks: list[int]) -> dict[str, str]:
    """The engine environment that differs between vLLM's CPU build and the CUDA wheel."""
    if config.accelerator == Accelerator.CUDA:
        # UCX picks its CUDA transports (cuda_copy, cuda_ipc) for GPU memory; limiting UCX_TLS as on CPU would
        # leave it none that can reach VRAM.
        return {"CUDA_VISIBLE_DEVICES": config.cuda_devices}
    return {
        # NIXL over loopback; shared memory between engines on one host.
        "UCX_TLS": "tcp,self,shm",
        "UCX_NET_DEVICES": "lo",
        "VLLM_CPU_KVCACHE_SPACE": str(config.kv_cache_gib),
        # One core per rank ("0|1" for TP 2): vLLM's CPU backend binds each rank's OpenMP threads to its list.
        "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(c) for c in ranks) if ranks else "auto",
    }


def _engine_process(config: StackConfig, spec: EngineSpec, core: int | None) -> ProcessSpec:
    vllm = Path(sys.executable).with_name("vllm")
    argv = [str(vllm), *engine_args.serve_args(spec)]
    on_cpu = config.accelerator == Accelerator.CPU
    ranks = rank_cores(_cores(), core, spec.tensor_parallel_size) if core is not None and on_cpu else []
    if ranks and shutil.which("taskset"):
        argv = ["taskset", "-c", ",".join(str(c) for c in sorted(set(ranks))), *argv]
    if not on_cpu and spec.settings.gpu_memory_utilization is None:  # the settings' own share wins
        argv += ["--gpu-memory-utilization", str(config.gpu_memory_utilization)]
    state = config.state_dir.resolve()
    env = {
        **engine_args.serve_env(spec),
        **_device_env(config, ranks),
        "VLLM_CACHE_ROOT": str(state / "cache" / "vllm"),
        "TMPDIR": str(state / "tmp"),
        "HF_HOME": str(state / "cache" / "hf"),
        "PYTHONUNBUFFERED": "1",
        # The engine's connector from this checkout: `vllm` is an entry-point script, so without this an
        # editable install resolves `connector` to wherever it was installed from (another worktree's code).
        "PYTHONPATH": os.pathsep.join(p for p in (str(SOURCE_ROOT), os.environ.get("PYTHONPATH", "")) if p),
        params.TUNABLES_FILE_ENV: str(tunables_file(config)),
        wire.OFFER_SECRET_FILE_ENV: str(offer_secret_path(config)),
    }
    return ProcessSpec(spec.engine_id, argv, env, spec.port, f"http://127.0.0.1:{spec.port}/health",
                       state / "logs" / f"{spec.engine_id}.log", extra_ports=(spec.side_channel_port,))


def _router_process(config: StackConfig, name: str, port: int, prefill: list[str], decode: list[str],
                    router_tunables: dict[str, int | float]) -> ProcessSpec:
    argv = [sys.executable, "-m", "turnkv.cli", "router", "serve", "--host", "127.0.0.1", "--port", str(port)]
    for url in prefill:
        argv += ["--prefill", url]
    for url in decode:
        argv += ["--decode", url]
    for key, value in router_tunables.items():
        argv += ["--set", f"{key}={value}"]
    # The engines' offer secret: the router clears each offer it replays with it (turnkv.wire).
    env = {"PYTHONUNBUFFERED": "1", wire.OFFER_SECRET_FILE_ENV: str(offer_secret_path(config))}
    return ProcessSpec(name, argv, env, port, f"http://127.0.0.1:{port}/health",
                       config.state_dir.resolve() / "logs" / f"{name}.log", kind="router")


def tunables_file(config: StackConfig) -> Path:
    """The file the engines hot-reload (``params.TUNABLES_FILE_ENV``): the local stand-in for the node's SSM sync."""
    return config.state_dir.resolve() / TUNABLES_FILE


def engine_tunables_of(config: StackConfig) -> dict[str, int | float]:
    """This run's engine-scope tunables: the catalog's defaults with ``config.tunables`` (``--set``) over them."""
    values = params.validate(config.tunables)
    return {k: v for k, v in values.items() if params.BY_NAME[k].scope is params.Scope.ENGINE}


def write_tunables_file(config: StackConfig) -> None:
    """Start every run with a tunables file holding this run's engine values. The engines re-read the file over
    their start-up values, so one left by an earlier run (``make demo``'s pressure rows) would silently override
    ``--set``; the file is replaced, atomically, before any engine starts."""
    path = tunables_file(config)
    tmp = path.with_suffix(".json.new")
    tmp.write_text(json.dumps(engine_tunables_of(config), indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


def decode_sequences(config: StackConfig) -> int:
    """Sequences each decode engine of the stack runs at once (the router's ``decode_fair_sequences`` unless set):
    its ``max_num_seqs``, else vLLM's default for the accelerator (CPU: per tensor-parallel rank; a GPU here is
    taken as under 70 GiB, the smaller default)."""
    if config.engine_settings.max_num_seqs is not None:
        return config.engine_settings.max_num_seqs
    if config.accelerator == Accelerator.CPU:
        return es.VLLM_MAX_NUM_SEQS_CPU_PER_RANK * config.decode_tp
    return es.VLLM_MAX_NUM_SEQS_GPU


def plan(config: StackConfig) -> list[ProcessSpec]:
    """Every process of the stack, in start order. Pure: reads only the CPU affinity mask."""
    if config.accelerator not in ACCELERATORS:
        raise StackError(f"accelerator {config.accelerator!r} is not one of {', '.join(ACCELERATORS)}")
    if config.accelerator == Accelerator.CUDA and not 0 < config.gpu_memory_utilization <= 1:
        raise StackError(f"gpu_memory_utilization {config.gpu_memory_utilization} is not in (0, 1]")
    cores = _cores()
    prefill_core = cores[0]
    decode_core = cores[1] if len(cores) > 1 else cores[0]
    values = params.validate(config.tunables)
    engine_tunables = engine_tunables_of(config)
    router_tunables = {k: v for k, v in values.items()
                       if params.BY_NAME[k].scope is params.Scope.ROUTER or k == "decoder_kv_blocks_ttl"}
    if "decode_fair_sequences" not in config.tunables:  # values holds every default: set only if not --set
        router_tunables["decode_fair_sequences"] = decode_sequences(config)
    common = dict(model=str(config.model_dir.resolve()), served_model_name=SERVED_MODEL_NAME, mode=config.mode,
                  enforce_eager=config.enforce_eager, tunables=engine_tunables, dtype=config.model_spec.dtype,
                  max_model_len=config.max_model_len or config.model_spec.max_position_embeddings,
                  extra_args=config.engine_extra_args, settings=config.engine_settings)
    if config.best_case and config.prefill_engines > 1:
        raise StackError("best_case uses prefill_port + 1: run it with one prefill engine")
    if config.peer and config.prefill_engines > 2:
        raise StackError("peer uses prefill_port + 2: run it with at most two prefill engines")
    for name in ("prefill_blocks", "peer_prefill_blocks", "decode_blocks"):
        if (value := getattr(config, name)) is not None and value < 1:
            raise StackError(f"{name} {value} must be at least 1")

    def blocks(count: int | None) -> tuple[str, ...]:
        return ("--num-gpu-blocks-override", str(count)) if count is not None else ()
    if config.connector:
        common["connector"] = config.connector
        common["bidirectional"] = False
    def shape(tp: int, block_size: int | None) -> dict[str, int]:
        return {"tensor_parallel_size": tp, **({"block_size": block_size} if block_size else {})}

    prefills = [EngineSpec(role=Role.PREFILL, engine_id=f"prefill-{i}", port=config.prefill_port + i,
                           side_channel_port=config.side_channel_base + (0 if i == 0 else 2 + 2 * i),
                           prefix_caching=config.prefill_prefix_caching, prefill_offload_gib=config.prefill_offload_gib,
                           **shape(config.prefill_tp, config.prefill_block_size),
                           **{**common, "extra_args": (*config.engine_extra_args, *blocks(config.prefill_blocks))})
                for i in range(config.prefill_engines)]
    decodes = [EngineSpec(role=Role.DECODE, engine_id=f"decode-{i}", port=config.decode_port + i,
                          side_channel_port=config.side_channel_base + (1 if i == 0 else 3 + 2 * i),
                          prefix_caching=True, **shape(config.decode_tp, config.decode_block_size),
                          **{**common, "extra_args": (*config.engine_extra_args, *config.decode_extra_args,
                                                      *blocks(config.decode_blocks))})
               for i in range(config.decode_engines)]
    procs = [_engine_process(config, spec, prefill_core) for spec in prefills]
    procs += [_engine_process(config, spec, decode_core) for spec in decodes]
    if config.best_case:
        cached = EngineSpec(role=Role.PREFILL, engine_id="prefill-cached", port=config.best_prefill_port,
                            side_channel_port=config.side_channel_base + 2, prefix_caching=True, **common)
        procs.append(_engine_process(config, cached, prefill_core))
    if config.peer:
        peer = EngineSpec(role=Role.PREFILL, engine_id="prefill-peer", port=config.peer_prefill_port,
                          side_channel_port=config.peer_side_channel_port, prefix_caching=True,
                          **shape(config.prefill_tp, config.prefill_block_size),
                          **{**common, "extra_args": (*config.engine_extra_args, *blocks(config.peer_prefill_blocks))})
        procs.append(_engine_process(config, peer, prefill_core))

    def prefill_url(spec: EngineSpec) -> str:
        url = f"http://127.0.0.1:{spec.port}"
        if config.router_identity or config.mode is Mode.PUSH:  # push: concurrent legs need P's identity
            url += f"?engine_id={spec.engine_id}&side_channel_port={spec.side_channel_port}"
            if spec.tensor_parallel_size != 1:  # else the router's first push names TP 1 and decode is resent
                url += f"&tp_size={spec.tensor_parallel_size}"
        return url

    prefill_urls = [prefill_url(spec) for spec in prefills]
    decode_urls = [f"http://127.0.0.1:{spec.port}" for spec in decodes]
    router = _router_process(config, "router", config.router_port, prefill_urls, decode_urls, router_tunables)
    router.argv += list(config.router_args)
    mode_args = ["--mode", "push"] if config.mode is Mode.PUSH or config.connector == "NixlPushConnector" else []
    router.argv += mode_args
    procs.append(router)
    if config.best_case:
        procs.append(_router_process(config, "router-best", config.best_router_port,
                                     [f"http://127.0.0.1:{config.best_prefill_port}"], decode_urls, router_tunables))
    if config.peer:
        procs.append(_router_process(config, "router-peer", config.peer_router_port,
                                     [f"http://127.0.0.1:{config.peer_prefill_port}"], decode_urls, router_tunables))
    for extra in config.extra_routers:
        if wrong := sorted(k for k in extra.tunables if params.get(k).scope is not params.Scope.ROUTER):
            raise StackError(f"extra router {extra.name}: {', '.join(wrong)} are not router tunables; set them in "
                             "StackConfig.tunables (engines) or the tunables file")
        mine = params.validate({**config.tunables, **extra.tunables})  # cross-checked with the engines' values
        other = _router_process(config, extra.name, extra.port, prefill_urls, decode_urls,
                                {**router_tunables, **{k: mine[k] for k in extra.tunables}})
        other.argv += [*extra.args, *mode_args]
        procs.append(other)
    return procs


def start_batches(config: StackConfig, procs: list[ProcessSpec]) -> list[list[ProcessSpec]]:
    """The order ``up`` starts processes in, each batch healthy before the next. Engines start together on CPU
    (~1 min), one after another on a shared GPU: vLLM's memory profiling fails when another process frees GPU
    memory while it measures. Routers start once every engine is healthy."""
    engines = [p for p in procs if p.kind == "engine"]
    routers = [p for p in procs if p.kind == "router"]
    return [*([engines] if config.accelerator == Accelerator.CPU else [[p] for p in engines]), routers]


# -- process control ----------------------------------------------------------------------------


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _reap(pgid: int) -> None:
    """Collect exit statuses of our own children in the group, so they do not linger as zombies."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-pgid, os.WNOHANG)[0] > 0:
            pass


def _group_alive(pgid: int) -> bool:
    """True while any process of the group is still running (zombies do not count)."""
    _reap(pgid)
    proc = Path("/proc")
    if proc.is_dir():
        for stat in proc.glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


#: Seconds the group's leader (vLLM's API server) has to stop its own children before the whole group is signalled.
LEADER_GRACE_S = 10.0


def stop_group(pgid: int, grace: float = 20.0) -> None:
    """SIGTERM the group's leader first (vLLM's API server stops its engine core itself), then the whole group, then
    SIGKILL what is left after ``grace`` seconds. Signalling the group at once killed the engine core under the API
    server, which logged an EngineDeadError traceback at every stop (issue #49)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pgid, signal.SIGTERM)
    leader_deadline = time.monotonic() + min(grace, LEADER_GRACE_S)
    while _pid_alive(pgid) and _group_alive(pgid) and time.monotonic() < leader_deadline:
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):  # what the leader left, if anything
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _group_alive(pgid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        while _group_alive(pgid) and time.monotonic() < deadline + 5:
            time.sleep(0.1)


#: What marks a line of the router's log as a CloudWatch EMF object (router.telemetry.EmfWriter), not for a person.
EMF_MARK = '"_aws":{'


def tail(path: Path, lines: int = 20, keep_emf: bool = True) -> str:
    """The last ``lines`` lines of a log (without EMF lines unless ``keep_emf``); empty when unreadable."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join([line for line in text if keep_emf or EMF_MARK not in line][-lines:])


class Supervisor:
    def __init__(self, state_dir: Path | None = None) -> None:
        state_dir = default_state_dir() if state_dir is None else state_dir
        self.state_dir = state_dir
        self.state_file = state_dir / "state.json"

    # state ---------------------------------------------------------------------------------------

    def load(self) -> dict:
        try:
            return json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return {"components": {}}

    def _save(self, state: dict) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_file)

    def running(self) -> dict[str, dict]:
        return {n: c for n, c in self.load()["components"].items() if _group_alive(c["pgid"])}

    # start ---------------------------------------------------------------------------------------

    def up(self, config: StackConfig, on_event: Callable[[str, str], None] = lambda name, event: None) -> dict:
        if self.running():
            raise StackError(f"a local stack is already running (state in {self.state_file}); "
                             "run `turnkv local down` first, or `turnkv local status`")
        procs = plan(config)
        busy = [(p.name, port) for p in procs for port in (p.port, *p.extra_ports) if port_in_use(port)]
        if busy:
            details = ", ".join(f"{port} ({name})" for name, port in busy)
            raise StackError(f"port(s) already in use: {details}. Stop whatever holds them, or choose other "
                             "ports (--port for the router, --engine-port-base for the engines)")
        if not Path(sys.executable).with_name("vllm").exists():
            fix = ("run `make setup` (it installs the engines extra and the CPU fixes)"
                   if config.accelerator == Accelerator.CPU else "`make gpu-smoke` builds the CUDA venv")
            raise StackError(f"vLLM is not installed in this environment; {fix}")
        if config.accelerator == Accelerator.CUDA and (cpu_build := engine_env.cpu_build_vllm()):
            raise StackError(f"--accelerator cuda needs vLLM's CUDA wheel; this environment has vllm {cpu_build} "
                             "(the CPU build). Run from a venv with the GPU image's pins: `make gpu-smoke` builds "
                             ".venv-gpu")
        if config.accelerator == Accelerator.CPU and (why := engine_env.fp8_kv_refusal(
                config.engine_settings.kv_cache_dtype, engine_env.cpu_flags())):
            raise StackError(why)
        on_event("model", "building")
        model_maker.build(config.model_dir, config.model_spec)
        on_event("model", "ready")
        for sub in ("logs", "tmp", "cache"):
            (config.state_dir / sub).mkdir(parents=True, exist_ok=True)
        ensure_offer_secret(offer_secret_path(config))
        write_tunables_file(config)
        state = {"config": _jsonable(config), "components": {}, "started_at": time.time()}
        try:
            for batch in start_batches(config, procs):
                for proc in batch:
                    state["components"][proc.name] = self._spawn(proc)
                    self._save(state)
                    on_event(proc.name, "starting")
                self._wait_healthy(batch, state, config.startup_timeout, on_event)
        except BaseException:
            self.down()
            raise
        return state

    def _spawn(self, proc: ProcessSpec) -> dict:
        proc.log.parent.mkdir(parents=True, exist_ok=True)
        with open(proc.log, "ab") as log:
            log.write(f"\n=== turnkv: starting {proc.name} at {time.ctime()}: {' '.join(proc.argv)}\n".encode())
            log.flush()
            child = subprocess.Popen(proc.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **proc.env}, start_new_session=True)
        return {"pid": child.pid, "pgid": child.pid, "port": proc.port, "url": proc.url, "log": str(proc.log),
                "kind": proc.kind, "health_url": proc.health_url, "argv": proc.argv}

    def _wait_healthy(self, batch: list[ProcessSpec], state: dict, timeout: float,
                      on_event: Callable[[str, str], None]) -> None:
        pending = {p.name: p for p in batch}
        deadline = time.monotonic() + timeout
        while pending:
            for name, proc in list(pending.items()):
                info = state["components"][name]
                if not _pid_alive(info["pid"]):
                    raise StackError(f"{name} exited during start-up; see {proc.log}\n--- last lines ---\n"
                                     f"{tail(proc.log)}")
                if _healthy(proc.health_url):
                    del pending[name]
                    on_event(name, "healthy")
            if pending and time.monotonic() > deadline:
                names = ", ".join(pending)
                logs = ", ".join(str(p.log) for p in pending.values())
                raise StackError(f"{names} not healthy after {timeout:.0f} s; see {logs}")
            time.sleep(0.5)

    # stop ----------------------------------------------------------------------------------------

    def down(self, on_event: Callable[[str, str], None] = lambda name, event: None) -> list[str]:
        state = self.load()
        stopped = []
        for name, info in reversed(list(state["components"].items())):
            if _group_alive(info["pgid"]):
                on_event(name, "stopping")
                stop_group(info["pgid"])
                stopped.append(name)
            on_event(name, "stopped")
        with contextlib.suppress(FileNotFoundError):
            self.state_file.unlink()
        return stopped

    def status(self) -> Iterator[dict]:
        for name, info in self.load()["components"].items():
            alive = _group_alive(info["pgid"])
            yield {"name": name, "pid": info["pid"], "url": info["url"], "alive": alive,
                   "healthy": alive and _healthy(info["health_url"]), "log": info["log"]}


def _pid_alive(pid: int) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # not our child (status from another process): ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return waited == 0


def _jsonable(config: StackConfig) -> dict:
    data = asdict(config)
    data["state_dir"] = str(config.state_dir)
    data["mode"] = config.mode.value
    return data
