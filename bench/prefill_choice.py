"""Reuse share by source before and after the cache-aware prefill choice (issue 30), on real CPU engines.

Two prefill engines with prefix caching on (as deployed) and one decode engine, behind two routers over the same
engines: ``router-load`` picks prefill by load alone (``prefill_affinity_slack`` 0, the choice before), the stack's
router prefers the engine that computed a tenant's shared prefix before (the default slack). An agent trace whose
shared prefix is longer than each conversation's own first turn (``agent-coding``: 700 words against tasks of 60 to
150) is played with reuse on through each, with a different seed each time (new words, so neither run finds the
other's prefixes in the prefill caches), after a warm-up session through each. Reported per router: TTFT p50/p90
and the prompt tokens by source (prefill's own cache, pulled from decode, recomputed).

    python -m bench.prefill_choice --out results/prefill-choice
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

from bench import agent_bench, agent_report, agent_trace
from turnkv.local.stack import ExtraRouter, StackConfig, Supervisor

BEFORE, AFTER = "load only", "cache-aware"


def runs(trace: agent_trace.AgentTrace) -> list[tuple[str, agent_trace.AgentTrace]]:
    """(label, trace) in the order played: a warm-up of one session, then each choice on its own seed (pure)."""
    warm = dataclasses.replace(trace, sessions=1, seed=trace.seed + 100)
    return [("warm-up", warm), (BEFORE, dataclasses.replace(trace, seed=trace.seed + 1)),
            (AFTER, dataclasses.replace(trace, seed=trace.seed + 2))]


def row(label: str, summary: dict[str, Any]) -> str:
    arm = summary["per_arm"]["on"]
    tokens = arm["tokens"]

    def pct(share: float | None) -> str:
        return "-" if share is None else f"{100 * share:.1f}%"

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:,.0f}"

    return (f"| {label} | {arm['requests']} | {arm['errors']} | {ms(arm['ttft_p50_ms'])} | "
            f"{ms(arm['ttft_p90_ms'])} | {pct(tokens['share_prefill_cache'])} | "
            f"{pct(tokens['share_pulled'])} | {pct(tokens['share_recomputed'])} | "
            f"{arm['fork_turns_pulled']}/{arm['fork_turns']} |")


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = ["| prefill choice | requests | errors | TTFT p50 ms | TTFT p90 ms | prefill cache | pulled | recomputed "
             "| forks pulled |", "|---|---|---|---|---|---|---|---|---|"]
    return "\n".join([*lines, *(row(label, s) for label, s in results.items())])


async def play_all(trace: agent_trace.AgentTrace, urls: dict[str, str], time_scale: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, each in runs(trace):
        sessions = agent_trace.expand(each)
        for url in (urls.values() if label == "warm-up" else [urls[label]]):
            records = await agent_bench.play(sessions, agent_bench.PlaySpec(url=url, arms=("on",),
                                                                            time_scale=time_scale))
            if label != "warm-up":
                out[label] = agent_report.summarize(records)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default="agent-coding", help="An agent trace file or a shipped trace's name.")
    ap.add_argument("--out", type=Path, default=Path("results/prefill-choice"))
    ap.add_argument("--time-scale", type=float, default=0.25)
    ap.add_argument("--port-base", type=int, default=8800)
    args = ap.parse_args(argv)
    trace = agent_trace.load(agent_trace.resolve(args.trace))
    base = args.port_base
    config = StackConfig(state_dir=args.out / "stack", router_port=base, prefill_port=base + 10,
                         decode_port=base + 20, side_channel_base=base - 2900, prefill_engines=2, kv_cache_gib=1,
                         prefill_prefix_caching=True,
                         extra_routers=(ExtraRouter("router-load", base + 1,
                                                    tunables={"prefill_affinity_slack": 0}),))
    supervisor = Supervisor(config.state_dir)
    try:
        state = supervisor.up(config)
        comps = state["components"]
        urls = {BEFORE: comps["router-load"]["url"], AFTER: comps["router"]["url"]}
        results = asyncio.run(play_all(trace, urls, args.time_scale))
    finally:
        supervisor.down()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(results, indent=2))
    text = table(results)
    (args.out / "summary.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
