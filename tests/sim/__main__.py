"""Command line: ``python -m tests.sim`` (a batch), ``--seed N --trace`` (replay one), ``--soak-seconds S`` (soak).

Examples::

    python -m tests.sim --schedules 2000                 # seeds 0..1999 of the default scenario
    python -m tests.sim --seed 38 --trace                # replay seed 38 with its whole trace
    python -m tests.sim --soak-seconds 600 --scenario all --first 100000
"""

from __future__ import annotations

import argparse
import sys
import time

from tests.sim.runner import SCENARIOS, Summary, report, run_many

#: Failing seeds listed per scenario (a soak may find hundreds of one defect).
LISTED = 20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.sim", description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, help="replay this seed (with --trace: print its whole trace)")
    parser.add_argument("--trace", action="store_true",
                        help="print the whole trace of --seed (else the first violation's story)")
    parser.add_argument("--schedules", type=int, default=2000, help="seeds --first.. of a batch (default 2000)")
    parser.add_argument("--first", type=int, default=0, help="first seed of a batch or soak")
    parser.add_argument("--soak-seconds", type=float, help="run seeds from --first on for this long")
    parser.add_argument("--scenario", default="default", choices=[*SCENARIOS, "all"],
                        help="default, spec (speculative decoding's lookahead blocks), stall (READs that stall), "
                             "all (each in turn)")
    parser.add_argument("--show", type=int, default=3, help="failing seeds to print the story of")
    args = parser.parse_args(argv)
    scenarios = list(SCENARIOS) if args.scenario == "all" else [args.scenario]

    if args.seed is not None:
        text = report(args.seed, args.trace, scenarios[0])
        print(text)
        return 1 if "VIOLATION" in text else 0

    failing = 0
    started = time.perf_counter()
    for i, scenario in enumerate(scenarios):
        if args.soak_seconds is not None:
            left = args.soak_seconds * (i + 1) / len(scenarios) - (time.perf_counter() - started)
            summary = run_many(seconds=max(0.0, left), first=args.first, scenario=scenario)
        else:
            summary = run_many(range(args.first, args.first + args.schedules), scenario=scenario)
        failing += len(summary.failing)
        _print(scenario, summary, args.show)
    return 1 if failing else 0


def _print(scenario: str, summary: Summary, show: int) -> None:
    print(f"[{scenario}] {summary.describe()}")
    for seed, violations in list(summary.failing.items())[:LISTED]:
        print(f"  seed {seed}: {violations[0]}   (replay: python -m tests.sim --scenario {scenario} --seed {seed})")
    if len(summary.failing) > LISTED:
        print(f"  ... and {len(summary.failing) - LISTED} more failing seeds")
    for seed in list(summary.failing)[:show]:
        print(f"\n--- seed {seed} ({scenario}): the first violation's story ---")
        print(report(seed, False, scenario))
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
