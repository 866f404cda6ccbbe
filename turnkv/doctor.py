"""Checks of an engine node (or an image being baked): the field failures of the EFA / NIXL / driver layer.

Each check takes a :class:`Node` (how to run a command, read a file, sleep, tell the time) and returns a
:class:`CheckResult` (pass, fail or skip, what was seen, and the fix). The node is injected, so every check
is unit-tested with canned outputs; :func:`real_node` is the machine's. ``turnkv doctor`` prints them.

``image=True`` is for Image Builder instances: they have no EFA interfaces, so the EFA device check is
skipped (``turnkv-efa-wait`` enforces it at every engine start) and NIXL is only asked whether the LIBFABRIC
plugin loads, not to bring up a LIBFABRIC backend on a device.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum

from turnkv import neuron, node_env, platforms, versions

VENV_PYTHON = "/opt/turnkv/venv/bin/python"
NIXL_ENV_FILE = "/etc/turnkv/nixl.env"
#: What the AMI's first step recorded (gpu or neuron).
FLAVOR_FILE = "/var/lib/turnkv/ami/flavor"
FLAVORS = ("gpu", "neuron")


class Status(StrEnum):
    PASS = "pass"
    FAIL = "fail"
    SKIP = "skip"


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: Status
    detail: str
    fix: str = ""

    def as_dict(self) -> dict[str, str]:
        out = asdict(self)
        out["status"] = self.status.value
        return out


@dataclass(frozen=True)
class Completed:
    returncode: int
    stdout: str = ""
    stderr: str = ""


#: run(argv, extra_env, timeout_s) -> Completed; a missing program is returncode 127.
Runner = Callable[[Sequence[str], Mapping[str, str] | None, float], Completed]


@dataclass(frozen=True)
class Node:
    run: Runner
    read_text: Callable[[str], str | None]
    sleep: Callable[[float], None]
    monotonic: Callable[[], float]
    kernel_release: Callable[[], str]
    python: str = VENV_PYTHON
    efa_prefix: str = versions.EFA_PREFIX


@dataclass(frozen=True)
class Options:
    flavor: str = "gpu"
    image: bool = False
    #: How long to wait for a late EFA device (p5en brings them up after boot).
    retry_seconds: float = 60.0
    retry_interval: float = 5.0
    #: CUDA memory the gpu-memory-registration check registers with LIBFABRIC (the issue asks for >= 1 GiB).
    vram_mib: int = 1024
    #: The host tier the host-tier-registration check plans (None: the node's host_kv_budget_mib).
    host_tier_mib: int | None = None


# --- the real machine --------------------------------------------------------------------------------------


def _run(argv: Sequence[str], extra_env: Mapping[str, str] | None = None, timeout: float = 120.0) -> Completed:
    import os

    env = {**os.environ, **(extra_env or {})}
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, env=env)
    except FileNotFoundError as exc:
        return Completed(127, "", str(exc))
    except subprocess.TimeoutExpired:
        return Completed(124, "", f"{argv[0]} timed out after {timeout:.0f}s")
    return Completed(proc.returncode, proc.stdout, proc.stderr)


def _read_text(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return None


def real_node(python: str | None = None) -> Node:
    import os
    import platform
    import sys

    chosen = python or (VENV_PYTHON if os.access(VENV_PYTHON, os.X_OK) else sys.executable)
    return Node(run=_run, read_text=_read_text, sleep=time.sleep, monotonic=time.monotonic,
                kernel_release=platform.release, python=chosen)


def detect_flavor(node: Node) -> str:
    recorded = (node.read_text(FLAVOR_FILE) or "").strip()
    return recorded if recorded in FLAVORS else "gpu"


# --- helpers -----------------------------------------------------------------------------------------------


def _tail(text: str, lines: int = 3) -> str:
    kept = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " | ".join(kept[-lines:]) if kept else "no output"


def parse_env_file(text: str | None) -> dict[str, str]:
    """A node env file through the one parser (turnkv.node_env); a malformed file reads as empty."""
    try:
        return node_env.parse(text or "")
    except node_env.NodeEnvError:
        return {}


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def _last_json(text: str) -> dict | None:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


# --- checks ------------------------------------------------------------------------------------------------


def check_libfabric(node: Node, opts: Options) -> CheckResult:
    """The EFA installer's libfabric is the pinned one and no other libfabric.so.1 comes first."""
    name = "efa-libfabric"
    fi_info = f"{node.efa_prefix}/bin/fi_info"
    install_fix = (f"install the EFA installer {versions.EFA_INSTALLER} (libfabric {versions.LIBFABRIC}); "
                   "the AMI's turnkv-efa component does")
    out = node.run([fi_info, "--version"], None, 30)
    if out.returncode != 0:
        return CheckResult(name, Status.FAIL, f"{fi_info} --version failed: {_tail(out.stderr or out.stdout)}",
                           install_fix)
    found = re.search(r"^libfabric:\s*(\S+)", out.stdout, re.M)
    have = found.group(1) if found else "unknown"
    if not have.startswith(versions.LIBFABRIC):
        return CheckResult(name, Status.FAIL, f"libfabric {have} at {node.efa_prefix}, pinned {versions.LIBFABRIC}",
                           install_fix)
    cache = node.run(["ldconfig", "-p"], None, 30)
    entries = re.findall(r"libfabric\.so\.1 \([^)]*\) => (\S+)", cache.stdout)
    if entries and not entries[0].startswith(f"{node.efa_prefix}/"):
        return CheckResult(name, Status.FAIL,
                           f"the loader finds {entries[0]} before {node.efa_prefix}/lib/libfabric.so.1",
                           "remove the distro libfabric (apt-get remove libfabric1) or restore "
                           "/etc/ld.so.conf.d/000_efa.conf and run ldconfig")
    return CheckResult(name, Status.PASS, f"libfabric {have} at {node.efa_prefix}")


def check_efa_device(node: Node, opts: Options) -> CheckResult:
    """`fi_info -p efa` finds a device, waiting up to retry_seconds for late EFA devices."""
    name = "efa-device"
    if opts.image:
        return CheckResult(name, Status.SKIP, "image build: Image Builder instances have no EFA interface; "
                           "turnkv-efa-wait checks before every engine start")
    fi_info = f"{node.efa_prefix}/bin/fi_info"
    deadline = node.monotonic() + max(0.0, opts.retry_seconds)
    attempts = 0
    while True:
        attempts += 1
        out = node.run([fi_info, "-p", "efa"], None, 30)
        if out.returncode == 127:  # not installed: no device will appear by waiting
            return CheckResult(name, Status.FAIL, f"{fi_info} is not installed: {_tail(out.stderr or out.stdout)}",
                               f"install the EFA installer {versions.EFA_INSTALLER} (the AMI's turnkv-efa component)")
        if out.returncode == 0 and "provider: efa" in out.stdout:
            devices = sorted(set(re.findall(r"domain:\s*(\S+)", out.stdout)))
            return CheckResult(name, Status.PASS,
                               f"{len(devices)} EFA domain(s) visible to libfabric (attempt {attempts})")
        if node.monotonic() >= deadline:
            break
        node.sleep(min(opts.retry_interval, max(0.0, deadline - node.monotonic())))
    return CheckResult(
        name, Status.FAIL,
        f"'fi_info -p efa' found no EFA device after {opts.retry_seconds:.0f}s ({attempts} tries): "
        f"{_tail(out.stderr or out.stdout)}",
        "attach EFA interfaces in the launch template (InterfaceType efa or efa-only on every network card); "
        "in a container, mount /dev/infiniband; on p5en wait longer (--retry-seconds)")


NIXL_PROBE = r"""
import json, sys
from nixl._api import nixl_agent, nixl_agent_config
backends = [] if sys.argv[1] == "image" else ["LIBFABRIC"]
agent = nixl_agent("turnkv-doctor", nixl_agent_config(enable_prog_thread=False, backends=backends))
mems = {b: sorted(getattr(m, "name", str(m)).removesuffix("_SEG") for m in agent.get_backend_mem_types(b))
        for b in agent.backends}
print(json.dumps({"plugins": sorted(agent.plugin_list), "backends": sorted(agent.backends), "mems": mems}))
"""


def check_nixl(node: Node, opts: Options) -> CheckResult:
    """NIXL's LIBFABRIC plugin links the EFA libfabric and a nixl agent instantiates the LIBFABRIC backend."""
    name = "nixl-libfabric"
    rebuild = "re-run the AMI's turnkv-nixl component (it builds NIXL against the EFA libfabric when needed)"
    env = parse_env_file(node.read_text(NIXL_ENV_FILE))
    plugin_dir = env.get("NIXL_PLUGIN_DIR")
    if not plugin_dir:
        return CheckResult(name, Status.FAIL, f"{NIXL_ENV_FILE} is missing or names no NIXL_PLUGIN_DIR", rebuild)
    plugin = f"{plugin_dir}/libplugin_LIBFABRIC.so"
    ldd = node.run(["ldd", plugin], env, 30)
    lines = [line.strip() for line in (ldd.stdout + ldd.stderr).splitlines() if "libfabric" in line]
    want = f"=> {node.efa_prefix}/lib/libfabric.so"
    if ldd.returncode != 0 or not lines or any("not found" in line for line in lines) or want not in lines[0]:
        seen = "; ".join(lines) or _tail(ldd.stderr or ldd.stdout)
        return CheckResult(name, Status.FAIL, f"{plugin} does not link {node.efa_prefix}/lib/libfabric.so.1 ({seen})",
                           rebuild)
    probe = node.run([node.python, "-c", NIXL_PROBE, "image" if opts.image else "node"], env, 120)
    result = _last_json(probe.stdout)
    if probe.returncode != 0 or result is None:
        return CheckResult(name, Status.FAIL, f"nixl agent failed: {_tail(probe.stderr or probe.stdout)}",
                           f"check the EFA device and {NIXL_ENV_FILE}; {rebuild}")
    if "LIBFABRIC" not in result.get("plugins", []):
        return CheckResult(name, Status.FAIL, f"NIXL does not load the LIBFABRIC plugin from {plugin_dir} "
                           f"(plugins: {', '.join(result.get('plugins', [])) or 'none'})", rebuild)
    if not opts.image and "LIBFABRIC" not in result.get("backends", []):
        return CheckResult(name, Status.FAIL, "the LIBFABRIC plugin loads but no LIBFABRIC backend was instantiated",
                           "check 'fi_info -p efa' and GPUDirect RDMA (the plugin requires it)")
    mems = (result.get("mems") or {}).get("LIBFABRIC", [])
    if opts.flavor == "neuron" and not opts.image and "VRAM" not in mems:
        # vLLM registers the KV cache as VRAM (kv_buffer_device cuda); without it the engine stops at start.
        return CheckResult(name, Status.FAIL, f"the LIBFABRIC backend offers {', '.join(mems) or 'no'} memory, not "
                           "VRAM: it found no Neuron runtime, so NIXL will refuse the engines' KV cache",
                           neuron.DEVICE_MEMORY_NEEDS)
    what = "plugin loads" if opts.image else "backend instantiated"
    offers = f", offers {'/'.join(mems)}" if mems else ""
    return CheckResult(name, Status.PASS, f"LIBFABRIC {what}{offers}; linked to {node.efa_prefix}/lib/libfabric.so.1")


def check_gdr(node: Node, opts: Options) -> CheckResult:
    """GPUDirect RDMA for the LIBFABRIC plugin: dma-buf (kernel >= 5.12, open NVIDIA module) or efa-nv-peermem."""
    name = "gpudirect-rdma"
    if opts.flavor == "neuron":
        return CheckResult(name, Status.SKIP, "Neuron image: no NVIDIA GPU")
    ok, state = gdr_state(node)
    if ok:
        return CheckResult(name, Status.PASS, state)
    return CheckResult(name, Status.FAIL, state, GDR_FIX)


GDR_FIX = ("use the OSS NVIDIA driver base AMI (kernel >= 5.12), or modprobe efa_nv_peermem "
           "(EFA installer package efa-nv-peermem)")


def gdr_state(node: Node) -> tuple[bool, str]:
    """Whether the node offers GPUDirect RDMA to libfabric (dma-buf or efa_nv_peermem), and what was seen."""
    modules = node.read_text("/proc/modules") or ""
    if re.search(r"^efa_nv_peermem\s", modules, re.M):
        return True, "efa_nv_peermem module loaded"
    release = node.kernel_release()
    kernel_ok = _version_tuple(release)[:2] >= (5, 12)
    driver = node.read_text("/proc/driver/nvidia/version") or ""
    open_module = "Open Kernel Module" in driver
    if kernel_ok and open_module:
        return True, f"dma-buf: kernel {release} and the open NVIDIA kernel module"
    missing = []
    if not kernel_ok:
        missing.append(f"kernel {release} < 5.12")
    if not open_module:
        missing.append("the NVIDIA kernel module is not the open one" if driver else "no NVIDIA driver loaded")
    return False, f"no dma-buf ({'; '.join(missing)}) and efa_nv_peermem is not loaded"


VRAM_PROBE = r"""
import json, sys, time
size = int(sys.argv[1])
try:
    import torch
except Exception as exc:
    print(json.dumps({"cuda": False, "reason": f"torch does not import ({type(exc).__name__}: {exc})"}))
    sys.exit(0)
if not torch.cuda.is_available():
    print(json.dumps({"cuda": False, "reason": "torch.cuda.is_available() is False"}))
    sys.exit(0)
out = {"cuda": True, "gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count()}
from nixl._api import nixl_agent, nixl_agent_config
try:
    agent = nixl_agent("turnkv-doctor-vram", nixl_agent_config(enable_prog_thread=False, backends=["LIBFABRIC"]))
except Exception as exc:
    out.update(backends=[], backend_error=f"{type(exc).__name__}: {exc}")
    print(json.dumps(out))
    sys.exit(0)
out.update(plugins=sorted(agent.plugin_list), backends=sorted(agent.backends))
if "LIBFABRIC" not in agent.backends:
    print(json.dumps(out))
    sys.exit(0)
tensor = torch.zeros(size, dtype=torch.uint8, device="cuda:0")
started = time.monotonic()
try:  # as vLLM's NIXL worker registers its KV caches: (address, bytes, device, "") descriptors of VRAM
    descs = agent.get_reg_descs([(tensor.data_ptr(), size, 0, "")], "VRAM")
    agent.register_memory(descs, backends=["LIBFABRIC"])
    out.update(registered=True, seconds=round(time.monotonic() - started, 3))
    agent.deregister_memory(descs, backends=["LIBFABRIC"])
except Exception as exc:
    out.update(registered=False, error=f"{type(exc).__name__}: {exc}")
print(json.dumps(out))
"""


def check_gpu_memory(node: Node, opts: Options) -> CheckResult:
    """A LIBFABRIC nixl agent registers CUDA memory, as vLLM's register_kv_caches will (dma-buf or peer memory)."""
    name = "gpu-memory-registration"
    if opts.flavor == "neuron":
        return CheckResult(name, Status.SKIP, "Neuron image: no NVIDIA GPU")
    if opts.image:
        return CheckResult(name, Status.SKIP, "image build: no EFA interface, so no LIBFABRIC backend to register "
                           "with; run turnkv doctor on a node")
    env = parse_env_file(node.read_text(NIXL_ENV_FILE))
    if not env.get("NIXL_PLUGIN_DIR"):
        return CheckResult(name, Status.SKIP, f"no LIBFABRIC: {NIXL_ENV_FILE} names no NIXL_PLUGIN_DIR "
                           "(see nixl-libfabric)")
    size = max(1, opts.vram_mib) << 20
    probe = node.run([node.python, "-c", VRAM_PROBE, str(size)], env, 180)
    result = _last_json(probe.stdout)
    if probe.returncode != 0 or result is None:
        return CheckResult(name, Status.FAIL, f"the registration probe failed: {_tail(probe.stderr or probe.stdout)}",
                           "run the probe by hand: it allocates CUDA memory and creates a LIBFABRIC nixl agent")
    if not result.get("cuda"):
        return CheckResult(name, Status.SKIP, f"no CUDA device: {result.get('reason', 'unknown')} (see driver-cuda)")
    if "LIBFABRIC" not in result.get("backends", []):
        why = result.get("backend_error") or f"plugins: {', '.join(result.get('plugins', [])) or 'none'}"
        return CheckResult(name, Status.SKIP, f"no LIBFABRIC backend to register with ({why}; see nixl-libfabric)")
    gdr_ok, gdr = gdr_state(node)
    where = f"{opts.vram_mib} MiB of CUDA memory on {result.get('gpu', 'GPU 0')}"
    if result.get("registered"):
        return CheckResult(name, Status.PASS,
                           f"LIBFABRIC registered {where} in {float(result.get('seconds', 0)):.2f}s; {gdr}")
    fix = ("GPUDirect RDMA for EFA: dma-buf needs kernel >= 5.12 and the open NVIDIA kernel module (the OSS "
           "NVIDIA driver base AMI); otherwise load the peer-memory module: modprobe efa_nv_peermem (EFA "
           "installer package efa-nv-peermem; nvidia-peermem on InfiniBand)")
    if gdr_ok:
        fix += "; dma-buf or peer memory looks present, so check the EFA installer version and dmesg"
    return CheckResult(name, Status.FAIL, f"LIBFABRIC could not register {where}: {result.get('error', 'unknown')}; "
                       f"{gdr}", fix)


def _engine_host_tier(node: Node, opts: Options) -> tuple[int, int, str, str] | str:
    """(budget MiB, TP size, NIXL backend, where the budget came from) of this node's decode engine, or why there
    is no host tier to check."""
    from turnkv import engine_run

    text = node.read_text(ENGINE_ENV_FILE)
    if text is None:
        return f"{ENGINE_ENV_FILE} not written yet"
    try:
        variables = node_env.parse(text)
        env = node_env.EngineEnv.from_variables(variables)
        tunables_file = variables.get(node_env.TUNABLES_FILE_VAR) or node_env.TUNABLES_FILE
        budget, source = (opts.host_tier_mib, "--host-tier-mib") if opts.host_tier_mib is not None else (
            int(engine_run.load_tunables(tunables_file, node.read_text)[0].get("host_kv_budget_mib", 0)),
            f"host_kv_budget_mib ({tunables_file})")
    except Exception as exc:  # engine-env reports the env file's errors
        return f"the engine's settings do not load ({exc}; see engine-env)"
    if env.role.value != "decode":
        return f"a {env.role.value} node: the host tier is decode's"
    if budget <= 0:
        return f"{source} is 0: no host tier"
    backend = "LIBFABRIC" if "LIBFABRIC" in [b.upper() for b in env.backends] else "UCX"
    return budget, env.tp_size, backend, source


def check_host_tier(node: Node, opts: Options) -> CheckResult:
    """The decode engine's host tier as it will start: the per-rank pool plan (NUMA node, page size, regions within
    the fabric's limits), allocated, pinned and registered on one NUMA node's ranks as the engine does, and READ
    between two NIXL agents (``connector.pool_probe``). Says what the node grants against what is configured."""
    name = "host-tier-registration"
    if opts.flavor == "neuron":
        return CheckResult(name, Status.SKIP, "Neuron image: the host tier needs vLLM 0.32's NIXL worker")
    if opts.image:
        return CheckResult(name, Status.SKIP, "image build: no EFA interface and no engine settings; run turnkv "
                           "doctor on a decode node")
    engine = _engine_host_tier(node, opts)
    if isinstance(engine, str):
        return CheckResult(name, Status.SKIP, engine)
    budget, tp, backend, source = engine
    env = parse_env_file(node.read_text(NIXL_ENV_FILE))
    probe = node.run([node.python, "-m", "connector.pool_probe", "--budget-mib", str(budget), "--tp", str(tp),
                      "--backend", backend], env, 900)
    result = _last_json(probe.stdout)
    if probe.returncode != 0 or result is None:
        return CheckResult(name, Status.FAIL, f"the pool probe failed: {_tail(probe.stderr or probe.stdout)}",
                           f"run it by hand: {node.python} -m connector.pool_probe --budget-mib {budget} --tp {tp}")
    granted, configured = int(result.get("granted_bytes", 0)), int(result.get("configured_bytes", 0))
    ranks = result.get("ranks", [])
    reads = sum(int(r.get("read_descriptors", 0)) for r in ranks)
    seen = (f"{source}={budget} MiB at TP {tp}: the {len(ranks)} rank(s) on NUMA node {result.get('numa_node')} "
            f"registered {granted / 2**30:.2f} of {configured / 2**30:.2f} GiB ({backend}, "
            f"{int(result.get('page_size', 4096)) // 1024} KiB pages); {reads} slots READ back by a second agent")
    refused = [line for r in ranks for line in r.get("refused", [])]
    if result.get("error"):
        return CheckResult(name, Status.FAIL, f"{seen}; {result['error']}",
                           "check NIXL's LIBFABRIC backend (nixl-libfabric) and the engine log's host tier lines")
    # Whole slots: a rank may pin up to one slot less than its share.
    short = configured - granted > len(ranks) * 64 * 2**20
    if granted <= 0 or short:
        fix = ("reserve 2 MiB hugepages on each NUMA node (vm.nr_hugepages; 4 KiB pages cap a p5en rank near "
               "21 GiB of EFA page entries), raise the locked-memory limit (ulimit -l unlimited), or lower "
               "host_kv_budget_mib to what the node grants")
        detail = f"{seen}; refused: {refused[0] if refused else 'planned smaller (see the plan)'}"
        return CheckResult(name, Status.FAIL, ("NO HOST TIER: " if granted <= 0 else "SHRUNK: ") + detail, fix)
    return CheckResult(name, Status.PASS, seen)


TORCH_PROBE = "import torch; print(torch.version.cuda or '')"


def check_driver(node: Node, opts: Options) -> CheckResult:
    """GPU: the NVIDIA driver is new enough and supports the CUDA torch was built for. Neuron: neuron-ls."""
    if opts.flavor == "neuron":
        name = "neuron-devices"
        out = node.run(["neuron-ls", "--json-output"], None, 60)
        try:
            devices = json.loads(out.stdout) if out.returncode == 0 else None
        except json.JSONDecodeError:
            devices = None
        if not devices:
            return CheckResult(name, Status.FAIL,
                               f"neuron-ls found no Neuron device: {_tail(out.stderr or out.stdout)}",
                               "run on a Trainium instance with the Neuron driver (aws-neuronx-dkms) loaded")
        return CheckResult(name, Status.PASS, f"{len(devices)} Neuron device(s)")
    name = "driver-cuda"
    smi = node.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], None, 60)
    if smi.returncode != 0 or not smi.stdout.strip():
        return CheckResult(name, Status.FAIL, f"nvidia-smi failed: {_tail(smi.stderr or smi.stdout)}",
                           f"use the base OSS NVIDIA driver AMI (driver >= {versions.NVIDIA_DRIVER_MIN})")
    driver = smi.stdout.strip().splitlines()[0].strip()
    header = node.run(["nvidia-smi"], None, 60)
    found = re.search(r"CUDA Version:\s*([\d.]+)", header.stdout)
    driver_cuda = found.group(1) if found else ""
    torch = node.run([node.python, "-c", TORCH_PROBE], None, 120)
    torch_cuda = torch.stdout.strip().splitlines()[-1].strip() if torch.returncode == 0 and torch.stdout.strip() else ""
    problems = []
    if _version_tuple(driver)[:1] < _version_tuple(versions.NVIDIA_DRIVER_MIN)[:1]:
        problems.append(f"driver {driver} is older than {versions.NVIDIA_DRIVER_MIN}")
    if not torch_cuda:
        problems.append(f"torch in {node.python} reports no CUDA ({_tail(torch.stderr or torch.stdout, 1)})")
    else:
        if _version_tuple(torch_cuda)[:1] != _version_tuple(versions.CUDA)[:1]:
            problems.append(f"torch is built for CUDA {torch_cuda}, the image pins CUDA {versions.CUDA}")
        if not driver_cuda:
            problems.append("nvidia-smi shows no CUDA version")
        elif _version_tuple(torch_cuda)[:2] > _version_tuple(driver_cuda)[:2]:
            problems.append(f"driver {driver} supports CUDA up to {driver_cuda}, torch needs {torch_cuda}")
    if problems:
        return CheckResult(name, Status.FAIL, "; ".join(problems),
                           f"bake on the base OSS NVIDIA driver AMI whose driver supports CUDA {versions.CUDA}, "
                           f"and install vllm=={versions.VLLM_GPU} (its torch) in /opt/turnkv/venv")
    return CheckResult(name, Status.PASS, f"driver {driver} (CUDA <= {driver_cuda}), torch CUDA {torch_cuda}")


VERSIONS_PROBE = r"""
import importlib, importlib.metadata as md, json, sys
dists, modules = sys.argv[1].split(","), sys.argv[2].split(",")
out = {"versions": {}, "errors": {}}
for dist in dists:
    try:
        out["versions"][dist] = md.version(dist)
    except md.PackageNotFoundError:
        out["versions"][dist] = None
for module in modules:
    try:
        importlib.import_module(module)
    except Exception as exc:
        out["errors"][module] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def expected_versions(flavor: str) -> dict[str, str]:
    if flavor == "neuron":
        return {"vllm": versions.VLLM_NEURON_CORE, "vllm-neuron": versions.VLLM_NEURON, "nixl": versions.NIXL,
                "turnkv": versions.TURNKV}
    return {"vllm": versions.VLLM_GPU, "nixl": versions.NIXL, "turnkv": versions.TURNKV}


#: Importing the connector modules runs their version guard (connector.compat) against the installed vLLM.
CONNECTOR_MODULES = ("connector.pull", "connector.push")


def check_versions(node: Node, opts: Options) -> CheckResult:
    """vLLM and the connector import, at the versions pinned in turnkv/versions.py."""
    name = "pinned-versions"
    want = expected_versions(opts.flavor)
    modules = ["vllm", *CONNECTOR_MODULES, "nixl"] + (["vllm_neuron"] if opts.flavor == "neuron" else [])
    out = node.run([node.python, "-c", VERSIONS_PROBE, ",".join(want), ",".join(modules)], None, 300)
    result = _last_json(out.stdout)
    if out.returncode != 0 or result is None:
        return CheckResult(name, Status.FAIL, f"{node.python} could not run: {_tail(out.stderr or out.stdout)}",
                           "the AMI installs /opt/turnkv/venv; pass --python for another interpreter")
    problems = [f"{dist} {(result['versions'].get(dist) or 'missing').split('+', 1)[0]} (pinned {pin})"
                for dist, pin in want.items() if (result["versions"].get(dist) or "").split("+", 1)[0] != pin]
    problems += [f"import {module}: {error}" for module, error in sorted(result["errors"].items())]
    if problems:
        return CheckResult(name, Status.FAIL, "; ".join(problems),
                           "rebake the image from turnkv/versions.py (or pip install the pinned versions into "
                           "/opt/turnkv/venv)")
    return CheckResult(name, Status.PASS, ", ".join(f"{dist} {pin}" for dist, pin in want.items()) +
                       f"; {', '.join(modules)} import")


def check_connector_code(node: Node, opts: Options) -> CheckResult:
    """The installed vLLM's connector files are the bytes the engine suites ran (turnkv/vllm_files.json)."""
    name = "connector-code"
    out = node.run([node.python, "-m", "turnkv.vllm_files"], None, 120)
    if out.returncode != 0:
        return CheckResult(name, Status.FAIL, _tail(out.stderr or out.stdout, 6),
                           "install the vLLM this image pins (turnkv/versions.py IMAGE_VLLM): other builds or "
                           "releases run connector code no turnkv suite has run")
    return CheckResult(name, Status.PASS, _tail(out.stdout, 1))


ENGINE_ENV_FILE = node_env.ENGINE_ENV_FILE


@dataclass(frozen=True)
class SlotEngine:
    """Engine ``slot`` of a node of several engines, as its units see it: engine.env with its slot's file over it
    (``turnkv-engine@<slot>`` reads both, in that order). ``env`` is None when the variables do not validate."""

    slot: int
    path: str
    variables: dict[str, str]
    env: node_env.EngineEnv | None
    error: str = ""
    #: False when the slot file itself does not parse (its variables are then unknown, not engine.env's).
    readable: bool = True

    @property
    def source(self) -> str:
        return f"{self.path} over {ENGINE_ENV_FILE}"

    def name(self, check: str) -> str:
        """``engine-env@1``: the check, and the engine as its template units' instance names it."""
        return f"{check}@{self.slot}"

    @property
    def label(self) -> str:
        """How report lines name the engine: its slot, and its engine id when the file gives one."""
        engine_id = self.variables.get(node_env.ENGINE_ID, "")
        return f"engine {self.slot}" + (f" ({engine_id})" if engine_id else "")


def slot_engines(node: Node) -> list[SlotEngine]:
    """The engines of a node that runs several: the slot files the user data writes (``node_env.engine_env_file``:
    ``engine-0.env``, ``engine-1.env``, ... with no gap), each layered over engine.env. Empty on a node of one
    engine (engine.env alone) and on an image build."""
    shared_text = node.read_text(ENGINE_ENV_FILE)
    if shared_text is None:
        return []
    shared = parse_env_file(shared_text)
    out = []
    for slot in range(node_env.MAX_ENGINES_PER_NODE):
        path = node_env.engine_env_file(slot)
        text = node.read_text(path)
        if text is None:
            break
        try:
            variables = {**shared, **node_env.parse(text)}
        except node_env.NodeEnvError as exc:
            out.append(SlotEngine(slot, path, {}, None, f"{path}: {exc}", readable=False))
            continue
        try:
            env = node_env.EngineEnv.from_variables(variables, source=f"{path} over {ENGINE_ENV_FILE}")
        except node_env.NodeEnvError as exc:
            out.append(SlotEngine(slot, path, variables, None, str(exc)))
            continue
        out.append(SlotEngine(slot, path, variables, env))
    return out


def _engine_env_result(name: str, variables: Mapping[str, str], env: node_env.EngineEnv, opts: Options,
                       where: str = "") -> CheckResult:
    """An engine's variables validated (``env``): may it start on this platform, and what it runs."""
    refusal = platforms.refusal(opts.flavor, variables)
    if refusal:
        return CheckResult(name, Status.FAIL, where + refusal,
                           f"the engine will not start on {opts.flavor} as configured")
    return CheckResult(name, Status.PASS, f"{where}{env.role.value} engine {env.engine_id}: {env.mode.value}, "
                       f"TP {env.tp_size}, backends {','.join(env.backends)}")


def check_engine_env(node: Node, opts: Options) -> CheckResult | list[CheckResult]:
    """engine.env passes the engine's own validation, and the engine may start on this platform; on a node of
    several engines, each engine's variables (engine.env with its slot file over it), one result per engine."""
    name = "engine-env"
    text = node.read_text(ENGINE_ENV_FILE)
    if text is None:
        why = "image build" if opts.image else "not written yet (the instance's user data writes it)"
        return CheckResult(name, Status.SKIP, f"{ENGINE_ENV_FILE}: {why}")
    engines = slot_engines(node)
    if engines:
        return [_engine_env_result(e.name(name), e.variables, e.env, opts, f"{e.label}: ") if e.env else
                CheckResult(e.name(name), Status.FAIL, f"{e.label}: {e.error}",
                            f"fix {e.path} or {ENGINE_ENV_FILE} (the instance's user data writes both)")
                for e in engines]
    try:
        variables = node_env.parse(text)
        env = node_env.EngineEnv.from_variables(variables)
    except node_env.NodeEnvError as exc:
        return CheckResult(name, Status.FAIL, str(exc), f"fix {ENGINE_ENV_FILE} (template: engine.env.template)")
    return _engine_env_result(name, variables, env, opts)


def node_devices(node: Node, opts: Options) -> tuple[int | None, str]:
    """How many devices the node has (GPUs, or NeuronCores on Neuron), and what they are called; None when the
    driver does not say (driver-cuda / neuron-devices report why)."""
    if opts.flavor == "neuron":
        out = node.run(["neuron-ls", "--json-output"], None, 60)
        try:
            devices = json.loads(out.stdout) if out.returncode == 0 else None
            cores = sum(int(d["nc_count"]) for d in devices) if devices else None
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            cores = None
        return cores, "NeuronCores"
    out = node.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], None, 60)
    lines = [line for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []
    return (len(lines) or None), "GPUs"


def _ports(env: node_env.EngineEnv) -> dict[int, str]:
    """The ports an engine listens on: HTTP, and a side-channel port per TP rank (vLLM listens on port + rank)."""
    out = {env.port: "HTTP port"}
    out.update({env.side_channel_port + rank: "side-channel port" for rank in range(env.tp_size)})
    return out


def check_engine_slots(node: Node, opts: Options) -> list[CheckResult]:
    """A node of several engines: each engine's devices are its TP size's worth, on the node and no other
    engine's; its HTTP and side-channel ports (one per TP rank) and its engine id are its own. Nothing on a node
    of one engine (its unit sees every device, its ports are engine.env's)."""
    name = "engine-slot"
    engines = slot_engines(node)
    if not engines:
        return []
    total, kind = node_devices(node, opts)
    devices: dict[int, tuple[int, ...]] = {}
    problems: dict[int, list[str]] = {e.slot: [] for e in engines}
    for e in engines:
        if not e.readable:
            continue
        try:
            seen = node_env.visible_devices(e.variables)
        except node_env.NodeEnvError as exc:
            problems[e.slot].append(str(exc))
            continue
        if seen is None:
            problems[e.slot].append(f"neither {node_env.CUDA_VISIBLE_DEVICES} nor {node_env.NEURON_VISIBLE_DEVICES}"
                                    " is set: it would use every device of the node")
            continue
        devices[e.slot] = seen
        if len(set(seen)) != len(seen):
            problems[e.slot].append(f"{kind} {_list(seen)} name one twice")
        if e.env and len(seen) != e.env.tp_size:
            problems[e.slot].append(f"{len(seen)} {kind} for TP {e.env.tp_size}")
        if total is not None and any(d >= total for d in seen):
            problems[e.slot].append(f"{kind} {_list(d for d in seen if d >= total)} are not on this node "
                                    f"(it has {total}: 0-{total - 1})")
    for e in engines:
        for other in engines:
            if other.slot == e.slot:
                continue
            shared = sorted(set(devices.get(e.slot, ())) & set(devices.get(other.slot, ())))
            if shared:
                problems[e.slot].append(f"{kind} {_list(shared)} are engine {other.slot}'s too")
            if e.env and other.env:
                clash = sorted(set(_ports(e.env)) & set(_ports(other.env)))
                if clash:
                    problems[e.slot].append(f"port(s) {_list(clash)} are engine {other.slot}'s too")
                if e.env.engine_id == other.env.engine_id:
                    problems[e.slot].append(f"engine id {e.env.engine_id} is engine {other.slot}'s too")
    results = []
    for e in engines:
        if problems[e.slot]:
            results.append(CheckResult(e.name(name), Status.FAIL, f"{e.label}: " + "; ".join(problems[e.slot]),
                                       f"each engine needs its own devices and ports ({e.path}): the instance's "
                                       "user data writes them from node_env.engine_slots; rewrite or relaunch"))
        elif not e.readable:
            results.append(CheckResult(e.name(name), Status.SKIP, f"{e.label}: {e.path} does not parse "
                                       f"(see engine-env@{e.slot})"))
        elif e.env is None:
            results.append(CheckResult(e.name(name), Status.SKIP, f"{e.label}: devices "
                                       f"{_list(devices.get(e.slot, ()))}; ports not checked: its variables do "
                                       f"not validate (see engine-env@{e.slot})"))
        else:
            sc = e.env.side_channel_port
            on = f" of {total}" if total is not None else f" (the node's {kind} not counted: see the driver check)"
            results.append(CheckResult(e.name(name), Status.PASS,
                                       f"{e.label}: {kind} {_list(devices[e.slot])}{on}, HTTP port {e.env.port}, "
                                       f"side-channel port(s) {sc}-{sc + e.env.tp_size - 1}"))
    return results


def _list(values) -> str:
    return ",".join(map(str, values))


NEURON_PROBE = r"""
import json, os
import importlib.metadata as md
out = {"platform_plugins": sorted(ep.name for ep in md.entry_points(group="vllm.platform_plugins"))}
try:
    from vllm.platforms import current_platform
    out["device_type"] = current_platform.device_type
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def check_neuron_platform(node: Node, opts: Options) -> CheckResult:
    """Neuron: what vllm-neuron's DI path needs that no GPU check covers (turnkv.neuron): NIXL's LIBFABRIC plugin
    finds libcuda.so.1, vllm-neuron's platform plugin is installed, and vLLM resolves the Neuron platform when
    VLLM_PLUGINS names it as the engine's environment does."""
    name = "neuron-platform"
    if opts.flavor != "neuron":
        return CheckResult(name, Status.SKIP, "GPU image: no Neuron platform")
    cache = node.run(["ldconfig", "-p"], None, 30)
    if not any(neuron.CUDA_STUB + " " in line for line in cache.stdout.splitlines()):
        return CheckResult(name, Status.FAIL, f"no {neuron.CUDA_STUB} on the loader path: NIXL's LIBFABRIC plugin "
                           "fails to load ('unsupported backend LIBFABRIC') and every engine worker exits",
                           "install the CUDA driver stub (the AMI's turnkv-vllm-neuron step does; vllm-neuron setup "
                           "guide, 'Install dependencies for disaggregated inference') and run ldconfig")
    allowed = f"turnkv,turnkv-leases,{neuron.PLATFORM_PLUGIN}"
    probe = node.run([node.python, "-c", NEURON_PROBE], {"VLLM_PLUGINS": allowed}, 300)
    result = _last_json(probe.stdout)
    if probe.returncode != 0 or result is None:
        return CheckResult(name, Status.FAIL, f"the platform probe failed: {_tail(probe.stderr or probe.stdout)}",
                           "re-run the AMI's turnkv-vllm-neuron component")
    if neuron.PLATFORM_PLUGIN not in result["platform_plugins"]:
        return CheckResult(name, Status.FAIL, f"no vLLM platform plugin named {neuron.PLATFORM_PLUGIN!r} is installed "
                           f"(found: {_list(result['platform_plugins']) or 'none'})",
                           f"install vllm-neuron {versions.VLLM_NEURON} (the AMI's turnkv-vllm-neuron component)")
    if result.get("device_type") != neuron.DEVICE_TYPE:
        seen = result.get("error") or f"device type {result.get('device_type')!r}"
        return CheckResult(name, Status.FAIL, f"with VLLM_PLUGINS={allowed} vLLM does not run on Neuron ({seen})",
                           "run on a Trn2 instance with the Neuron driver loaded (neuron-ls lists its devices)")
    return CheckResult(name, Status.PASS, f"{neuron.CUDA_STUB} found; vLLM resolves the Neuron platform through the "
                       f"{neuron.PLATFORM_PLUGIN!r} plugin (device type {neuron.DEVICE_TYPE})")


Check = Callable[[Node, Options], CheckResult | Sequence[CheckResult]]
CHECKS: tuple[Check, ...] = (
    check_libfabric, check_efa_device, check_nixl, check_gdr, check_driver, check_gpu_memory, check_host_tier,
    check_neuron_platform, check_versions, check_connector_code, check_engine_env, check_engine_slots,
)


def run_checks(node: Node, opts: Options, checks: Sequence[Check] = CHECKS) -> list[CheckResult]:
    """Every check's results in order (a per-engine check gives one per engine of the node, or none)."""
    results: list[CheckResult] = []
    for check in checks:
        try:
            out = check(node, opts)
            results.extend([out] if isinstance(out, CheckResult) else out)
        except Exception as exc:  # a check that crashes is a failed check, not a crashed doctor
            results.append(CheckResult(check.__name__.removeprefix("check_"), Status.FAIL,
                                       f"the check crashed: {type(exc).__name__}: {exc}", "report this as a bug"))
    return results


def failed(results: Sequence[CheckResult]) -> bool:
    return any(r.status is Status.FAIL for r in results)
