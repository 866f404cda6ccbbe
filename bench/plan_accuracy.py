"""Does `turnkv plan` predict what the local stack measures? One run, one stack, one quiet period:

1. calibrate on prefills (plain ones of 16-6,144 tokens to the prefill engine, ones over a prefix-cached
   context on decode) and one pull (``turnkv.plan.calibrate``);
2. predict the demo's per-turn TTFT with reuse off and on from those constants alone
   (``bench/workloads/demo.json`` describes the demo's conversations);
3. play the demo's A/B (3 conversations x 8 turns, arms interleaved turn by turn) on the same stack, one
   conversation at a time with a calibration round before each and one after the last, and fit every
   round's points together: this 2-core machine's speed drifts by 10-40% over minutes when other work
   runs, so the constants must come from the same minutes as the TTFTs they predict;
4. print the table, turn by turn, and the cells outside ``--tolerance``.

The planner never sees a multi-turn TTFT: the A/B is only compared against. Takes ~4 minutes here.

    python -m bench.plan_accuracy --out results/plan-accuracy
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from turnkv.plan import calibrate, closed_form, hardware
from turnkv.plan.architectures import tiny_local
from turnkv.plan.workload import load as load_workload

DEMO_WORKLOAD = Path(__file__).parent / "workloads" / "demo.json"


def predict(constants: dict[str, Any], workload_file: Path = DEMO_WORKLOAD) -> list[dict[str, Any]]:
    """Per-turn predictions (``Plan.per_turn``) of the local-cpu fleet the constants describe (pure)."""
    from turnkv.engine_args import EngineSpec

    inst = hardware.apply_calibration(hardware.INSTANCES["local-cpu"], constants)
    # the demo's stack runs prefill without a prefix cache (StackConfig below)
    fleet = closed_form.Fleet(tiny_local(), inst, inst, 1, 1, block_size=EngineSpec.block_size,
                              prefill_prefix_caching=False)
    return closed_form.evaluate(fleet, load_workload(workload_file)).per_turn()


def compare(predicted: list[dict[str, Any]], measured: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of predicted against measured TTFT by turn, with the relative errors (pure)."""
    rows = []
    for p, d in zip(predicted, measured, strict=False):
        row: dict[str, Any] = {"turn": d["turn"], "prompt_tokens": d["prompt_tokens"]}
        for arm in ("off", "on"):
            pred, meas = p[f"ttft_ms_{arm}"], d[f"ttft_ms_{arm}"]
            row |= {f"predicted_{arm}": pred, f"measured_{arm}": meas, f"error_{arm}": pred / meas - 1}
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]], tolerance: float) -> str:
    lines = ["| turn | prompt tokens | predicted off (ms) | measured off (ms) | error | predicted on (ms) | "
             "measured on (ms) | error |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cells = [f"{r[f'predicted_{a}']:,.0f} | {r[f'measured_{a}']:,.0f} | {r[f'error_{a}']:+.0%}"
                 for a in ("off", "on")]
        lines.append(f"| {r['turn']} | {r['prompt_tokens']:,} | {' | '.join(cells)} |")
    outside = sum(abs(r[f"error_{a}"]) > tolerance for r in rows for a in ("off", "on"))
    lines.append(f"\ncells outside ±{tolerance:.0%}: {outside} of {2 * len(rows)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("results/plan-accuracy"))
    p.add_argument("--state-dir", type=Path, default=Path(".turnkv"))
    p.add_argument("--tolerance", type=float, default=0.15)
    p.add_argument("--conversations", type=int, default=3, help="The demo's (one calibration round before each).")
    args = p.parse_args(argv)

    from bench import report, runner
    from bench.workload import WorkloadSpec, build
    from turnkv.local.model import load_words
    from turnkv.local.stack import StackConfig, Supervisor
    from turnkv.local.start import start_stack

    config = StackConfig(prefill_prefix_caching=False, state_dir=args.state_dir)
    state = start_stack(config)
    args.out.mkdir(parents=True, exist_ok=True)
    rounds: list[dict[str, list]] = []
    results = []
    try:
        comps, words = state["components"], load_words(config.model_dir)
        conversations = build(WorkloadSpec(conversations=args.conversations, turns=8), words)
        for conv in conversations:
            print(f"calibration round {len(rounds) + 1}")
            rounds.append(calibrate.measure(comps, words, repeats=2))  # the fit pools every round
            print(f"the demo's A/B, conversation {conv.index + 1} of {len(conversations)} (8 turns)")
            spec = runner.RunSpec(url=comps["router"]["url"], ab=True, words=words, conversations=[conv])
            results += asyncio.run(runner.run(spec, lambda r: None))
        print(f"calibration round {len(rounds) + 1}")
        rounds.append(calibrate.measure(comps, words, repeats=2))  # the fit pools every round
    finally:
        Supervisor(args.state_dir).down()
    measured = report.write(results, args.out / "ab")
    if measured["errors"]:
        print(f"{measured['errors']} request(s) failed: {measured['error_samples']}")
        return 1
    constants = calibrate.fit_raw({k: [p for r in rounds for p in r[k]] for k in rounds[0]})
    rows = compare(predict(constants), measured["turns"])
    first = compare(predict(calibrate.fit_raw(rounds[0])), measured["turns"])
    table = markdown(rows, args.tolerance)
    print("\nconstants fitted on every round:", json.dumps(constants["efficiency"]))
    print(f"\nmeasured on the local stack vs predicted from the calibration rounds around it:\n{table}")
    print(f"\nfrom the first calibration round alone:\n{markdown(first, args.tolerance)}")
    (args.out / "plan-accuracy.json").write_text(json.dumps(
        {"constants": constants, "rows": rows, "rows_first_round_only": first, "tolerance": args.tolerance},
        indent=2))
    (args.out / "plan-accuracy.md").write_text(table + "\n")
    print(f"\nwrote {args.out / 'plan-accuracy.json'} and {args.out / 'plan-accuracy.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
