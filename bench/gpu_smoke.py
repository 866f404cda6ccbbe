"""`make gpu-smoke`: what a p5en runs, scaled to one GPU, in one command that gives the verdict (under 8 minutes on
one H100).

A 1P1D pair on one GPU from the CUDA wheel (the GPU image's vLLM and NIXL pins), run as a p5en runs it: bf16
weights (the tiny model made here: the GPU box reaches no hub), the attention backend vLLM picks for the GPU
(FlashAttention on Hopper; nothing forced), CUDA graphs on (no ``--enforce-eager``), decode's host tier on, forks
held (``fork_window``), the connector bi-directional in pull then in push. Each mode plays :data:`STAGES` on one
engine pair: a conversation (as ``turnkv smoke`` plays a deploy: each turn with reuse off then on, answers
compared), forks of one history at once, a conversation whose retained turns all live in the host tier
(``retained_kv_share`` 0, hot-reloaded), and one conversation per READ fault (``connector.seals``: a wrong block, two
layers swapped, a failed transfer, decode invalidated) with every answer compared to reuse off. Pull mode's prefill
runs vLLM's CPU offloading tier beside turnkv's connector, as ``connector.prefill_offload_gib`` deploys it; with two
GPUs both engines run tensor parallelism 2. The report is a table of TTFT (reuse off and on) and KV transfer time
(vLLM's NIXL histograms) per stage, the backend, CUDA-graph and model-runner (V1 or V2) lines the engines logged,
and what it did not run: a stage the 8-minute budget left out, and :data:`OUT_OF_REACH` (what one GPU cannot stand
in for).

On a machine without a CUDA device it starts nothing: it names what is missing and lists the plan as not run
(exit 2). Nothing here fakes a GPU. The plan is in docs/gpu.md.

    python -m bench.gpu_smoke                # pull and push, report in results/gpu-smoke
    python -m bench.gpu_smoke --mode pull
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import secrets
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from connector import seals
from turnkv import metric_names as mn
from turnkv import versions
from turnkv.engine_args import Mode
from turnkv.local.engine_env import installed_version
from turnkv.local.model import ModelSpec

#: The whole run fits this on one H100 (the issue's bar); a mode that would not fit is reported as not run.
BUDGET_S = 480.0
#: One mode's worst case: two engine starts with graph capture (compiled once, then cached in the state dir) and
#: its four stages (the faults stage: four conversations, about 40 s of it).
MODE_ESTIMATE_S = 250.0
#: bf16, as the target's weights are (the CPU suites run float32).
MODEL = ModelSpec(dtype="bfloat16")
HOST_KV_BUDGET_MIB = 512
FORK_WINDOW_S = 20
FORKS = 3
#: The engines' tunables for every mode: the host tier allocated at start, forks held after a read.
TUNABLES: dict[str, int | float] = {"host_kv_budget_mib": HOST_KV_BUDGET_MIB, "fork_window": FORK_WINDOW_S}
#: Pull mode's prefill: vLLM's CPU offloading tier beside turnkv's connector (GiB of host memory).
PREFILL_OFFLOAD_GIB = 4.0
#: The READ faults the faults stage injects (connector.seals), and those whose blocks must show as mismatched.
FAULTS = ("block", "layer", "fail", "invalidate")
MISADDRESSED = ("block", "layer")
#: What the host stage hot-reloads: no device room for retained turns, so each goes to the host tier.
HOST_ONLY: dict[str, int | float] = {"retained_kv_share": 0.0, "host_kv_budget_mib": HOST_KV_BUDGET_MIB,
                                     "fork_window": FORK_WINDOW_S}

#: What every mode runs as, beside the CPU suites' settings: the plan's settings (docs/gpu.md shows them).
SETTINGS: tuple[tuple[str, str], ...] = (
    ("model", "the tiny Llama made here, in bfloat16 (the GPU box reaches no hub)"),
    ("attention", "vLLM's pick for the GPU, logged (FlashAttention on Hopper; not forced, not eager)"),
    ("CUDA graphs", "on: no --enforce-eager (the CPU suites run eager)"),
    ("host tier", f"host_kv_budget_mib {HOST_KV_BUDGET_MIB} on decode (pinned, registered with NIXL at start)"),
    ("connector", "bi-directional, pull then push; NIXL over UCX (CUDA IPC on one GPU)"),
    ("forks", f"fork_window {FORK_WINDOW_S} s; {FORKS} branches of one history sent at once"),
    ("answers", "every turn and fork sent with reuse off and on, answers compared"),
    ("offload tier", f"pull mode: vLLM's OffloadingConnector beside turnkv's on prefill ({PREFILL_OFFLOAD_GIB:g} GiB)"),
    ("tensor parallelism", "2 on both engines where two GPUs exist, else 1"),
    ("model runner", "whichever vLLM picks on CUDA (V2 where Triton is present), read from the engine logs"),
)


@dataclass(frozen=True)
class Stage:
    key: str
    proves: str


#: What each mode plays on its engine pair, in order.
STAGES = (
    Stage("conversation", "four turns: each later turn reuses the KV of the one before, held in decode's device tier"),
    Stage("forks", f"{FORKS} branches of one history at once each pull the turn decode holds for forks"),
    Stage("host", "four turns with retained_kv_share 0: each later turn is read from decode's host tier"),
    Stage("faults", f"four turns per READ fault ({', '.join(FAULTS)}): every answer equal to reuse off, and the "
                    f"misaddressed READs ({', '.join(MISADDRESSED)}) caught by the KV seal"),
)
#: What one GPU cannot stand in for: said in every report.
OUT_OF_REACH = (
    "EFA and NIXL's LIBFABRIC backend (one GPU, no fabric: UCX here)",
    "tensor parallelism 8 and a node of eight ranks (TP 2 at most here)",
    "a READ that times out in flight (NIXL would have to hold it; the unit suite's fake NIXL does)",
    "a real model's weights, kernels and KV sizes (the tiny model here)",
    "two engines on two nodes (both share one GPU here)",
)


@dataclass(frozen=True)
class Machine:
    """What the preflight found: enough to tell a GPU run from one that cannot be."""

    cuda: bool
    devices: int
    device_name: str
    vllm: str
    nixl: str
    python: str = platform.python_version()
    nvidia_smi: bool = True


def machine() -> Machine:
    """Read the machine without starting an engine (torch only; the engines import it anyway)."""
    packages = installed_version("vllm"), installed_version(versions.NIXL_CUDA_PACKAGE)
    smi = shutil.which("nvidia-smi") is not None
    try:
        import torch
    except ImportError:
        return Machine(False, 0, "", *packages, nvidia_smi=smi)
    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    return Machine(cuda, count, torch.cuda.get_device_name(0) if count else "", *packages, nvidia_smi=smi)


def problems(found: Machine) -> list[str]:
    """Why this machine cannot run the smoke, each with its fix; empty when it can. Pure."""
    out = []
    if not found.cuda or found.devices < 1:
        driver = "" if found.nvidia_smi else " and no nvidia-smi (no NVIDIA driver)"
        out.append(f"no CUDA device: torch.cuda.is_available() is False here{driver}; run `make gpu-smoke` on a "
                   "machine with an NVIDIA GPU and its driver (this check was not run)")
    if not found.vllm:
        out.append("vLLM is not installed; `make gpu-smoke` installs the GPU image's pins into .venv-gpu")
    elif found.vllm != versions.VLLM_GPU:  # the CPU build's alias is "<release>+cpu"
        out.append(f"vLLM {found.vllm} is not the GPU image's CUDA wheel ({versions.VLLM_GPU}); "
                   "run from .venv-gpu (`make gpu-smoke`)")
    if not found.nixl:
        out.append(f"{versions.NIXL_CUDA_PACKAGE} is not installed: NIXL cannot register GPU memory; "
                   "`make gpu-smoke` installs it")
    return out


def plan_lines(modes: list[Mode]) -> list[str]:
    """The plan, one line per setting and per stage of each mode (the refusal lists it as not run)."""
    return ([f"{name}: {what}" for name, what in SETTINGS]
            + [f"{mode.value} / {s.key}: {s.proves}" for mode in modes for s in STAGES])


def fits(elapsed_s: float, budget_s: float = BUDGET_S, estimate_s: float = MODE_ESTIMATE_S) -> bool:
    """Whether one more mode fits the budget (the first always runs: a verdict on something beats none)."""
    return elapsed_s == 0 or elapsed_s + estimate_s <= budget_s


def stack_overrides(args: argparse.Namespace, mode: Mode | None = None, devices: int = 1) -> dict[str, object]:
    """The local stack's settings for a mode (``turnkv.local.stack.StackConfig`` fields over bench.shapes'): TP 2
    on both engines where two GPUs are visible, the offloading tier beside pull mode's prefill."""
    tp = 2 if devices >= 2 and "," in args.cuda_devices else 1
    out: dict[str, object] = dict(
        accelerator="cuda", cuda_devices=args.cuda_devices, gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=False, model_spec=MODEL, tunables=dict(TUNABLES), startup_timeout=args.startup_timeout,
        prefill_tp=tp, decode_tp=tp)
    if mode is Mode.PULL:
        out["prefill_offload_gib"] = PREFILL_OFFLOAD_GIB
    return out


# ---------------------------------------------------------------- reading the engines

#: vLLM 0.32's log lines (vllm/platforms/cuda.py, vllm/v1/worker/gpu_model_runner.py).
_BACKEND = re.compile(r"Using (\S+) attention backend out of potential backends")
_BACKEND_ALONE = re.compile(r"Using (\S+) backend\.")
_GRAPHS = re.compile(r"Graph capturing finished in (\d+) secs, took ([\d.]+) GiB")
#: vLLM 0.32 logs this once when it builds Model Runner V2 (vllm/v1/worker/gpu_worker.py); V1 logs nothing.
_RUNNER_V2 = "Using V2 Model Runner"


def engine_log_facts(text: str) -> dict[str, str]:
    """The attention backend vLLM picked, its CUDA-graph capture and the model runner, from an engine's log (""
    when not logged)."""
    backend = _BACKEND.search(text) or _BACKEND_ALONE.search(text)
    graphs = _GRAPHS.search(text)
    return {"attention_backend": backend.group(1) if backend else "",
            "cuda_graphs": f"captured in {graphs.group(1)} s, {graphs.group(2)} GiB" if graphs else "",
            "model_runner": "V2" if _RUNNER_V2 in text else "V1"}


@dataclass
class Transfers:
    """vLLM's NIXL transfer histograms, summed over both engines: count, seconds and bytes."""

    count: float = 0.0
    seconds: float = 0.0
    bytes: float = 0.0

    def __sub__(self, other: Transfers) -> Transfers:
        return Transfers(self.count - other.count, self.seconds - other.seconds, self.bytes - other.bytes)

    @property
    def mean_ms(self) -> float:
        return self.seconds / self.count * 1000 if self.count else 0.0


def transfers(urls: dict[str, str]) -> Transfers:
    from bench import engine_metrics

    pages = [engine_metrics.fetch_sync(urls[name]) for name in ("prefill-0", "decode-0")]
    return Transfers(sum(engine_metrics.total(p, f"{mn.VLLM_NIXL_XFER_TIME}_count") for p in pages),
                     sum(engine_metrics.total(p, f"{mn.VLLM_NIXL_XFER_TIME}_sum") for p in pages),
                     sum(engine_metrics.total(p, f"{mn.VLLM_NIXL_BYTES}_sum") for p in pages))


@dataclass
class StageRun:
    """One stage of one mode: its TTFTs (reuse off and on, the turns that could reuse), answers and transfers."""

    mode: str
    stage: str
    ran: bool = False
    passed: bool = False
    detail: str = ""
    ttft_off_ms: float = 0.0
    ttft_on_ms: float = 0.0
    reused: int = 0
    of: int = 0
    same_answers: int = 0
    transfers: Transfers = field(default_factory=Transfers)


def _mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 1) if values else 0.0


def conversation_stage(mode: str, stage: str, turns: list[dict], ok: bool, failure: str, moved: Transfers
                       ) -> StageRun:
    """A played conversation as a stage row (turn 1 cannot reuse: its TTFTs are left out of the means)."""
    later = turns[1:]
    return StageRun(mode, stage, ran=True, passed=ok, detail=failure,
                    ttft_off_ms=_mean([t["ttft_off_ms"] for t in later]),
                    ttft_on_ms=_mean([t["ttft_on_ms"] for t in later]),
                    reused=sum(1 for t in later if t["outcome"] == "hit"), of=len(later),
                    same_answers=sum(1 for t in turns if t["same_answer"]), transfers=moved)


async def _forks(router: str, timeout_s: float) -> list[tuple[object, object]]:
    """One history, answered once; then FORKS branches of it sent at once (reuse on), then each with reuse off."""
    import aiohttp

    from turnkv import smoke

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        model = await smoke._model(session, router, None)
        history = [{"role": "system", "content": f"{smoke.SYSTEM} Fork check {secrets.token_hex(4)}."},
                   {"role": "user", "content": smoke.PROMPTS[0]}]
        first = await smoke._chat(session, router, None, model, history, True, 32, "fork root")
        said = [*history, {"role": "assistant", "content": first.text}]
        branches = [[*said, {"role": "user", "content": prompt}] for prompt in smoke.PROMPTS[1:1 + FORKS]]
        on = await asyncio.gather(*(smoke._chat(session, router, None, model, b, True, 32, f"fork {i}")
                                    for i, b in enumerate(branches)))
        off = [await smoke._chat(session, router, None, model, b, False, 32, f"fork {i} (reuse off)")
               for i, b in enumerate(branches)]
    return list(zip(off, on, strict=True))


def forks_stage(mode: str, pairs: list[tuple[object, object]], moved: Transfers) -> StageRun:
    hits = sum(1 for _, on in pairs if on.outcome == "hit" and on.reused_tokens > 0)
    same = sum(1 for off, on in pairs if off.text == on.text)
    passed = hits == same == len(pairs) == FORKS
    return StageRun(mode, "forks", ran=True, passed=passed,
                    detail="" if passed else f"{hits}/{len(pairs)} forks pulled, {same} answers equal to reuse off",
                    ttft_off_ms=_mean([off.ttft_ms for off, _ in pairs]),
                    ttft_on_ms=_mean([on.ttft_ms for _, on in pairs]), reused=hits, of=len(pairs),
                    same_answers=same, transfers=moved)


#: The file the engines read their READ fault from (``connector.seals.FAULT_FILE_ENV``), in a mode's state dir.
READ_FAULT_FILE = "read-fault"


def faults_stage(mode: str, urls: dict[str, str], switch: Path, timeout_s: float) -> StageRun:
    """One conversation per READ fault, switched on in the running prefill: every answer must equal reuse off, and
    each misaddressed READ must be caught (``vllm:turnkv_fingerprint_mismatches_total`` rises)."""
    from bench import engine_metrics
    from turnkv import smoke

    def mismatched() -> float:
        return engine_metrics.total(engine_metrics.fetch_sync(urls["prefill-0"]),
                                    f"{mn.VLLM_FINGERPRINT_MISMATCHES}_total")

    same = turns = 0
    problems = []
    for fault in FAULTS:
        before = mismatched()
        switch.write_text(fault)
        try:
            rows = smoke.summary_rows(asyncio.run(smoke.run(urls["router"], timeout_s=timeout_s)))
        finally:
            switch.write_text("")
        turns += len(rows)
        same += sum(1 for r in rows if r["same_answer"])
        if not all(r["same_answer"] for r in rows):
            problems.append(f"{fault}: an answer differs from reuse off")
        if fault in MISADDRESSED and not mismatched() > before:
            problems.append(f"{fault}: no block caught by the KV seal")
    return StageRun(mode, "faults", ran=True, passed=not problems, detail="; ".join(problems), of=turns,
                    same_answers=same)


def play_stages(mode: Mode, state_dir: Path, timeout_s: float):
    """``bench.shapes.run_shape``'s ``play``: after the conversation, the forks and the host stage on the same
    engines, each stage's transfers measured by difference."""

    def play(urls: dict[str, str]) -> dict:
        try:
            return stages(urls)
        except Exception as exc:  # a report with the reason beats a traceback that loses the stages run so far
            return {"error": f"{type(exc).__name__}: {exc}"}

    def stages(urls: dict[str, str]) -> dict:
        from turnkv import smoke
        from turnkv.local.stack import tail

        out: dict = {"conversation_transfers": asdict(transfers(urls))}
        logs = {name: engine_log_facts((state_dir / "logs" / f"{name}.log").read_text(errors="replace"))
                for name in ("prefill-0", "decode-0") if (state_dir / "logs" / f"{name}.log").exists()}
        out["engines"] = logs
        before = transfers(urls)
        try:
            pairs = asyncio.run(_forks(urls["router"], timeout_s))
            out["forks"] = asdict(forks_stage(mode.value, pairs, transfers(urls) - before))
        except (smoke.SmokeFailure, OSError, TimeoutError) as exc:
            out["forks"] = asdict(StageRun(mode.value, "forks", ran=True, detail=f"{exc}"))
        (state_dir / "tunables.json").write_text(json.dumps(HOST_ONLY))
        time.sleep(2.0)  # the connector re-reads the file at most once a second
        before = transfers(urls)
        result = asyncio.run(smoke.run(urls["router"], timeout_s=timeout_s))
        host = conversation_stage(mode.value, "host", smoke.summary_rows(result), result.ok, result.failure or "",
                                  transfers(urls) - before)
        from bench import engine_metrics

        read_host = engine_metrics.total(engine_metrics.fetch_sync(urls["prefill-0"]), f"{mn.VLLM_PULLS}_total",
                                         tier="host")
        if host.passed and not read_host > 0:
            host.passed, host.detail = False, "no pull from the host tier (vllm:turnkv_pulls_total{tier=host} is 0)"
        out["host"] = asdict(host)
        out["host_pulls"] = read_host
        out["decode_log_tail"] = tail(state_dir / "logs" / "decode-0.log", 3) if not host.passed else ""
        (state_dir / "tunables.json").write_text(json.dumps(TUNABLES))  # back to the device tier
        time.sleep(2.0)
        out["faults"] = asdict(faults_stage(mode.value, urls, state_dir / READ_FAULT_FILE, timeout_s))
        return out

    return play


# ---------------------------------------------------------------- the report


def table(found: Machine, stages: list[StageRun], engines: dict[str, dict[str, str]], not_run: list[str]) -> str:
    lines = [f"GPU smoke on {found.devices} x {found.device_name or 'no GPU'}, vLLM {found.vllm or '-'}, "
             f"{versions.NIXL_CUDA_PACKAGE} {found.nixl or '-'}, model {MODEL.dtype}", ""]
    for mode, facts in engines.items():
        for name, fact in facts.items():
            lines.append(f"- {mode} {name}: attention {fact.get('attention_backend') or 'NOT LOGGED'}, CUDA graphs "
                         f"{fact.get('cuda_graphs') or 'NOT CAPTURED'}, model runner {fact.get('model_runner', '?')}")
    lines += ["", "| mode | stage | TTFT off ms | TTFT on ms | off/on | reused | same answers | KV transfers | "
                  "transfer ms (mean) | MiB moved | result |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in stages:
        if not s.ran:
            lines.append(f"| {s.mode} | {s.stage} | - | - | - | - | - | - | - | - | not run: {s.detail} |")
            continue
        ratio = f"{s.ttft_off_ms / s.ttft_on_ms:.2f}x" if s.ttft_on_ms else "-"
        result = "passed" if s.passed else "FAILED: " + s.detail.replace("|", "/").replace("\n", " ")[:200]
        t = s.transfers
        lines.append(f"| {s.mode} | {s.stage} | {s.ttft_off_ms} | {s.ttft_on_ms} | {ratio} | {s.reused}/{s.of} | "
                     f"{s.same_answers} | {t.count:.0f} | {t.mean_ms:.2f} | {t.bytes / 2**20:.1f} | {result} |")
    lines += ["", "Not run here:", *(f"- {item}" for item in [*not_run, *OUT_OF_REACH])]
    return "\n".join(lines)


def stage_rows(mode: Mode, row) -> list[StageRun]:
    """A mode's stages from bench.shapes' row (its conversation) and what ``play`` found."""
    if not row.started:
        return [StageRun(mode.value, s.key, detail=f"engines did not start: {row.failure[:200]}") for s in STAGES]
    extra = row.extra or {}
    moved = Transfers(**extra["conversation_transfers"]) if "conversation_transfers" in extra else Transfers()
    out = [conversation_stage(mode.value, "conversation", row.turns, row.passed, row.failure, moved)]
    for key in ("forks", "host", "faults"):
        if key in extra:
            data = dict(extra[key])
            data["transfers"] = Transfers(**data["transfers"])
            out.append(StageRun(**data))
        else:
            out.append(StageRun(mode.value, key, detail=(extra.get("error") or row.failure)[:200]
                                or "the mode stopped before it"))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", action="append", choices=[m.value for m in Mode], help="default: pull and push")
    parser.add_argument("--out", type=Path, default=Path("results/gpu-smoke"))
    parser.add_argument("--state-dir", type=Path, default=Path(".turnkv/gpu-smoke"))
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds for one stage's requests")
    parser.add_argument("--startup-timeout", type=float, default=240.0, help="seconds for the engines to start")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds the whole run may take")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.25,
                        help="each engine's share of the GPU (two engines share it)")
    parser.add_argument("--cuda-devices", default="0", help="CUDA_VISIBLE_DEVICES for both engines")
    args = parser.parse_args(argv)
    modes = [Mode(m) for m in (args.mode or [m.value for m in Mode])]
    found = machine()
    args.out.mkdir(parents=True, exist_ok=True)
    if missing := problems(found):
        plan = plan_lines(modes)
        (args.out / "gpu-smoke.json").write_text(json.dumps(
            {"machine": asdict(found), "missing": missing, "not_run": plan, "out_of_reach": list(OUT_OF_REACH)},
            indent=2))
        print("GPU smoke not run: this machine lacks\n" + "\n".join(f"- {m}" for m in missing)
              + "\nThe plan it would have run (docs/gpu.md), none of it run:\n" + "\n".join(f"- {p}" for p in plan),
              file=sys.stderr)
        return 2
    from bench import shapes

    started = time.monotonic()
    stages: list[StageRun] = []
    engines: dict[str, dict[str, str]] = {}
    not_run: list[str] = []
    for mode in modes:
        elapsed = time.monotonic() - started
        if not fits(elapsed, args.budget):
            not_run.append(f"{mode.value}: its {MODE_ESTIMATE_S:.0f} s would pass the {args.budget:.0f} s budget "
                           f"({elapsed:.0f} s spent); run it alone with --mode {mode.value}")
            stages += [StageRun(mode.value, s.key, detail="the time budget") for s in STAGES]
            continue
        print(f"{mode.value}: prefill and decode on GPU {args.cuda_devices}, bf16, CUDA graphs, host tier ...",
              flush=True)
        state = args.state_dir / mode.value
        state.mkdir(parents=True, exist_ok=True)
        (state / READ_FAULT_FILE).write_text("")
        os.environ[seals.FAULT_FILE_ENV] = str((state / READ_FAULT_FILE).resolve())  # the engines inherit it
        row = shapes.run_shape(shapes.SHAPES[0], mode, state, args.timeout,
                               play=play_stages(mode, state, args.timeout),
                               **stack_overrides(args, mode, found.devices))
        stages += stage_rows(mode, row)
        engines[mode.value] = row.extra.get("engines", {})
        (args.out / "gpu-smoke.json").write_text(json.dumps(
            {"machine": asdict(found), "stages": [asdict(s) for s in stages], "engines": engines,
             "not_run": not_run, "out_of_reach": list(OUT_OF_REACH)}, indent=2))
    text = table(found, stages, engines, not_run)
    (args.out / "gpu-smoke.md").write_text(text + "\n")
    print(text)
    graphs = all(f.get("cuda_graphs") and f.get("attention_backend") for e in engines.values() for f in e.values())
    return 0 if stages and all(s.passed for s in stages) and graphs else 1


if __name__ == "__main__":
    raise SystemExit(main())
