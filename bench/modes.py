"""TTFT per turn by connector mode, in one run: push + bi-directional, pull + bi-directional, reuse off.

The local stack is started once per mode (``turnkv local up --mode pull|push``); in each, every
conversation is played with reuse off and on, interleaved turn by turn (``bench.runner``), so each mode
has its own recompute baseline measured under the same machine load. Reuse off in pull mode is the
plain P/D baseline (prefill recomputes, decode READs). Results: one ``bench.report`` folder per mode
plus a combined ``summary.json``/``summary.md`` and ``ttft.png``.

    python -m bench.modes --out results/modes
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import report, runner
from bench.variants import stack_with_env
from bench.workload import WorkloadSpec
from turnkv.engine_args import Mode

#: Column label -> (mode, arm of bench.runner).
COLUMNS = {
    "reuse off (pull P/D)": (Mode.PULL, "off"),
    "pull + bi-directional": (Mode.PULL, "on"),
    "reuse off (push P/D)": (Mode.PUSH, "off"),
    "push + bi-directional": (Mode.PUSH, "on"),
}


def columns(modes: Any) -> dict[str, tuple[Mode, str]]:
    return {label: (mode, arm) for label, (mode, arm) in COLUMNS.items() if mode in modes}


def combine(summaries: dict[Mode, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per turn: prompt tokens, TTFT per column, reused tokens and speedups per mode (pure)."""
    rows = []
    turns = max(len(s["turns"]) for s in summaries.values())
    for i in range(turns):
        row: dict[str, Any] = {"turn": i + 1}
        turn = {mode: s["turns"][i] if i < len(s["turns"]) else {} for mode, s in summaries.items()}
        for label, (mode, arm) in columns(summaries).items():
            row["prompt_tokens"] = row.get("prompt_tokens") or turn[mode].get("prompt_tokens")
            row[label] = turn[mode].get(f"ttft_ms_{arm}")
        baseline = row["reuse off (pull P/D)"]
        for mode in summaries:
            on = row[f"{mode.value} + bi-directional"]
            row[f"reused_tokens_{mode.value}"] = turn[mode].get("reused_tokens_on")
            row[f"speedup_{mode.value}"] = round(baseline / on, 2) if baseline and on else None
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]], summaries: dict[Mode, dict[str, Any]]) -> str:
    shown = columns(summaries)
    speedups = [f"speedup_{m.value}" for m in summaries]
    head = ["turn", "prompt tokens", *(f"{c} TTFT (ms)" for c in shown), *(f"{m.value} speedup" for m in summaries)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [str(row["turn"]), str(row.get("prompt_tokens") or "-")]
        cells += [f"{row[c]:.0f}" if row.get(c) is not None else "-" for c in shown]
        cells += [f"{row[k]:.2f}x" if row.get(k) else "-" for k in speedups]
        lines.append("| " + " | ".join(cells) + " |")
    notes = ["", "speedups are against reuse off in pull P/D (the plain disaggregated baseline)"]
    for mode, s in summaries.items():
        notes.append(f"{mode.value}: requests {s['requests']}, errors {s['errors']}, identical answers with reuse "
                     f"on and off {s.get('answers_identical', 0)}/{s.get('answers_compared', 0)}")
    return "\n".join(lines) + "\n" + "\n".join(notes) + "\n"


def chart(rows: list[dict[str, Any]], path: Path) -> Path:
    styles = (("#c0392b", "o", "-"), ("#27ae60", "s", "-"), ("#e67e22", "o", "--"), ("#8e44ad", "D", "--"))
    lines = [(label, report.points(rows, label), {"color": c, "marker": m, "linestyle": ls})
             for label, (c, m, ls) in zip(COLUMNS, styles, strict=True)]
    return report.plot_ttft(lines, "Multi-turn TTFT by connector mode", path)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=3)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-words", type=int, default=500)
    p.add_argument("--first-user-words", type=int, default=700)
    p.add_argument("--turn-words", type=int, default=380)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--modes", default="pull,push", help="comma list of connector modes to run")
    p.add_argument("--port-base", type=int, default=8400)
    p.add_argument("--state-dir", type=Path, default=Path(".turnkv/bench-modes"))
    p.add_argument("--out", type=Path, default=Path("results/modes"))
    return p


def parse_modes(text: str) -> list[Mode]:
    """``pull,push`` -> modes; pull must be there (its reuse-off arm is the baseline)."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in {mode.value for mode in Mode}]
    if unknown:
        raise ValueError(f"unknown mode {unknown[0]!r} in --modes: expected pull and/or push")
    if Mode.PULL.value not in names:
        raise ValueError("--modes must include pull: its reuse-off arm is the baseline every speedup is against")
    return [Mode(m) for m in dict.fromkeys(names)]


def run(args: argparse.Namespace, on_result: Callable[[Any], None] = lambda r: None,
        say: Callable[[str], None] = lambda line: print(line, flush=True)) -> dict[str, Any]:
    try:
        modes = parse_modes(args.modes)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    workload = WorkloadSpec(conversations=args.conversations, turns=args.turns, system_words=args.system_words,
                            first_user_words=args.first_user_words, turn_words=args.turn_words,
                            max_tokens=args.max_tokens)
    summaries: dict[Mode, dict[str, Any]] = {}
    for mode in modes:
        say(f"{mode.value} mode: starting the local stack")
        with stack_with_env({}, args.state_dir, port_base=args.port_base, mode=mode) as state:
            spec = runner.RunSpec(url=state["components"]["router"]["url"], workload=workload, ab=True)
            results = asyncio.run(runner.run(spec, on_result))
        summaries[mode] = report.write(results, args.out / mode.value, {"mode": mode.value,
                                                                         "workload": workload.__dict__})
        say(f"{mode.value} mode: {summaries[mode]['requests']} requests, {summaries[mode]['errors']} errors")
    rows = combine(summaries)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"workload": workload.__dict__, "turns": rows,
              "modes": {m.value: {k: s.get(k) for k in ("requests", "errors", "answers_identical",
                                                          "answers_compared", "error_samples")}
                        for m, s in summaries.items()}}
    (args.out / "summary.json").write_text(json.dumps(result, indent=2))
    text = markdown(rows, summaries)
    (args.out / "summary.md").write_text(text)
    chart(rows, args.out / "ttft.png")
    say(text)
    say(f"wrote {args.out / 'summary.md'}, {args.out / 'summary.json'} and {args.out / 'ttft.png'}")
    return result


if __name__ == "__main__":
    run(parser().parse_args())
