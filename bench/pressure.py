"""Retention pressure: reuse and TTFT as live conversations outnumber what decode can retain.

Levels are multiples of the conversations whose last turn fits in decode's retention room
(``retained_kv_share`` x decode's KV blocks, from its /metrics, over the blocks of one conversation's last
turn; ``--fit`` overrides). At each level N conversations are played at once, one client task each, with
think times between turns. The reuse-on phase comes first and the same turns are then played again with
``X-TurnKV-Reuse: off``, as a second phase rather than interleaved: interleaved, each arm's requests would
queue behind the other's on the one prefill engine, and decode's counters and gauges (evictions, refusals,
bytes per tier, read before and after the reuse-on phase) would mix in the other arm's traffic. Reuse-off
turns are not retained by decode (the router does not ask), so the second phase does not add pressure.

Per variant (engine tunables such as ``retained_kv_share`` and ``host_kv_budget_mib``) it starts its own
local stack (``turnkv.local.stack``), by default one per level so that no level starts with the turns of the
one before it in decode's room; or runs against a router already up (``--url``, one variant).

    python -m bench.pressure --levels 1,3 --variant "device only=retained_kv_share=0.02"
    python -m bench.pressure --url http://127.0.0.1:8000 --decode-url http://127.0.0.1:8200 --fit 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from bench import arms, engine_metrics
from bench import pressure_calc as calc
from bench.client import REUSE_OFF_HEADERS, Result, chat
from bench.pressure_report import append_results, fit_line, played, table, table_console, write
from bench.workload import Conversation, WorkloadSpec, build, from_workload_file

SAMPLE_EVERY_S = 2.0


@dataclass
class PressureOptions:
    """The pressure sweep's settings (levels, turns, think times, bounds); ``turnkv.doctor.Options`` is doctor's."""

    levels: list[float] = field(default_factory=lambda: [0.5, 1, 2, 4, 8])
    turns: int = 4
    think: calc.Think = field(default_factory=lambda: calc.Think("fixed", 35.0))
    workload: WorkloadSpec = field(default_factory=lambda: WorkloadSpec(
        turns=4, system_words=200, first_user_words=300, turn_words=200, max_tokens=16, seed=7))
    #: A ``turnkv plan`` workload (turnkv.plan.workload.Workload): lengths and think times from its samples.
    planned: Any = None
    fit: int | None = None
    stagger: float = 0.2
    timeout: float = 300.0
    #: Wall-clock bound on the whole sweep: no turn starts after it (what is left is counted as skipped).
    max_seconds: float = 7200.0
    #: A level needing more conversations than this is not played (reported as skipped): a bound on requests.
    max_conversations: int = 256
    sample_every: float = SAMPLE_EVERY_S
    words: list[str] | None = None
    #: The three-arm mode (``bench.arms``): the arms played per level, in ``arms.PLAY_ORDER``; empty: reuse on then
    #: off (the retention-pressure sweep).
    arms: tuple[str, ...] = ()
    #: Replies of exactly ``max_tokens`` (vLLM's ``min_tokens``): agent-sized replies the tiny model does not end
    #: early.
    exact_replies: bool = False
    #: What a level's 1x is: the conversations decode's retention room holds ("decode"), or the conversations the
    #: peer's prefill cache (device + offload memory) holds ("prefill", the three-arm mode).
    fit_from: str = "decode"
    #: The three-arm mode's stack: at the target fleet's memory ratios (turnkv.plan.ratios) from this many turnkv
    #: prefill blocks.
    prefill_blocks: int = 16
    #: Capacity is counted at this TTFT p90 of turns 2+.
    ttft_target_ms: float = 1000.0


@dataclass
class Target:
    """What a level is played against: the router, and decode for its /metrics and memory."""

    url: str
    decode_url: str | None = None
    decode_pid: int | None = None
    model: str | None = None
    #: prefill's base URL: its pulls by tier (``vllm:turnkv_pulls_total{tier}``) over the reuse-on phase.
    prefill_url: str | None = None
    #: The peer-best arm's router and prefill engine (``StackConfig.peer``).
    peer_url: str | None = None
    peer_prefill_url: str | None = None


# -- conversations -----------------------------------------------------------------------------------


def conversations(opts: PressureOptions, n: int, level_index: int) -> list[Conversation]:
    """``n`` conversations of at most ``opts.turns`` turns (a workload file's too: the sweep stays bounded), with
    text of their own per level (no level finds another's turns by content)."""
    seed = opts.workload.seed + 1000 * level_index
    if opts.planned is None:
        return build(dataclasses.replace(opts.workload, conversations=n, turns=opts.turns, seed=seed), opts.words)
    convs = from_workload_file(dataclasses.replace(opts.planned, num_conversations=n), opts.words, seed)
    t = opts.turns
    return [dataclasses.replace(c, user_turns=c.user_turns[:t], max_tokens=c.max_tokens[:t], think_s=c.think_s[:t])
            for c in convs]


#: Conversations sampled to find the largest last turn of a workload file (a file may describe thousands).
FIT_SAMPLE = 64


def tokens_per_conversation(opts: PressureOptions) -> int:
    """The largest last turn (prompt + reply tokens) of the workload, for the fit."""
    n = min(opts.planned.num_conversations, FIT_SAMPLE) if opts.planned is not None else 4
    return max(calc.last_turn_tokens(c, opts.workload.max_tokens) for c in conversations(opts, n, 0))


# -- decode's metrics and memory ---------------------------------------------------------------------


async def metrics_text(session: aiohttp.ClientSession, decode_url: str) -> str | None:
    return await engine_metrics.fetch(session, decode_url)


def rss_bytes(pid: int | None) -> int | None:
    """Resident memory of a process and its children (vLLM's engine core is a child of the API server)."""
    if pid is None:
        return None
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


async def snapshot(session: aiohttp.ClientSession, target: Target) -> dict[str, float]:
    """decode's turnkv series (by tier/reason) plus ``rss_bytes`` when the pid is known."""
    text = await metrics_text(session, target.decode_url) if target.decode_url else None
    series = calc.turnkv_series(text) if text else {}
    rss = rss_bytes(target.decode_pid)
    return {**series, **({"rss_bytes": float(rss)} if rss is not None else {})}


async def prefill_series(session: aiohttp.ClientSession, target: Target) -> dict[str, float]:
    text = await metrics_text(session, target.prefill_url) if target.prefill_url else None
    return calc.turnkv_series(text) if text else {}


async def sample_until(session: aiohttp.ClientSession, target: Target, stop: asyncio.Event, every: float,
                       into: list[dict[str, float]]) -> None:
    while not stop.is_set():
        into.append(await snapshot(session, target))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every)


async def read_fit(session: aiohttp.ClientSession, target: Target, share: float, opts: PressureOptions) -> calc.Fit:
    if opts.fit_from == "prefill" and opts.fit is None:
        return await prefill_fit(session, target, opts)
    if opts.fit is not None:
        return calc.Fit(opts.fit, "given", retained_kv_share=share,
                        last_turn_tokens=tokens_per_conversation(opts))
    text = await metrics_text(session, target.decode_url) if target.decode_url else None
    config = calc.cache_config(text) if text else None
    if config is None:
        raise RuntimeError(f"no vllm:cache_config_info on {target.decode_url}/metrics: pass --fit N "
                           "(conversations whose last turn fits in decode's retention room)")
    return calc.compute_fit(config[0], config[1], share, tokens_per_conversation(opts))


async def prefill_fit(session: aiohttp.ClientSession, target: Target, opts: PressureOptions) -> calc.Fit:
    """1x of the three-arm mode: the conversations whose last turn the peer's prefill cache holds (its device
    blocks plus the offload tier's, from its ``vllm:cache_config_info``)."""
    from turnkv.plan import ratios

    url = target.peer_prefill_url or target.prefill_url
    config = engine_metrics.cache_config(await engine_metrics.fetch(session, url)) if url else None
    if config is None:
        raise RuntimeError(f"no vllm:cache_config_info on {url}/metrics: pass --fit N")
    per = tokens_per_conversation(opts)
    n = ratios.fit(per, config.num_gpu_blocks, config.block_size)
    blocks = -(-per // config.block_size)
    return calc.Fit(n, "prefill", config.num_gpu_blocks, config.block_size, 1.0, config.num_gpu_blocks, per, blocks)


# -- playing a level ---------------------------------------------------------------------------------


async def play(session: aiohttp.ClientSession, target: Target, convs: list[Conversation], opts: PressureOptions,
               arm: str, tag: str, deadline: float, on_result: Callable[[Result], None]) -> tuple[list[Result], int]:
    """Every conversation at once, one task each, think times between turns; returns results and turns skipped
    for the deadline."""
    results: list[Result] = []
    skipped = 0
    headers = arms.headers(arm) if opts.arms else dict(REUSE_OFF_HEADERS) if arm == "off" else {}
    url = target.peer_url if arm == "peer" else target.url
    assert url, f"the {arm} arm has no router URL"
    think_seed = opts.workload.seed

    async def converse(conv: Conversation) -> None:
        nonlocal skipped
        await asyncio.sleep(conv.index * opts.stagger)
        replies: list[str] = []
        delays = opts.think.delays(conv, think_seed)
        for turn in range(len(conv.user_turns)):
            if delays[turn]:
                await asyncio.sleep(delays[turn])
            if time.monotonic() > deadline:
                skipped += len(conv.user_turns) - turn
                return
            max_tokens = conv.max_tokens[turn] if conv.max_tokens else opts.workload.max_tokens
            body = {"model": target.model, "messages": conv.messages_for(turn, replies), "max_tokens": max_tokens,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                    "conversation_id": f"pressure-{tag}-{conv.index}-{arm}",
                    **({"min_tokens": max_tokens} if opts.exact_replies else {}),
                    **arms.body_extras(arm)}  # off: a salt of its own (prefill may cache)
            result = await chat(session, url, body, headers, Result(conv.index, turn, arm), opts.timeout)
            replies.append(result.reply)
            results.append(result)
            on_result(result)

    await asyncio.gather(*(converse(c) for c in convs))
    return results, skipped


async def run_level(target: Target, convs: list[Conversation], opts: PressureOptions, tag: str, deadline: float,
                    on_result: Callable[[Result], None]) -> tuple[dict[str, Any], list[Result]]:
    """Reuse on (decode sampled throughout, counters read before and after), then reuse off."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        if target.model is None:
            from bench.runner import discover_model

            target.model = await discover_model(session, target.url)
        before = await snapshot(session, target)
        prefill_before = await prefill_series(session, target)
        samples: list[dict[str, float]] = [before]
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_until(session, target, stop, opts.sample_every, samples))
        started = time.monotonic()
        on, skipped_on = await play(session, target, convs, opts, "on", tag, deadline, on_result)
        on_seconds = time.monotonic() - started
        stop.set()
        await sampler
        after = await snapshot(session, target)
        prefill_after = await prefill_series(session, target)
        samples.append(after)
        off, skipped_off = await play(session, target, convs, opts, "off", tag, deadline, on_result)
    summary = calc.level_summary(on, off)
    deltas = calc.counter_deltas(before, after)
    rss = [s["rss_bytes"] for s in samples if "rss_bytes" in s]
    summary.update({
        "turns_skipped": skipped_on + skipped_off,
        "reuse_on_phase_s": round(on_seconds, 1),
        "decode_counters": deltas,
        "evictions": calc.sum_by(deltas, "vllm:turnkv_retention_evictions_total")
        + calc.sum_by(deltas, "vllm:turnkv_retention_evicted_total"),
        "refusals": calc.sum_by(deltas, "vllm:turnkv_retention_refusals_total")
        + calc.sum_by(deltas, "vllm:turnkv_retention_refused_total"),
        "tier_bytes": calc.gauge_peaks(samples),
        "prefill_counters": calc.counter_deltas(prefill_before, prefill_after) if target.prefill_url else None,
        "decode_rss_mib": {"peak": round(max(rss) / 2**20, 1), "last": round(rss[-1] / 2**20, 1)} if rss else None,
        "decode_metrics": bool(target.decode_url) and any(k != "rss_bytes" for k in after),
    })
    return summary, on + off


async def prompt_sources(session: aiohttp.ClientSession, url: str | None) -> dict[str, float]:
    """An engine's prompt tokens by source so far (``vllm:prompt_tokens_by_source``)."""
    text = await engine_metrics.fetch(session, url) if url else None
    return {s: engine_metrics.total(text, arms.PROMPT_TOKENS_BY_SOURCE, source=s) for s in arms.PROMPT_SOURCES} \
        if text else {}


async def run_arms_level(target: Target, convs: list[Conversation], opts: PressureOptions, tag: str, deadline: float,
                         on_result: Callable[[Result], None]) -> tuple[dict[str, Any], list[Result]]:
    """The three-arm mode: every arm of ``opts.arms`` in turn (``bench.arms``), each arm's prefill engine's prompt
    tokens by source read before and after its phase, decode's counters over turnkv's."""
    played: dict[str, list[Result]] = {}
    found: dict[str, dict[str, Any]] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        if target.model is None:
            from bench.runner import discover_model

            target.model = await discover_model(session, target.url)
        for arm in opts.arms:
            prefill = target.peer_prefill_url if arm == "peer" else target.prefill_url
            before = await prompt_sources(session, prefill)
            decode_before = await snapshot(session, target) if arm == "on" else {}
            pulls_before = await prefill_series(session, target) if arm == "on" else {}
            started = time.monotonic()
            results, skipped = await play(session, target, convs, opts, arm, tag, deadline, on_result)
            seconds = time.monotonic() - started
            after = await prompt_sources(session, prefill)
            tiers: dict[str, float] = {}
            if arm == "on":
                deltas = calc.counter_deltas(pulls_before, await prefill_series(session, target))
                tiers = {k.split('"')[1]: v for k, v in deltas.items() if k.startswith("vllm:turnkv_pulls_total{")}
                decode_deltas = calc.counter_deltas(decode_before, await snapshot(session, target))
                found["decode_counters"] = decode_deltas
            played[arm] = results
            found[arm] = {"skipped": skipped, "seconds": round(seconds, 1),
                          "prefill": arms.sources_delta(before, after) if before and after else None,
                          "pulls_by_tier": tiers}
    off = played.get("off")
    summary: dict[str, Any] = calc.level_summary(played.get("on", []), off or [])
    summary["arms"] = {arm: {**arms.arm_summary(arm, played[arm], off, found[arm]["prefill"],
                                                found[arm]["pulls_by_tier"]),
                             "phase_s": found[arm]["seconds"], "turns_skipped": found[arm]["skipped"]}
                       for arm in opts.arms}
    deltas = found.get("decode_counters", {})
    summary.update({
        "turns_skipped": sum(found[a]["skipped"] for a in opts.arms),
        "decode_counters": deltas,
        "evictions": calc.sum_by(deltas, "vllm:turnkv_retention_evictions_total"),
        "refusals": calc.sum_by(deltas, "vllm:turnkv_retention_refusals_total"),
        "tier_bytes": {}, "prefill_counters": None, "decode_rss_mib": None,
        "decode_metrics": bool(deltas),
    })
    return summary, [r for arm in opts.arms for r in played[arm]]


# -- variants: a stack of their own, or the router given ---------------------------------------------


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so a killed sweep still stops the stack it started (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def arms_stack(variant: calc.Variant, prefill_blocks: int) -> dict[str, Any]:
    """``StackConfig`` fields of the three-arm mode: the peer arm, turnkv's prefill with prefix caching on (as
    deployed), every pool at the target fleet's ratios (``turnkv.plan.ratios``), the variant's tunables on top."""
    from turnkv import params
    from turnkv.local.stack import StackConfig, at_ratios
    from turnkv.plan import ratios

    sized = at_ratios(StackConfig(), ratios.scale(prefill_blocks=prefill_blocks))
    tunables = params.fit_router_ttl({**sized.tunables, **variant.tunables})
    return {"peer": True, "prefill_prefix_caching": True, "prefill_blocks": sized.prefill_blocks,
            "peer_prefill_blocks": sized.peer_prefill_blocks, "decode_blocks": sized.decode_blocks,
            "max_model_len": sized.max_model_len, "tunables": params.validate(tunables) and tunables}


@contextlib.contextmanager
def stack_target(variant: calc.Variant, state_dir: Path, port_base: int,
                 opts: PressureOptions | None = None) -> Iterator[tuple[Target, list[str]]]:
    """A local stack with the variant's engine tunables (with the peer arm, at the target's ratios, in the
    three-arm mode); stopped on exit, Ctrl-C included (its own ``down``)."""
    from bench.variants import stack_with_env
    from turnkv.local.model import load_words

    config = arms_stack(variant, opts.prefill_blocks) if opts is not None and "peer" in opts.arms else {
        "tunables": dict(variant.tunables)}
    with sigterm_as_interrupt(), stack_with_env({}, state_dir, port_base=port_base, **config) as state:
        components = state["components"]
        decode = components["decode-0"]
        peer = components.get("router-peer")
        yield (Target(components["router"]["url"], decode["url"], decode["pid"],
                      prefill_url=components["prefill-0"]["url"], peer_url=peer["url"] if peer else None,
                      peer_prefill_url=components["prefill-peer"]["url"] if peer else None),
               load_words(state["model_dir"]))


def _tunables(variant: calc.Variant) -> str:
    return ", ".join(f"{k}={v}" for k, v in variant.tunables.items()) or "default tunables"


def share_of(variant: calc.Variant) -> float:
    from turnkv import params

    return float(variant.tunables.get("retained_kv_share", params.BY_NAME["retained_kv_share"].default))


def skipped(level: float, n: int, opts: PressureOptions) -> dict[str, Any]:
    return {"level": level, "conversations": n, "skipped": f"over --max-conversations {opts.max_conversations}"}


async def _fit_and_level(target: Target, variant: calc.Variant, opts: PressureOptions, index: int, level: float,
                         run_id: str, deadline: float, on_result: Callable[[Result], None],
                         on_start: Callable[[int], None], fit: calc.Fit | None) -> tuple[dict, list[Result], calc.Fit]:
    if fit is None:
        async with aiohttp.ClientSession() as session:
            fit = await read_fit(session, target, share_of(variant), opts)
    n = calc.conversations_at(level, fit.conversations)
    if n > opts.max_conversations:
        return skipped(level, n, opts), [], fit
    on_start(n)
    convs = conversations(opts, n, index)
    level_run = run_arms_level if opts.arms else run_level
    summary, results = await level_run(target, convs, opts, f"{run_id}-{index}", deadline, on_result)
    return {"level": level, "conversations": n, **summary}, results, fit


def sweep_variant(variant: calc.Variant, opts: PressureOptions, *, url: Target | None = None, state_dir: Path = Path(
        ".turnkv/pressure"), port_base: int = 8700, stack_per: str = "level",
        on_result: Callable[[Result], None] = lambda r: None, on_level_start: Callable[[str, float, int], None]
        = lambda v, lv, n: None, on_level: Callable[[dict[str, Any], list[Result]], None] = lambda lv, rs: None,
        deadline: float | None = None, say: Callable[[str], None] = lambda text: None) -> dict[str, Any]:
    """Every level for one variant: against ``url``, or on its own stack (one per level or per variant)."""
    run_id = uuid.uuid4().hex[:6]
    deadline = deadline if deadline is not None else time.monotonic() + opts.max_seconds
    levels: list[dict[str, Any]] = []
    fit: calc.Fit | None = None

    def one(target: Target, index: int, level: float, fit: calc.Fit | None) -> calc.Fit:
        summary, results, fit = asyncio.run(_fit_and_level(
            target, variant, opts, index, level, run_id, deadline, on_result,
            lambda n: on_level_start(variant.name, level, n), fit))
        levels.append(summary)
        on_level(summary, results)
        return fit

    if url is not None:
        for i, level in enumerate(opts.levels):
            if time.monotonic() > deadline:
                break
            fit = one(url, i, level, fit)
    elif stack_per == "variant":
        say(f"{variant.name}: starting a local stack ({_tunables(variant)}), about a minute")
        with stack_target(variant, state_dir, port_base, opts) as (target, words):
            opts.words = opts.words or words
            for i, level in enumerate(opts.levels):
                if time.monotonic() > deadline:
                    break
                fit = one(target, i, level, fit)
    else:
        for i, level in enumerate(opts.levels):
            if time.monotonic() > deadline:
                break
            if fit is not None and (n := calc.conversations_at(level, fit.conversations)) > opts.max_conversations:
                levels.append(skipped(level, n, opts))  # known before a stack is started for it
                on_level(levels[-1], [])
                continue
            say(f"{variant.name} {level:g}x: starting a local stack ({_tunables(variant)}), about a minute")
            with stack_target(variant, state_dir, port_base, opts) as (target, words):
                opts.words = opts.words or words
                fit = one(target, i, level, fit)
    return {"variant": variant.name, "tunables": variant.tunables, "fit": fit.as_dict() if fit else None,
            "levels": levels}


# -- the whole sweep ---------------------------------------------------------------------------------


def run(opts: PressureOptions, variants: list[calc.Variant], out: Path, *, url: Target | None = None,
        state_dir: Path = Path(".turnkv/pressure"), port_base: int = 8700, stack_per: str = "level",
        on_result: Callable[[Result], None] = lambda r: None,
        on_level_start: Callable[[str, float, int], None] = lambda v, lv, n: None,
        say: Callable[[str], None] = lambda text: None) -> dict[str, Any]:
    """Sweep every variant; the report is rewritten after each level, so a run cut short keeps what it did."""
    if url is not None and len(variants) != 1:
        raise ValueError("--url runs one variant: name it (and its tunables, for the fit) with one --variant")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.jsonl").unlink(missing_ok=True)
    meta = {"levels": opts.levels, "turns": opts.turns, "think": opts.think.as_dict(),
            "workload": opts.workload.__dict__ if opts.planned is None else "file", "stagger_s": opts.stagger,
            "url": url.url if url else None, "decode_url": url.decode_url if url else None,
            "stack_per": None if url else stack_per, "arms": "reuse on, then the same turns with reuse off",
            "reuse_counted_from": "X-TurnKV-Reused-Tokens > 0 (tokens prefill pulled, as the router reports)",
            "decode_window": "counters and gauges over the reuse-on phase of each level",
            "started_at": time.time()}
    if opts.arms:
        from turnkv.plan import ratios

        meta.update(arms=list(opts.arms), arm_order="one after the other, in this order (bench.arms)",
                    exact_replies=opts.exact_replies, fit_from=opts.fit_from, ttft_target_ms=opts.ttft_target_ms,
                    think_mean_s=opts.think.mean())
        if "peer" in opts.arms and url is None:
            meta.update(target=ratios.Target().name, target_pools=ratios.pools().as_dict(),
                        local_sizes=ratios.scale(prefill_blocks=opts.prefill_blocks).as_dict())
    result: dict[str, Any] = {"meta": meta, "variants": []}
    deadline = time.monotonic() + opts.max_seconds
    for variant in variants:
        current = {"variant": variant.name, "tunables": variant.tunables, "fit": None, "levels": []}
        result["variants"].append(current)

        def on_level(level: dict[str, Any], results: list[Result], current: dict = current,
                     name: str = variant.name) -> None:
            current["levels"].append(level)
            append_results(out, name, level, results)
            write(result, out)

        done = sweep_variant(variant, opts, url=url, state_dir=state_dir, port_base=port_base, stack_per=stack_per,
                             on_result=on_result, on_level_start=on_level_start, on_level=on_level, deadline=deadline,
                             say=say)
        current["fit"] = done["fit"]
        write(result, out)
    meta["finished_at"] = time.time()
    write(result, out)
    return result


#: ``--quick`` (make demo's row): flag -> value. One stack for both levels, so 2x starts with what 1x left
#: retained: a demo row, not a measurement. retained_kv_share 0.01 keeps room for about four of its short
#: conversations (2 GiB of KV on the tiny model). Replies are agent-sized and exact (96 tokens, as the demo's): with
#: prefill's prefix caching on, a pull brings the reply and the partial block, and 32-token replies left that tail
#: under kv_recompute_threshold, so the row pulled nothing (every later turn recomputed, reason ``floor``).
QUICK = {"levels": "1,2", "turns": 3, "think": "fixed:1", "stack_per": "variant", "system_words": 100,
         "first_user_words": 200, "turn_words": 100, "max_tokens": 96, "exact_replies": True, "max_minutes": 10.0}
QUICK_VARIANT = "device only=retained_kv_share=0.01"


def quick(out: Path = Path("results/demo/pressure"), url: str | None = None, decode_url: str | None = None,
          fit: int | None = None, on_result: Callable[[Result], None] = lambda r: None, *,
          variant: str = "demo stack", levels: str | None = None, prefill_url: str | None = None,
          seed: int | None = None) -> dict[str, Any]:
    """The short row for ``make demo`` (``--quick``): 1x and 2x of what fits, 3 turns, 1 s think. Without ``url``
    it starts one stack of its own (``QUICK_VARIANT``); with the demo's running stack pass ``fit`` unless its
    share is small (at the default 0.5 the fit is dozens of conversations), or a ``variant`` naming the share the
    stack runs with (``NAME=retained_kv_share=S``: the fit is computed from it)."""
    argv = ["--quick", "--out", str(out)]
    argv += ["--url", url, "--variant", variant] if url else []
    argv += ["--decode-url", decode_url] if decode_url else []
    argv += ["--prefill-url", prefill_url] if prefill_url else []
    argv += ["--fit", str(fit)] if fit is not None else []
    argv += ["--seed", str(seed)] if seed is not None else []  # rows on one stack: words of their own
    args = parser().parse_args(argv)
    opts, variants, target = options(args)
    if levels is not None:
        opts.levels = calc.parse_levels(levels)
    return run(opts, variants, out, url=target, stack_per=args.stack_per, on_result=on_result)


#: ``--agent`` (issue 36's three-arm sweep, scaled to 2 cores): flag -> value. Agent traffic after Mooncake's
#: FAST'25 trace: ~470 new tokens and ~350-token replies per later turn, scaled by 1/4 in tokens (120 new words, 96
#: reply tokens, exact), think times p50 126 s / p90 486 s scaled by 1/24 (5.3 s / 20.3 s). Three turns per
#: conversation; levels 1x-8x the conversations the peer's prefill cache holds. Conversations arrive 0.75 s apart (32
#: over 24 s at 8x), not in one burst: 32 first turns at once need 160 blocks of decode's 80 and every arm queues
#: on decode (turnkv's most, its retained turns holding half of decode's cache: docs/benchmarks.md).
AGENT_TIME_SCALE = 1 / 24
AGENT = {"levels": "1,2,4,8", "turns": 3, "think": f"mooncake:{AGENT_TIME_SCALE}", "stack_per": "variant",
         "system_words": 150, "first_user_words": 250, "turn_words": 120, "max_tokens": 96, "exact_replies": True,
         "arms": "off,peer,on", "fit_from": "prefill", "max_minutes": 25.0, "stagger": 0.75}
#: Share of the workload's pauses turnkv's retention is sized to outlast: Mooncake's p90 (486 s) is past the 480 s
#: default TTL, so a deployment serving such traffic sets the TTL from the think-time tail, as `turnkv plan` does.
AGENT_TTL_QUANTILE = 0.95
#: expiry_margin and expiry_skew_margin at their catalog floors (the margins do not scale with time).
AGENT_EXPIRY_MARGIN_S = 5


def agent_ttl_s(think: str = AGENT["think"], quantile: float = AGENT_TTL_QUANTILE) -> int:
    """``decoder_kv_blocks_ttl`` for the agent sweep: the router keeps a conversation past the think times'
    ``quantile`` (713 s at full scale, 30 s scaled), decode ``expiry_margin`` longer."""
    pause = calc.parse_think(str(think)).quantile(quantile)
    assert pause is not None
    return math.ceil(pause) + AGENT_EXPIRY_MARGIN_S


AGENT_VARIANT = (f"as deployed=decoder_kv_blocks_ttl={agent_ttl_s()},expiry_margin={AGENT_EXPIRY_MARGIN_S},"
                 "expiry_skew_margin=1")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--levels", default="0.5,1,2,4,8", help="multiples of the conversations that fit")
    p.add_argument("--variant", action="append", default=[],
                   help='NAME=KEY=VALUE,... engine tunables of one stack (repeatable); default: "device only" '
                        '(retained_kv_share=0.02) and "host tier" (+ host_kv_budget_mib=512)')
    p.add_argument("--url", help="a router already up instead of stacks of our own (one --variant)")
    p.add_argument("--decode-url", help="with --url: decode's base URL for /metrics")
    p.add_argument("--decode-pid", type=int, help="with --url: decode's pid, for its host RSS")
    p.add_argument("--prefill-url", help="with --url: prefill's base URL, for its pulls by tier")
    p.add_argument("--fit", type=int, help="conversations that fit (default: from decode's /metrics)")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--think", default="fixed:35", help="fixed:S, exp:MEAN (seeded) or file (with --workload)")
    p.add_argument("--workload", type=Path, help="a turnkv plan workload file (lengths and think times)")
    p.add_argument("--system-words", type=int, default=200)
    p.add_argument("--first-user-words", type=int, default=300)
    p.add_argument("--turn-words", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--stagger", type=float, default=0.2, help="seconds between conversation starts")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--max-minutes", type=float, default=120.0, help="no turn starts after this")
    p.add_argument("--max-conversations", type=int, default=256, help="levels needing more are skipped")
    p.add_argument("--stack-per", choices=("level", "variant"), default="level",
                   help="a fresh stack per level (no level inherits the last one's retained turns) or per variant")
    p.add_argument("--port-base", type=int, default=8700)
    p.add_argument("--state-dir", type=Path, default=Path(".turnkv/pressure"))
    p.add_argument("--quick", action="store_true", help="make demo's short mode: levels 1,2, 3 short turns, 1 s "
                   "think, one stack (retained_kv_share 0.01) for both levels; overrides those flags")
    p.add_argument("--arms", default="", help="three-arm mode: a comma list of off,peer,on (bench.arms); the stack "
                   "gets the peer arm and the target fleet's memory ratios")
    p.add_argument("--peer-url", help="with --url: the peer arm's router")
    p.add_argument("--peer-prefill-url", help="with --url: the peer arm's prefill engine (its prompt tokens by source "
                                              "and, with --fit-from prefill, the fit)")
    p.add_argument("--fit-from", choices=("decode", "prefill"), default="decode",
                   help="1x: what decode's retention room holds, or what the peer's prefill cache holds")
    p.add_argument("--exact-replies", action="store_true", help="replies of exactly --max-tokens (min_tokens)")
    p.add_argument("--prefill-blocks", type=int, default=16,
                   help="three-arm stacks: turnkv's prefill KV blocks; every other pool at the target's ratio to it")
    p.add_argument("--ttft-target-ms", type=float, default=1000.0, help="capacity is counted at this TTFT p90")
    p.add_argument("--agent", action="store_true", help="issue 36's three-arm sweep of agent traffic (AGENT); "
                   "overrides those flags")
    p.add_argument("--out", type=Path, default=Path("results/pressure"))
    return p


def options(args: argparse.Namespace) -> tuple[PressureOptions, list[calc.Variant], Target | None]:
    """Parsed flags -> what ``run`` takes (ValueError with the flag's name when one is wrong)."""
    if args.quick:
        args.__dict__.update(QUICK)
        args.variant = args.variant or ([] if args.url else [QUICK_VARIANT])
    if args.agent:
        levels = args.levels if args.levels != parser().get_default("levels") else None
        args.__dict__.update(AGENT)
        args.levels = levels or args.levels
        args.variant = args.variant or ([] if args.url else [AGENT_VARIANT])
    think = calc.parse_think(args.think)
    planned = None
    if args.workload is not None:
        from turnkv.plan.workload import load

        planned = load(args.workload)
    elif think.kind == "file":
        raise ValueError("--think file needs --workload")
    workload = WorkloadSpec(turns=args.turns, system_words=args.system_words, first_user_words=args.first_user_words,
                            turn_words=args.turn_words, max_tokens=args.max_tokens, seed=args.seed)
    opts = PressureOptions(levels=calc.parse_levels(args.levels), turns=args.turns, think=think, workload=workload,
                   planned=planned, fit=args.fit, stagger=args.stagger, timeout=args.timeout,
                   max_seconds=args.max_minutes * 60, max_conversations=args.max_conversations,
                   arms=arms.parse_arms(args.arms) if args.arms else (), exact_replies=args.exact_replies,
                   fit_from=args.fit_from, prefill_blocks=args.prefill_blocks, ttft_target_ms=args.ttft_target_ms)
    if "peer" in opts.arms and args.url and not args.peer_url:
        raise ValueError("--arms with peer and --url: pass the peer's router with --peer-url")
    if args.fit is not None and args.fit < 1:
        raise ValueError("--fit must be at least 1")
    texts = args.variant or (["reuse on"] if args.url else list(calc.DEFAULT_VARIANTS))
    variants = [calc.parse_variant(t) for t in texts]
    if args.url and len(variants) != 1:
        raise ValueError("--url runs one variant: pass one --variant (its name, and its tunables for the fit)")
    target = Target(args.url, args.decode_url, args.decode_pid, prefill_url=args.prefill_url, peer_url=args.peer_url,
                    peer_prefill_url=args.peer_prefill_url) if args.url else None
    return opts, variants, target


def main(argv: list[str] | None = None, on_result: Callable[[Result], None] = lambda r: None,
         on_level_start: Callable[[str, float, int], None] = lambda v, lv, n: None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    try:
        opts, variants, target = options(args)
    except ValueError as exc:
        raise SystemExit(f"bench.pressure: {exc}") from None
    console = table_console()

    def level_start(name: str, level: float, n: int) -> None:
        requests = n * opts.turns * max(2, len(opts.arms))
        console.print(f"{name} {level:g}x: {n} conversations, {requests} requests at most")
        on_level_start(name, level, n)

    result = run(opts, variants, args.out, url=target, state_dir=args.state_dir, port_base=args.port_base,
                 stack_per=args.stack_per, on_result=on_result, on_level_start=level_start, say=console.print)
    if opts.arms:
        for v in result["variants"]:
            console.print(f"{v['variant']}:\n" + arms.markdown(played(v["levels"]), opts.ttft_target_ms))
    else:
        console.print(table(result))
    for v in result["variants"]:
        console.print(fit_line(v))
    console.print(f"wrote {args.out / 'summary.json'}, {args.out / 'results.jsonl'} and {args.out / 'pressure.png'}")
    return result


if __name__ == "__main__":
    main()
