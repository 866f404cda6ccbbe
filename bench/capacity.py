"""Capacity under load: how many conversations at once each variant serves within a TTFT target.

One stack, one run: for each concurrency level (conversations in flight at once, a closed loop: each
conversation sends its next turn when the previous one is answered), the workload is played with reuse
off, then with reuse on (each arm on its own, so a level's load is one variant). Conversation starts are
staggered a little so that they do not move in lock-step. Per level and variant: TTFT p50/p90 per turn
and overall, the share of later turns that reused KV, errors. The highest level a variant sustains is
the last one, going up, whose TTFT p90 stays within the target; by default the target is twice the
reuse-off p90 of the lowest level (an unloaded engine recomputing every turn).

    python -m bench.capacity --url http://127.0.0.1:8000 --concurrency-levels 1,2,4,8,16 --out results/capacity
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import textwrap
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from bench import report, runner
from bench.arm_names import LABELS as ARM_LABELS
from bench.client import Result
from bench.workload import WorkloadSpec
from turnkv import router_env

ARMS = ("off", "on")
LABELS = {arm: ARM_LABELS[arm] for arm in ("off", "on")}  # the A/B's names (bench.arm_names): the off arm is salted
STYLES = {"off": {"color": "#c0392b", "marker": "o"}, "on": {"color": "#27ae60", "marker": "s"}}
#: The default target is this many times the reuse-off TTFT p90 of the lowest level.
TARGET_FACTOR = 2.0


def percentile(values: Iterable[float | None], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100) of the values that are not None."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    return round(vals[max(0, math.ceil(q / 100 * len(vals)) - 1)], 1)


def level_summary(results: list[Result]) -> dict[str, Any]:
    """One variant at one level: TTFT p50/p90 overall and per turn, reuse share of later turns, errors."""
    ok = [r for r in results if r.error is None]
    later = [r for r in ok if r.turn > 0]
    by_turn: dict[int, list[Result]] = defaultdict(list)
    for r in ok:
        by_turn[r.turn].append(r)
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "ttft_p50_ms": percentile((r.ttft_ms for r in ok), 50),
        "ttft_p90_ms": percentile((r.ttft_ms for r in ok), 90),
        "reuse_share": round(sum(1 for r in later if r.reused_tokens > 0) / len(later), 3) if later else None,
        "turns": [{"turn": t + 1, "ttft_p50_ms": percentile((r.ttft_ms for r in rs), 50),
                   "ttft_p90_ms": percentile((r.ttft_ms for r in rs), 90),
                   "prompt_tokens": max((r.prompt_tokens or 0 for r in rs), default=0)}
                  for t, rs in sorted(by_turn.items())],
    }


def sustained(levels: list[dict[str, Any]], arm: str, target_ms: float) -> int:
    """Highest level (conversations at once) reached, going up, with TTFT p90 within the target and no errors."""
    best = 0
    for level in levels:
        s = level[arm]
        if s["errors"] or s["ttft_p90_ms"] is None or s["ttft_p90_ms"] > target_ms:
            break
        best = level["concurrency"]
    return best


def default_target(levels: list[dict[str, Any]]) -> float:
    base = levels[0]["off"]["ttft_p90_ms"]
    if base is None:
        raise ValueError("the lowest level has no successful reuse-off request: no target to derive")
    return round(TARGET_FACTOR * base, 1)


def conclude(levels: list[dict[str, Any]], target_ms: float | None) -> dict[str, Any]:
    target = target_ms or default_target(levels)
    off, on = sustained(levels, "off", target), sustained(levels, "on", target)
    return {"target_ms": target, "target_rule": "given" if target_ms else f"{TARGET_FACTOR:g}x the reuse-off "
            f"TTFT p90 at {levels[0]['concurrency']} conversation(s)", "sustained_off": off, "sustained_on": on,
            "capacity_gain": round(on / off, 2) if off else None}


def _ms(value: float | None) -> str:
    return f"{value:,.0f}" if value is not None else "-"


def markdown(result: dict[str, Any], per_turn: bool = True) -> str:
    # Short headers (80 columns), defined in the legend under the table.
    head = ["at once", "off p50", "off p90", "on p50", "on p90", "x p90", "reused", "errors"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for level in result["levels"]:
        off, on = level["off"], level["on"]
        share = f"{100 * on['reuse_share']:.0f}%" if on["reuse_share"] is not None else "-"
        ratio = f"{off['ttft_p90_ms'] / on['ttft_p90_ms']:.2f}x" if off["ttft_p90_ms"] and on["ttft_p90_ms"] else "-"
        lines.append(f"| {level['concurrency']} | {_ms(off['ttft_p50_ms'])} | {_ms(off['ttft_p90_ms'])} | "
                     f"{_ms(on['ttft_p50_ms'])} | {_ms(on['ttft_p90_ms'])} | {ratio} | {share} | "
                     f"{off['errors']}/{on['errors']} |")
    lines += ["", *textwrap.wrap(
        f"at once: conversations played at once; TTFT in ms, off = {LABELS['off']} (reuse off, a fresh cache_salt per "
        f"request), on = {LABELS['on']}; x p90: off's p90 / on's (higher is better); reused: share of turns 2+ that "
        "reused KV; errors: off/on", 80)]
    if not per_turn:
        return "\n".join(lines) + "\n"
    c = result["conclusion"]
    gain = f"{c['capacity_gain']:.2f}x" if c["capacity_gain"] else ("-" if not c["sustained_on"] else "off: none")
    lines += ["", f"TTFT target (p90): {c['target_ms']:,.0f} ms ({c['target_rule']})",
              f"highest load sustained: reuse off {c['sustained_off']}, reuse on {c['sustained_on']} conversations "
              f"at once; capacity with reuse: {gain}"]
    per_turn = ["", "Per turn:", "", "| conversations at once | turn | prompt tokens | TTFT p50 off (ms) | "
                "TTFT p90 off (ms) | TTFT p50 on (ms) | TTFT p90 on (ms) |", "|---|---|---|---|---|---|---|"]
    for level in result["levels"]:
        for off_t, on_t in zip(level["off"]["turns"], level["on"]["turns"], strict=False):
            per_turn.append(f"| {level['concurrency']} | {on_t['turn']} | {on_t['prompt_tokens'] or '-'} | "
                            f"{_ms(off_t['ttft_p50_ms'])} | {_ms(off_t['ttft_p90_ms'])} | "
                            f"{_ms(on_t['ttft_p50_ms'])} | {_ms(on_t['ttft_p90_ms'])} |")
    return "\n".join(lines + per_turn) + "\n"


def chart(result: dict[str, Any], path: Path) -> Path:
    lines = []
    for arm in ARMS:
        for q, style in (("p90", "-"), ("p50", "--")):
            pts = [(lv["concurrency"], lv[arm][f"ttft_{q}_ms"]) for lv in result["levels"]
                   if lv[arm][f"ttft_{q}_ms"] is not None]
            lines.append((f"{LABELS[arm]}, {q}", pts, {**STYLES[arm], "linestyle": style}))
    target = result["conclusion"]["target_ms"]
    return report.plot_ttft(lines, "TTFT under load: conversations at once", path, xlabel="conversations at once",
                            ylabel="TTFT (ms)", hline=(target, f"target {target:,.0f} ms (p90)"),
                            xticks=[lv["concurrency"] for lv in result["levels"]])


async def sweep(url: str, workload: WorkloadSpec, levels: list[int], stagger: float = 0.2,
                on_result: Callable[[Result], None] = lambda r: None, words: list[str] | None = None,
                model: str | None = None, api_key: str | None = None,
                on_level: Callable[[list[dict[str, Any]]], None] = lambda levels: None) -> list[dict[str, Any]]:
    """Play ``workload`` with ``c`` conversations at once for each level, reuse off then on; ``on_level`` gets
    the levels done so far after each one (the CLI writes its report then, so a cut-short run keeps them)."""
    out = []
    for c in levels:
        level: dict[str, Any] = {"concurrency": c}
        for arm in ARMS:
            spec = runner.RunSpec(url=url, workload=WorkloadSpec(**{**workload.__dict__, "conversations": c}),
                                  concurrency=c, reuse_off=arm == "off", stagger=stagger, tag=f"-c{c}",
                                  words=words, model=model, api_key=api_key)
            level[arm] = level_summary(await runner.run(spec, on_result))
        out.append(level)
        on_level(out)
    return out


def total_requests(levels: list[int], turns: int) -> int:
    return sum(levels) * turns * len(ARMS)


def write(levels: list[dict[str, Any]], out: Path, target_ms: float | None, meta: dict[str, Any]) -> dict[str, Any]:
    result = {"meta": meta, "levels": levels, "conclusion": conclude(levels, target_ms)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "capacity.json").write_text(json.dumps(result, indent=2))
    (out / "capacity.md").write_text(markdown(result))
    chart(result, out / "capacity.png")
    return result


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--concurrency-levels {text!r}: expected a comma list of whole numbers such as "
                         "1,2,4,8,16") from None
    if not levels or any(c < 1 for c in levels) or levels != sorted(set(levels)):
        raise ValueError(f"--concurrency-levels {text!r}: expected increasing positive numbers such as 1,2,4,8,16")
    return levels


def workload(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(turns=args.turns, system_words=args.system_words, first_user_words=args.first_user_words,
                        turn_words=args.turn_words, max_tokens=args.max_tokens, seed=args.seed)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=router_env.LOCAL_URL)
    p.add_argument("--concurrency-levels", "--levels", dest="levels", default="1,2,4,8,16")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-words", type=int, default=200)
    p.add_argument("--first-user-words", type=int, default=300)
    p.add_argument("--turn-words", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--stagger", type=float, default=0.2)
    p.add_argument("--ttft-target-ms", type=float, default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--api-key", default=os.environ.get("TURNKV_API_KEY"))
    p.add_argument("--out", type=Path, default=Path("results/capacity"))
    return p


def main(args: argparse.Namespace) -> dict[str, Any]:
    levels = parse_levels(args.levels)
    spec = workload(args)
    swept = asyncio.run(sweep(args.url, spec, levels, args.stagger, model=args.model, api_key=args.api_key))
    result = write(swept, args.out, args.ttft_target_ms, {"url": args.url, "workload": spec.__dict__,
                                                         "stagger_s": args.stagger})
    print(markdown(result))
    return result


if __name__ == "__main__":
    main(parser().parse_args())
