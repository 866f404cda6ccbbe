"""Summarize a ``pip install --dry-run --report`` of the GPU image's requirements (``make gpu-check``).

Prints what the resolver chose for the packages that decide whether the image works (vLLM, torch and its CUDA
libraries, NIXL and its CUDA variant) and checks them against ``turnkv.versions``; exits 1 on a mismatch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from turnkv import versions

KEY_PREFIXES = ("vllm", "torch", "nixl", "flashinfer", "nvidia-", "triton", "xformers", "turnkv")


def resolved(report: dict) -> dict[str, str]:
    return {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in report.get("install", [])}


def expectations() -> dict[str, str]:
    return {"vllm": versions.VLLM_GPU, "nixl": versions.NIXL, versions.NIXL_CUDA_PACKAGE: versions.NIXL,
            "turnkv": versions.TURNKV}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    packages = resolved(json.loads(Path(args[0]).read_text()))
    print(f"GPU image requirement set: {len(packages)} packages resolve together (pip {args[0]})")
    for name in sorted(n for n in packages if n.startswith(KEY_PREFIXES)):
        print(f"  {name}=={packages[name]}")
    wrong = [f"{name} {packages.get(name, 'missing')} (pinned {pin})" for name, pin in expectations().items()
             if packages.get(name) != pin]
    if "+cpu" in packages.get("torch", ""):
        wrong.append(f"torch {packages['torch']} is a CPU build (resolved from a local wheel folder, not PyPI)")
    if wrong:
        print("not the pins: " + "; ".join(wrong), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
