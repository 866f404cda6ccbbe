"""Decode-engine CPU while it only holds retained KV blocks, upstream loop vs turnkv's idle tick.

For each variant: start the local stack, play a burst of two-turn conversations (so decode retains
every finished turn's blocks), then sample the decode engine's CPU time over the next window while
nothing is running. TTFT with reuse on (turn 2) is recorded too, to show the idle tick costs none.

    python -m bench.idle_cpu --window 60 --out results/idle-cpu
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

from bench.client import Result, chat
from bench.variants import cpu_percent_over, report, stack_with_env
from bench.workload import WorkloadSpec, build
from turnkv.engine_args import Mode
from turnkv.local.model import load_words

VARIANTS = {
    # What vLLM does on its own: a 1 ms engine loop while blocks are retained and a 1 s worker spin after
    # every step (NIXL without a progress thread, as the local stack needs anyway).
    "upstream loops": {"TURNKV_IDLE_TICK_MS": "0", "TURNKV_WORKER_SPIN_MS": "1000", "TURNKV_NIXL_PROGRESS_US": "0"},
    "turnkv: 100 ms idle tick, 2 ms worker spin": {},
    "turnkv, 1 s idle tick, 50 ms spin": {"TURNKV_IDLE_TICK_MS": "1000", "TURNKV_WORKER_SPIN_MS": "50"},
    # What the shared-memory recheck (10 ms with the spin cut: a lost wake-up's bound) costs an idle engine.
    "turnkv, upstream's 5 s recheck": {"TURNKV_WORKER_RECHECK_MS": "5000"},
}


async def burst(url: str, words: list[str], conversations: int) -> list[Result]:
    import aiohttp

    spec = WorkloadSpec(conversations=conversations, turns=2, system_words=300, first_user_words=1500,
                        turn_words=200, max_tokens=16, seed=11)
    results = []
    async with aiohttp.ClientSession() as session:
        for conv in build(spec, words):
            replies: list[str] = []
            for turn in range(2):
                body = {"model": "tiny", "messages": conv.messages_for(turn, replies), "max_tokens": 16,
                        "temperature": 0, "stream": True, "conversation_id": f"idle-{conv.index}-{time.time()}"}
                r = await chat(session, url, body, {}, Result(conv.index, turn, "on"), 300)
                replies.append(r.reply)
                results.append(r)
    return results


def run_variant(name: str, env: dict[str, str], state_dir: Path, window: float, conversations: int,
                mode: Mode = Mode.PULL) -> dict:
    with stack_with_env(env, state_dir, port_base=8400, mode=mode) as state:
        results = asyncio.run(burst(state["components"]["router"]["url"], load_words(state["model_dir"]),
                                    conversations))
        time.sleep(2)  # let the last request's own busy second pass
        groups = [state["components"][name]["pgid"] for name in ("decode-0", "prefill-0")]
        cpu, prefill_cpu = cpu_percent_over(groups, window)
    ttft = [r.ttft_ms for r in results if r.turn == 1 and r.ttft_ms is not None]
    return {"variant": name, "mode": mode.value, "decode_cpu_percent": round(cpu, 1),
            "prefill_cpu_percent": round(prefill_cpu, 1), "window_s": window,
            "ttft_ms_turn2_median": round(statistics.median(ttft)) if ttft else None,
            "reused_tokens_turn2": [r.reused_tokens for r in results if r.turn == 1],
            "errors": sum(1 for r in results if r.error)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=float, default=60.0, help="seconds of CPU sampling after the burst")
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--variant", action="append", choices=list(VARIANTS), help="run only these (repeatable)")
    parser.add_argument("--out", type=Path, default=Path("results/idle-cpu"))
    parser.add_argument("--state-dir", type=Path, default=Path(".turnkv/idle-cpu"))
    parser.add_argument("--mode", type=Mode, choices=list(Mode), default=Mode.PULL, help="connector mode")
    args = parser.parse_args()
    chosen = args.variant or list(VARIANTS)
    rows = [run_variant(name, VARIANTS[name], args.state_dir, args.window, args.conversations, args.mode)
            for name in chosen]
    report(rows, args.out, {
        "variant": lambda r: f"{r['variant']} ({r['mode']})",
        "decode CPU after burst": lambda r: f"{r['decode_cpu_percent']}% of a core",
        "prefill CPU": lambda r: f"{r['prefill_cpu_percent']}% of a core",
        "window": lambda r: f"{r['window_s']} s",
        "TTFT turn 2 (reuse on, median)": lambda r: f"{r['ttft_ms_turn2_median']} ms",
        "errors": lambda r: r["errors"],
    })

if __name__ == "__main__":
    main()
