"""Decode KV memory held after a mixed workload: upstream (every request retained) vs retain on demand.

Mixed workload: conversation turns (which the next turn will pull back) interleaved with one-shot
requests (no conversation: nobody comes back for their KV). Upstream bi-directional decode pins every
finished request's blocks for decoder_kv_blocks_ttl; turnkv's connector pins only what the router
marks as a conversation turn. After the workload the decode engine's KV cache usage is read from its
/metrics; then every conversation plays its second turn to show reuse is intact.

    python -m bench.retention --out results/retention [--mode push]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import aiohttp

from bench import engine_metrics
from bench.client import Result, chat
from bench.variants import report, stack_with_env
from bench.workload import WorkloadSpec, build
from turnkv.engine_args import Mode
from turnkv.local.model import load_words

VARIANTS = {
    "upstream: retain every request": {"TURNKV_RETAIN_ON_DEMAND": "0"},
    "turnkv: retain on demand": {},
}


async def decode_kv(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """decode's KV usage (0-1) and its KV cache bytes."""
    text = await engine_metrics.fetch(session, url)
    config = engine_metrics.cache_config(text)
    return engine_metrics.total(text, "vllm:kv_cache_usage_perc") if text else 0.0, (
        config.kv_cache_memory_bytes if config else 0.0)


async def workload(state: dict, words: list[str], conversations: int, one_shots: int) -> dict:
    router = state["components"]["router"]["url"]
    decode = state["components"]["decode-0"]["url"]
    spec = WorkloadSpec(conversations=conversations, turns=2, system_words=100, first_user_words=1200,
                        turn_words=100, max_tokens=16, seed=5)
    shots = build(WorkloadSpec(conversations=conversations * one_shots, turns=1, system_words=100,
                               first_user_words=1200, seed=6), words)
    run = str(time.time())
    async with aiohttp.ClientSession() as session:
        convs = build(spec, words)
        replies: dict[int, str] = {}
        for conv in convs:
            body = {"model": "tiny", "messages": conv.messages_for(0, []), "max_tokens": 16, "temperature": 0,
                    "stream": True, "conversation_id": f"ret-{run}-{conv.index}"}
            replies[conv.index] = (await chat(session, router, body, {}, Result(conv.index, 0, "on"), 300)).reply
            for shot in shots[conv.index * one_shots:(conv.index + 1) * one_shots]:
                body = {"model": "tiny", "messages": shot.messages_for(0, []), "max_tokens": 16, "temperature": 0,
                        "stream": True}
                await chat(session, router, body, {}, Result(shot.index, 0, "one-shot"), 300)
        usage, capacity = await decode_kv(session, decode)
        reused = []
        for conv in convs:
            body = {"model": "tiny", "messages": conv.messages_for(1, [replies[conv.index]]), "max_tokens": 16,
                    "temperature": 0, "stream": True, "conversation_id": f"ret-{run}-{conv.index}"}
            reused.append((await chat(session, router, body, {}, Result(conv.index, 1, "on"), 300)).reused_tokens)
    return {"decode_kv_usage_percent": round(100 * usage, 2), "decode_kv_held_mib": round(usage * capacity / 2**20, 1),
            "requests": conversations * (1 + one_shots), "conversation_turns": conversations,
            "turn2_reused_tokens_min": min(reused)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--one-shots", type=int, default=3, help="one-shot requests per conversation turn")
    parser.add_argument("--out", type=Path, default=Path("results/retention"))
    parser.add_argument("--state-dir", type=Path, default=Path(".turnkv/retention"))
    parser.add_argument("--mode", type=Mode, choices=list(Mode), default=Mode.PULL, help="connector mode")
    args = parser.parse_args()
    rows = []
    for name, env in VARIANTS.items():
        with stack_with_env(env, args.state_dir, port_base=8500, mode=args.mode) as state:
            words = load_words(state["model_dir"])
            measured = asyncio.run(workload(state, words, args.conversations, args.one_shots))
            rows.append({"variant": name, "mode": args.mode.value, **measured})
    report(rows, args.out, {
        "variant": lambda r: f"{r['variant']} ({r['mode']})",
        "requests (conversation turns)": lambda r: f"{r['requests']} ({r['conversation_turns']})",
        "decode KV held after": lambda r: f"{r['decode_kv_held_mib']} MiB",
        "usage": lambda r: f"{r['decode_kv_usage_percent']}%",
        "turn-2 reuse (min tokens)": lambda r: r["turn2_reused_tokens_min"],
    })

if __name__ == "__main__":
    main()
