"""One command for any CUDA machine: a 1P1D pair on one GPU with the tiny model and the CUDA wheel, pull and push
(both bi-directional), each played as ``turnkv smoke`` plays a deploy (four turns, each with reuse off and on,
answers compared), TTFT off and on per turn, and the tokens prefill pulled from decode's engine metrics.

``make gpu-smoke`` builds the CUDA venv (``.venv-gpu``: the GPU image's vLLM and NIXL pins) and runs this. On a
machine without a CUDA device it stops before starting anything and says so (exit 2): nothing here fakes a GPU.

    python -m bench.gpu_smoke                # pull and push, report in results/gpu-smoke
    python -m bench.gpu_smoke --mode pull
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import shapes
from turnkv import versions
from turnkv.engine_args import Mode
from turnkv.local.engine_env import installed_version

#: The suites' shape (TP 1, block size 128): the smoke checks the CUDA path, not a shape.
SHAPE = shapes.SHAPES[0]


@dataclass(frozen=True)
class Machine:
    """What the preflight found: enough to tell a GPU run from one that cannot be."""

    cuda: bool
    devices: int
    device_name: str
    vllm: str
    nixl: str
    python: str = platform.python_version()


def machine() -> Machine:
    """Read the machine without starting an engine (torch only; the engines import it anyway)."""
    packages = installed_version("vllm"), installed_version(versions.NIXL_CUDA_PACKAGE)
    try:
        import torch
    except ImportError:
        return Machine(False, 0, "", *packages)
    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    return Machine(cuda, count, torch.cuda.get_device_name(0) if count else "", *packages)


def problems(found: Machine) -> list[str]:
    """Why this machine cannot run the smoke, each with its fix; empty when it can. Pure."""
    out = []
    if not found.cuda or found.devices < 1:
        out.append("no CUDA device: torch.cuda.is_available() is False here; run `make gpu-smoke` on a machine "
                   "with an NVIDIA GPU and its driver (this check was not run)")
    if not found.vllm:
        out.append("vLLM is not installed; `make gpu-smoke` installs the GPU image's pins into .venv-gpu")
    elif found.vllm != versions.VLLM_GPU:  # the CPU build's alias is "<release>+cpu"
        out.append(f"vLLM {found.vllm} is not the GPU image's CUDA wheel ({versions.VLLM_GPU}); "
                   "run from .venv-gpu (`make gpu-smoke`)")
    if not found.nixl:
        out.append(f"{versions.NIXL_CUDA_PACKAGE} is not installed: NIXL cannot register GPU memory; "
                   "`make gpu-smoke` installs it")
    return out


def markdown(found: Machine, rows: list[shapes.ShapeRun]) -> str:
    lines = [f"GPU smoke on {found.devices} x {found.device_name or 'no GPU'}, vLLM {found.vllm or '-'}, "
             f"{versions.NIXL_CUDA_PACKAGE} {found.nixl or '-'}", "",
             "| mode | turn | TTFT off ms | TTFT on ms | off/on | outcome | reused tokens | same answer |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if not row.turns:
            lines.append(f"| {row.mode} | - | - | - | - | - | - | {row.failure[:300] or 'no turns'} |")
        for t in row.turns:
            ratio = f"{t['ttft_off_ms'] / t['ttft_on_ms']:.2f}x" if t["ttft_on_ms"] else "-"
            lines.append(f"| {row.mode} | {t['turn']} | {t['ttft_off_ms']} | {t['ttft_on_ms']} | {ratio} | "
                         f"{t['outcome']} | {t['reused_tokens']} | {'yes' if t['same_answer'] else 'NO'} |")
    lines += ["", *(f"- {r.mode}: {'passed' if r.passed else 'FAILED: ' + r.failure}, prefill pulled "
                    f"{r.pulled_tokens:,.0f} tokens, {r.seconds} s" for r in rows)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", action="append", choices=[m.value for m in Mode], help="default: pull and push")
    parser.add_argument("--out", type=Path, default=Path("results/gpu-smoke"))
    parser.add_argument("--state-dir", type=Path, default=Path(".turnkv/gpu-smoke"))
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for one mode's turns")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.25,
                        help="each engine's share of the GPU (two engines share it)")
    parser.add_argument("--cuda-devices", default="0", help="CUDA_VISIBLE_DEVICES for both engines")
    args = parser.parse_args(argv)
    found = machine()
    args.out.mkdir(parents=True, exist_ok=True)
    if missing := problems(found):
        (args.out / "gpu-smoke.json").write_text(json.dumps({"machine": asdict(found), "not_run": missing}, indent=2))
        print("GPU smoke not run:\n" + "\n".join(f"- {m}" for m in missing), file=sys.stderr)
        return 2
    rows = []
    for mode in [Mode(m) for m in (args.mode or [m.value for m in Mode])]:
        print(f"{mode.value}: starting prefill and decode on GPU {args.cuda_devices} ...", flush=True)
        rows.append(shapes.run_shape(SHAPE, mode, args.state_dir, args.timeout, accelerator="cuda",
                                     cuda_devices=args.cuda_devices,
                                     gpu_memory_utilization=args.gpu_memory_utilization))
        (args.out / "gpu-smoke.json").write_text(
            json.dumps({"machine": asdict(found), "rows": [asdict(r) for r in rows]}, indent=2))
    text = markdown(found, rows)
    (args.out / "gpu-smoke.md").write_text(text + "\n")
    print(text)
    return 0 if all(r.passed for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
