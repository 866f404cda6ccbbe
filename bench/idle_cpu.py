"""Decode-engine CPU while it only holds retained KV blocks, upstream loop vs turnkv's idle tick.

For each variant: start the local stack, play a burst of two-turn conversations (so decode retains
every finished turn's blocks), then sample the decode engine's CPU time over the next window while
nothing is running. TTFT with reuse on (turn 2) is recorded too, to show the idle tick costs none.

    python -m bench.idle_cpu --window 60 --out results/idle-cpu
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import psutil

from bench.client import Result, chat
from bench.workload import WorkloadSpec, build
from turnkv.local.model import load_words
from turnkv.local.stack import StackConfig, Supervisor

VARIANTS = {
    # What vLLM does on its own: a 1 ms engine loop while blocks are retained, NIXL without a progress thread.
    "upstream loop": {"TURNKV_IDLE_TICK_MS": "0", "TURNKV_NIXL_PROGRESS_US": "0"},
    "turnkv idle tick": {},
}


def group_cpu_seconds(pgid: int) -> float:
    total = 0.0
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) == pgid:
                t = proc.cpu_times()
                total += t.user + t.system
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    return total


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


def run_variant(name: str, env: dict[str, str], state_dir: Path, window: float, conversations: int) -> dict:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    config = StackConfig(state_dir=state_dir, router_port=8400, prefill_port=8410, decode_port=8420,
                         side_channel_base=5640)
    supervisor = Supervisor(state_dir)
    try:
        state = supervisor.up(config)
        results = asyncio.run(burst(state["components"]["router"]["url"], load_words(config.model_dir),
                                    conversations))
        decode_pgid = state["components"]["decode-0"]["pgid"]
        time.sleep(2)  # let the last request's own busy second pass
        start_cpu, start = group_cpu_seconds(decode_pgid), time.monotonic()
        time.sleep(window)
        used = group_cpu_seconds(decode_pgid) - start_cpu
        elapsed = time.monotonic() - start
    finally:
        supervisor.down()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    ttft = [r.ttft_ms for r in results if r.turn == 1 and r.ttft_ms is not None]
    return {"variant": name, "decode_cpu_percent": round(100 * used / elapsed, 1), "window_s": round(elapsed),
            "ttft_ms_turn2_median": round(statistics.median(ttft)) if ttft else None,
            "reused_tokens_turn2": [r.reused_tokens for r in results if r.turn == 1],
            "errors": sum(1 for r in results if r.error)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=float, default=60.0, help="seconds of CPU sampling after the burst")
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--out", type=Path, default=Path("results/idle-cpu"))
    parser.add_argument("--state-dir", type=Path, default=Path(".turnkv/idle-cpu"))
    args = parser.parse_args()
    rows = [run_variant(name, env, args.state_dir, args.window, args.conversations) for name, env in VARIANTS.items()]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(rows, indent=2))
    print("| variant | decode CPU after burst | window | TTFT turn 2 (reuse on, median) | errors |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['decode_cpu_percent']}% of a core | {r['window_s']} s | "
              f"{r['ttft_ms_turn2_median']} ms | {r['errors']} |")


if __name__ == "__main__":
    main()
