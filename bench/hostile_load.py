"""Hostile load: one tenant attacks the router while another runs a normal multi-turn workload (issue 31), beside a
heavy-but-honest tenant (issue 38).

On loopback only, over fake engines (``bench.fake_engine``), bounded in time and requests. The router runs in its
own process (its RSS and CPU are sampled every 0.5 s); the attacker runs in another process, so its CPU does not
delay the bystander's measurements in this one. Phases: quiet (the bystander alone), then hostile (the same
bystander workload while the attacker sends, with several API keys: slow and parked bodies, message floods,
aborted streams, oversized fields and bad types) and a heavy-but-honest tenant (valid multi-turn streams from
many conversations at once, no think time: as much as the router gives it) from the attacker's process. Budgets
are max-min fair shares, so the honest tenant is served (cut only to its fair share when it is the heaviest) and the
bystander, the lightest, never is. Reported: the router's peak RSS against the Fargate task's 2 GiB, its CPU, the
bystander's TTFT p50/p90 in both phases and its errors, the attacker's refusals by limit, and the honest tenant's
requests/s, TTFT and refusals. ``--batch-streams N`` adds a batch tenant in the hostile phase: N long unary
generations at once, against a decode engine that runs ``--decode-seqs`` of them (the decode pool's fair queue,
``decode_fair_sequences``).

Run: ``python -m bench.hostile_load --duration 30 --out results/hostile`` (or ``turnkv bench hostile``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import psutil

from bench.engine_clock import COMPUTE_MODELS
from bench.fake_engine import FAKE_SECRET
from turnkv import router_env, wire
from turnkv.engine_settings import VLLM_MAX_NUM_SEQS_LARGE_GPU

ROOT = Path(__file__).resolve().parent.parent
TASK_MEMORY_MIB = 2048  # the router's Fargate task (infra)
BYSTANDER = "bystander-key-0001"
ATTACKERS = [f"attacker-key-{i:04d}" for i in range(4)]
HONEST = "honest-heavy-key-0001"
BATCH = "batch-long-key-0001"
#: A batch tenant's generations: as many tokens as a seeded draw in this range (unary: batch jobs seldom stream).
BATCH_TOKENS = (64, 1024)
#: The deploy config's default engine: Qwen3-32B at TP 8 on p5en, as the planner prices it.
DEFAULT_COMPUTE = next(iter(COMPUTE_MODELS))
#: The bystander's client under ``--isolate``: ahead of the fake engines on their shared core (see ``main``).
BYSTANDER_NICE = -10
#: The fake engines' niceness under --isolate: behind the bystander's client, ahead of the attacker's process (19),
#: whatever niceness the bench itself was started with (under ``nice -n 19`` the engines would otherwise share the
#: attacker's priority, and their modelled steps would wait for its CPU).
ENGINES_NICE = 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- the bystander ------------------------------------------------------------------------------------------------

async def bystander(url: str, duration: float, conversations: int, turns: int) -> dict[str, Any]:
    """Multi-turn streamed conversations for ``duration`` s: TTFT of every turn, errors by kind."""
    ttfts: list[float] = []
    errors: Counter = Counter()
    stop = time.monotonic() + duration
    headers = {"Authorization": f"Bearer {BYSTANDER}"}

    async def one(session: aiohttp.ClientSession, idx: int) -> None:
        while time.monotonic() < stop:
            messages = [{"role": "user", "content": f"conversation {idx}: " + "tell me more " * 100}]
            for _ in range(turns):
                if time.monotonic() >= stop:
                    return
                body = {"model": "tiny", "messages": messages, "max_tokens": 16, "stream": True}
                t0 = time.perf_counter()
                try:
                    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
                        if resp.status != 200:
                            errors[f"http_{resp.status}"] += 1
                            await resp.read()
                            break
                        text, first, stream_errors = await _read_stream(resp, t0)
                        if stream_errors:
                            errors["stream_error"] += stream_errors
                except (aiohttp.ClientError, TimeoutError) as exc:
                    errors[type(exc).__name__] += 1
                    break
                if first is not None:
                    ttfts.append(first)
                messages = [*messages, {"role": "assistant", "content": text}, {"role": "user", "content": "go on"}]
                await asyncio.sleep(0.05)  # an agent's think time

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        await asyncio.gather(*(one(session, i) for i in range(conversations)))
    return {"turns": len(ttfts), **ttft_percentiles(ttfts),
            "errors": dict(errors), "ttfts_ms": [_ms(t) for t in ttfts]}


def pooled(phases: list[dict[str, Any]]) -> dict[str, Any]:
    """One phase's figures over its rounds: every round's TTFTs together, errors summed."""
    ttfts = [t / 1000 for ph in phases for t in ph["ttfts_ms"]]
    errors: Counter = Counter()
    for ph in phases:
        errors.update(ph["errors"])
    return {"turns": len(ttfts), **ttft_percentiles(ttfts),
            "errors": dict(errors), "rounds": [{k: ph[k] for k in ("turns", "ttft_p50_ms", "ttft_p90_ms")}
                                               for ph in phases]}


async def _read_stream(resp: aiohttp.ClientResponse, t0: float) -> tuple[str, float | None, int]:
    """A streamed chat answer: its text, the seconds from ``t0`` to its first content piece (None: no content), and
    how many error events it carried."""
    text, first, stream_errors = "", None, 0
    async for line in resp.content:
        if line.startswith(b"data: {"):
            event = orjson.loads(line[6:])
            stream_errors += "error" in event
            for c in event.get("choices") or ():
                piece = (c.get("delta") or {}).get("content") or ""
                if piece and first is None:
                    first = time.perf_counter() - t0
                text += piece
    return text, first, stream_errors


def ttft_percentiles(ttfts: list[float]) -> dict[str, float | None]:
    """TTFT p50 and p90 in ms of ``ttfts`` (seconds)."""
    return {"ttft_p50_ms": _ms(percentile(ttfts, 0.5)), "ttft_p90_ms": _ms(percentile(ttfts, 0.9))}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


# -- the attacker (its own process) ----------------------------------------------------------------------------

async def _raw(port: int, key: str, length: int, payload: bytes, hold: float) -> str:
    """A request whose body is ``payload`` of a declared ``length`` (short: a parked body), held ``hold`` s."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return "connect_failed"
    try:
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n".encode())
        try:
            writer.write(payload)
            await asyncio.wait_for(writer.drain(), hold)
        except (TimeoutError, OSError):
            pass
        try:
            head = await asyncio.wait_for(reader.read(4096), hold)
        except (TimeoutError, OSError):
            return "no_answer"
        return _limit_of(head)
    finally:
        writer.close()


def _limit_of(answer: bytes) -> str:
    """``<status>:<limit>`` from a refusal (the error body names the router limit), or the status alone."""
    status = answer[9:12].decode(errors="replace") if answer.startswith(b"HTTP/") else "?"
    at = answer.find(b'"limit":"')
    limit = answer[at + 9: answer.find(b'"', at + 9)].decode() if at >= 0 else ""
    return f"{status}:{limit}" if limit else status


async def attack(port: int, duration: float, max_body: int) -> dict[str, int]:
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    counts: Counter = Counter()
    stop = time.monotonic() + duration
    flood = orjson.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}] * 240_000})
    parked = b"{" + b" " * (max_body - 3)  # the declared max_body bytes minus one

    async def slow_bodies(key: str) -> None:  # 8 MiB bodies minus one byte, parked
        while time.monotonic() < stop:
            results = await asyncio.gather(*(_raw(port, key, max_body, parked, 3.0) for _ in range(15)))
            counts.update(f"slow_body {r}" for r in results)

    async def floods(session: aiohttp.ClientSession, key: str) -> None:
        while time.monotonic() < stop:
            async with session.post(url, data=flood, headers=_auth(key)) as r:
                counts[f"flood {r.status}:{(await _err(r)).get('limit', '')}"] += 1

    async def aborted(session: aiohttp.ClientSession, key: str) -> None:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "abort me " * 50}], "max_tokens": 256,
                "stream": True}
        while time.monotonic() < stop:
            async with session.post(url, json=body, headers=_auth(key)) as r:
                if r.status == 200:
                    counts["aborted_stream 200"] += 1
                    await r.content.readline()
                else:
                    counts[f"aborted_stream {r.status}:{(await _err(r)).get('limit', '')}"] += 1
                r.close()  # go away mid-stream

    async def oversized(session: aiohttp.ClientSession, key: str) -> None:
        bad = [{"max_tokens": "abc"}, {"max_tokens": [1]}, {"max_tokens": "1e400"}, {"temperature": {}}]
        i = 0
        while time.monotonic() < stop:
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **bad[i % len(bad)]}
            i += 1
            async with session.post(url, json=body, headers=_auth(key)) as r:
                counts[f"bad_type {r.status}:{(await _err(r)).get('limit', '')}".rstrip(":")] += 1
            result = await _raw(port, key, max_body + 1, b"{", 2.0)
            counts[f"oversized {result}"] += 1

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        tasks = [slow_bodies(ATTACKERS[0]), slow_bodies(ATTACKERS[1]), floods(session, ATTACKERS[2]),
                 floods(session, ATTACKERS[3]), aborted(session, ATTACKERS[2]), oversized(session, ATTACKERS[3])]
        await asyncio.gather(*(_guarded(t, counts) for t in tasks))
    return dict(counts)


async def attack_and_honest(port: int, duration: float, max_body: int, honest_conversations: int,
                            attacker: bool = True, batch_streams: int = 0,
                            seed: int = 0) -> tuple[dict[str, int], dict[str, Any], dict[str, Any]]:
    """The attacker (unless ``attacker`` is false), the heavy-but-honest tenant and the batch tenant (``batch_streams``
    long generations at once; 0: none) at once, all in this process."""
    async def no_attack() -> dict[str, int]:
        return {}

    counts, heavy, long = await asyncio.gather(attack(port, duration, max_body) if attacker else no_attack(),
                                               honest(port, duration, honest_conversations),
                                               batch(port, duration, batch_streams, seed))
    return counts, heavy, long


async def batch(port: int, duration: float, streams: int, seed: int = 0) -> dict[str, Any]:
    """A batch tenant: ``streams`` unary requests at once, each generating a seeded ``BATCH_TOKENS`` draw of tokens,
    the next as soon as one ends. More of them than decode runs at once queue somewhere: in decode's first-come
    queue, ahead of everyone who comes after, or in the router's fair queue (``decode_fair_sequences``). Its
    answers per second, tokens generated and refusals by limit (a 429 retried after its Retry-After, capped at 1 s).
    Requests still running at the phase's end are dropped (the router aborts both legs)."""
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    stop = time.monotonic() + duration
    counts: Counter = Counter()
    tokens = 0
    rng = random.Random(seed)

    async def one(session: aiohttp.ClientSession, idx: int) -> None:
        nonlocal tokens
        while time.monotonic() < stop:
            n = rng.randint(*BATCH_TOKENS)
            body = {"model": "tiny", "max_tokens": n, "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"batch {idx}: " + "label this record " * 40}]}
            async with session.post(url, json=body, headers=_auth(BATCH)) as resp:
                if resp.status != 200:
                    counts[f"{resp.status}:{(await _err(resp)).get('limit', '')}"] += 1
                    await asyncio.sleep(min(1.0, float(resp.headers.get("Retry-After", "1"))))
                    continue
                usage = (await resp.json()).get("usage") or {}
            counts["200"] += 1
            tokens += int(usage.get("completion_tokens") or 0)

    if streams <= 0:
        return {}
    started = time.monotonic()
    # aiohttp's default connector opens at most 100 connections: the batch would hold no more requests in flight
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=duration + 5),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        workers = [asyncio.create_task(_guarded(one(session, i), counts)) for i in range(streams)]
        await asyncio.sleep(duration)
        for w in workers:  # the phase is over: what is still generating is dropped
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    elapsed = max(1e-3, time.monotonic() - started)
    return {"streams": streams, "served": counts["200"], "served_per_s": round(counts["200"] / elapsed, 2),
            "tokens": tokens, "tokens_per_s": round(tokens / elapsed), "answers": dict(counts), "elapsed_s": elapsed}


def _pooled_answers(rounds: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], Counter, float]:
    """A tenant's hostile phases over the rounds (those it ran in), its answers by status or limit, their seconds."""
    rounds = [r for r in rounds if r]
    answers: Counter = Counter()
    for r in rounds:
        answers.update(r["answers"])
    return rounds, answers, sum(r["elapsed_s"] for r in rounds)


def pooled_batch(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The batch tenant over the rounds: answers and tokens per second of its hostile phases."""
    rounds, answers, elapsed = _pooled_answers(rounds)
    if not rounds:
        return {}
    return {"streams": rounds[0]["streams"], "served": answers["200"],
            "served_per_s": round(answers["200"] / elapsed, 2),
            "tokens_per_s": round(sum(r["tokens"] for r in rounds) / elapsed), "answers": dict(answers)}


async def honest(port: int, duration: float, conversations: int = 16, turns: int = 6) -> dict[str, Any]:
    """A heavy but honest tenant: ``conversations`` multi-turn streamed conversations at once, no think time, each
    turn as soon as the last ended. Its requests/s, TTFT percentiles and refusals by limit (a 429 is retried after
    its Retry-After, as a polite client does, capped at 1 s)."""
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    stop = time.monotonic() + duration
    ttfts: list[float] = []
    counts: Counter = Counter()

    async def one(session: aiohttp.ClientSession, idx: int) -> None:
        while time.monotonic() < stop:
            messages = [{"role": "user", "content": f"honest {idx}: " + "summarise the build log " * 60}]
            for _ in range(turns):
                if time.monotonic() >= stop:
                    return
                body = {"model": "tiny", "messages": messages, "max_tokens": 16, "stream": True}
                t0 = time.perf_counter()
                async with session.post(url, json=body, headers=_auth(HONEST)) as resp:
                    if resp.status != 200:
                        counts[f"{resp.status}:{(await _err(resp)).get('limit', '')}"] += 1
                        await asyncio.sleep(min(1.0, float(resp.headers.get("Retry-After", "1"))))
                        continue
                    text, first, _ = await _read_stream(resp, t0)
                counts["200"] += 1
                if first is not None:
                    ttfts.append(first)
                messages = [*messages, {"role": "assistant", "content": text}, {"role": "user", "content": "next"}]

    if conversations <= 0:
        return {}
    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        await asyncio.gather(*(_guarded(one(session, i), counts) for i in range(conversations)))
    elapsed = max(1e-3, time.monotonic() - started)
    return {"conversations": conversations, "served": counts["200"], "served_per_s": round(counts["200"] / elapsed, 1),
            **ttft_percentiles(ttfts),
            "answers": dict(counts), "elapsed_s": elapsed, "ttfts_ms": [_ms(t) for t in ttfts]}


def pooled_honest(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The heavy-but-honest tenant over the rounds: served per second of its hostile phases, TTFTs together."""
    rounds, answers, elapsed = _pooled_answers(rounds)
    if not rounds:
        return {}
    ttfts = [t / 1000 for r in rounds for t in r["ttfts_ms"]]
    served = sum(r["served"] for r in rounds)
    return {"conversations": rounds[0]["conversations"], "served": served,
            "served_per_s": round(served / elapsed, 1),
            **ttft_percentiles(ttfts),
            "answers": dict(answers)}


async def _guarded(coro, counts: Counter) -> None:
    while True:
        try:
            await coro
            return
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            counts[f"client_error {type(exc).__name__}"] += 1
            return


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _err(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    raw = await resp.read()
    try:
        return orjson.loads(raw).get("error") or {}
    except (orjson.JSONDecodeError, AttributeError):
        return {}


# -- the run ------------------------------------------------------------------------------------------------------

class Sampler:
    """The router's RSS and CPU every ``every`` s."""

    def __init__(self, pid: int, every: float = 0.5) -> None:
        self.proc = psutil.Process(pid)
        self.every = every
        self.rows: list[dict[str, float]] = []
        self.phase = "start"

    async def run(self, t0: float) -> None:
        last_cpu = sum(self.proc.cpu_times()[:2])
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.every)
            cpu, now = sum(self.proc.cpu_times()[:2]), time.monotonic()
            self.rows.append({"t": round(now - t0, 2), "phase": self.phase,  # type: ignore[dict-item]
                              "rss_mib": round(self.proc.memory_info().rss / 2**20, 1),
                              "cpu_pct": round(100 * (cpu - last_cpu) / (now - last), 1)})
            last_cpu, last = cpu, now


async def wait_ready(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url + "/ready") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not become ready")


async def refused_by_limit(url: str) -> dict[str, int]:
    """The router's own count of refusals by limit (``turnkv_router_admission_refused_total``): it includes the
    refusals the attacker never read (a refused body left mostly unread is answered, then its connection closed)."""
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    out = {}
    for line in text.splitlines():
        if line.startswith("turnkv_router_admission_refused_total{"):
            limit = line.split('limit="', 1)[1].split('"', 1)[0]
            out[limit] = int(float(line.rsplit(" ", 1)[1]))
    return out


async def engine_clocks(urls: list[str]) -> Counter:
    """The fake engines' step counters (``bench.engine_clock``), summed over ``urls``: empty when they answer at
    once."""
    total: Counter = Counter()
    async with aiohttp.ClientSession() as s:
        for u in urls:
            async with s.get(u + "/stats") as r:
                stats = await r.json()
            total.update({k: v for k, v in stats.items() if k.startswith(("prefill_", "decode_"))})
    return total


def engine_load(c: Counter, seconds: float) -> dict[str, float | None]:
    """What the modelled engines did in a phase: the prefill engine's busy share and tokens per second, decode's
    mean batch and step."""
    if not c.get("decode_steps"):
        return {}
    return {"prefill_busy_share": round(c["prefill_busy_s"] / seconds, 3),
            "prefill_tokens_per_s": round(c["prefill_tokens"] / seconds),
            "decode_mean_batch": round(c["decode_batched"] / c["decode_steps"], 1),
            "decode_mean_step_ms": round(1000 * c["decode_busy_s"] / c["decode_steps"], 2)}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    p_port, d_port, r_port = free_port(), free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), wire.OFFER_SECRET_ENV: FAKE_SECRET.decode(),
           router_env.API_KEYS: json.dumps({"tenants": {"bystander": BYSTANDER, "honest": HONEST, "batch": BATCH,
                                                      **{f"attacker{i}": k for i, k in enumerate(ATTACKERS)}}})}
    py = sys.executable
    procs = [subprocess.Popen([py, "-m", "bench.fake_engine", "--port", str(p_port), "--port", str(d_port),
                               "--compute", args.compute, "--max-num-seqs", str(args.decode_seqs)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    with open(out / "router.log", "wb") as log:
        router = subprocess.Popen([py, "-m", "turnkv.cli", "router", "serve", "--prefill",
                                   f"http://127.0.0.1:{p_port}", "--decode", f"http://127.0.0.1:{d_port}", "--port",
                                   str(r_port), "--no-emf", "--set", f"decode_fair_sequences={args.decode_seqs}",
                                   *(x for kv in args.set for x in ("--set", kv))],
                                  env=env, stdout=log, stderr=subprocess.STDOUT)
    procs.append(router)
    url = f"http://127.0.0.1:{r_port}"
    if args.isolate:  # the router on its own core, as on its own task; the rest on the others
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) > 1:
            os.sched_setaffinity(router.pid, {cores[0]})
            for proc in (procs[0], None):
                os.sched_setaffinity(proc.pid if proc else 0, set(cores[1:]))
        # The bystander's client is another machine in a deployment: here it shares a core with the fake engines,
        # and its own waits for that core would be counted as the router's. It runs ahead of them (root only).
        try:
            os.setpriority(os.PRIO_PROCESS, procs[0].pid, ENGINES_NICE)
            os.setpriority(os.PRIO_PROCESS, 0, BYSTANDER_NICE)
        except PermissionError:
            print("note: not root, the bystander's client runs at the engines' priority", file=sys.stderr)
    quiet_rounds: list[dict[str, Any]] = []
    hostile_rounds: list[dict[str, Any]] = []
    honest_rounds: list[dict[str, Any]] = []
    batch_rounds: list[dict[str, Any]] = []
    attacker_counts: Counter = Counter()
    engines_by_phase: dict[str, Counter] = {"quiet": Counter(), "hostile": Counter()}
    engine_urls = [f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"]
    try:
        await wait_ready(url)
        sampler = Sampler(router.pid)
        sampling = asyncio.create_task(sampler.run(time.monotonic()))
        # Quiet and hostile phases alternate, ``rounds`` times: a drift in this machine's load (other work on the
        # cores) then falls on both phases alike, and each phase's figures pool its rounds.
        for n in range(args.rounds):
            sampler.phase = "quiet"
            before = await engine_clocks(engine_urls)
            quiet_rounds.append(await bystander(url, args.duration, args.conversations, args.turns))
            engines_by_phase["quiet"].update(await engine_clocks(engine_urls) - before)
            sampler.phase = "hostile"
            round_out = out / f"round{n}"
            round_out.mkdir(exist_ok=True)
            attacker = subprocess.Popen([py, "-m", "bench.hostile_load", "--attack", str(r_port), "--duration",
                                         str(args.duration + 1.0), "--out", str(round_out), "--honest-conversations",
                                         str(args.honest_conversations), "--batch-streams", str(args.batch_streams),
                                         "--seed", str(n), *(() if args.attacker else ("--no-attacker",))], env=env,
                                        preexec_fn=(lambda: os.setpriority(os.PRIO_PROCESS, 0, 19)) if args.isolate
                                        else None)
            procs.append(attacker)
            await asyncio.sleep(1.0)  # the attack under way
            before = await engine_clocks(engine_urls)
            hostile_rounds.append(await bystander(url, args.duration, args.conversations, args.turns))
            engines_by_phase["hostile"].update(await engine_clocks(engine_urls) - before)
            await asyncio.get_running_loop().run_in_executor(None, attacker.wait, args.duration + 60)
            attacker_counts.update(json.loads((round_out / "attacker.json").read_text()))
            honest_rounds.append(json.loads((round_out / "honest.json").read_text()))
            batch_rounds.append(json.loads((round_out / "batch.json").read_text()))
            sampler.phase = "between"
            await asyncio.sleep(2.0)  # the attacker's connections closed, its parked bodies dropped
        sampler.phase = "after"
        sampling.cancel()
        router_refusals = await refused_by_limit(url)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    quiet, hostile = pooled(quiet_rounds), pooled(hostile_rounds)
    refusals = dict(attacker_counts)
    heavy = pooled_honest(honest_rounds)
    rows = sampler.rows
    peak = max((r["rss_mib"] for r in rows), default=0.0)
    report = {
        "duration_s_per_phase": args.duration, "rounds": args.rounds, "bystander_conversations": args.conversations,
        "isolate": args.isolate, "compute": args.compute, "attacking": args.attacker,
        "router_rss_mib": {"start": rows[0]["rss_mib"] if rows else None, "peak": peak,
                           "end": rows[-1]["rss_mib"] if rows else None, "task_mib": TASK_MEMORY_MIB,
                           "peak_share_of_task": round(peak / TASK_MEMORY_MIB, 3)},
        "router_cpu_pct": {ph: percentile([r["cpu_pct"] for r in rows if r["phase"] == ph], 0.5)
                           for ph in ("quiet", "hostile")},
        "router_cpu_pct_peak": max((r["cpu_pct"] for r in rows), default=0.0),
        "bystander": {"quiet": quiet, "hostile": hostile},
        "ttft_p90_ratio": (round(hostile["ttft_p90_ms"] / quiet["ttft_p90_ms"], 2)
                           if quiet["ttft_p90_ms"] and hostile["ttft_p90_ms"] else None),
        "attacker": refusals,
        "honest_heavy": heavy,
        "batch": pooled_batch(batch_rounds), "decode_seqs": args.decode_seqs,
        "router_refusals": router_refusals,
        "engines": {ph: engine_load(c, args.duration * args.rounds) for ph, c in engines_by_phase.items()},
        "samples": rows,
    }
    (out / "hostile_load.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=1))
    print(summary_line(report))
    return report


def summary_line(report: dict[str, Any]) -> str:
    """The run in one line: the bystander quiet -> hostile, the ratio, the honest tenant served."""
    b, h, lb = report["bystander"], report["honest_heavy"] or {}, report.get("batch") or {}
    honest = (f"; honest tenant {h['served_per_s']}/s, TTFT p50/p90 {h['ttft_p50_ms']}/{h['ttft_p90_ms']} ms"
              if h else "")
    honest += (f"; batch tenant {lb['served_per_s']} answers/s, {lb['tokens_per_s']:,} tokens/s" if lb else "")
    return (f"bystander TTFT p50/p90 quiet {b['quiet']['ttft_p50_ms']}/{b['quiet']['ttft_p90_ms']} ms "
            f"({b['quiet']['turns']} turns) -> hostile {b['hostile']['ttft_p50_ms']}/{b['hostile']['ttft_p90_ms']} "
            f"ms ({b['hostile']['turns']} turns): p90 {report['ttft_p90_ratio']}x{honest}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=15, help="Seconds per phase (quiet, hostile) and round.")
    p.add_argument("--rounds", type=int, default=3, help="Quiet and hostile phases, alternated this many times.")
    p.add_argument("--conversations", type=int, default=8, help="Bystander conversations at once.")
    p.add_argument("--turns", type=int, default=6, help="Turns per bystander conversation.")
    p.add_argument("--honest-conversations", type=int, default=16,
                   help="Conversations the heavy-but-honest tenant runs at once in the hostile phase (0: none).")
    p.add_argument("--no-attacker", dest="attacker", action="store_false",
                   help="The hostile phase without the attacker (the heavy-but-honest tenant alone beside the "
                        "bystander): what the honest tenant's load costs the bystander by itself.")
    p.add_argument("--batch-streams", type=int, default=0,
                   help="Long generations a batch tenant keeps running in the hostile phase (0: none).")
    p.add_argument("--decode-seqs", type=int, default=VLLM_MAX_NUM_SEQS_LARGE_GPU,
                   help="Sequences the fake decode engine runs at once under --compute (vLLM's max_num_seqs; its "
                        "default on H100/H200); the router's decode_fair_sequences follows it unless --set.")
    p.add_argument("--set", action="append", default=[], help="Router tunable NAME=VALUE (repeatable).")
    p.add_argument("--compute", default=DEFAULT_COMPUTE,
                   help="The fake engines' time (bench.engine_clock): a modelled GPU engine's step loops, or instant "
                        "(answers at once: then the engines' only capacity is this machine's CPU).")
    p.add_argument("--isolate", action="store_true",
                   help="Model the deployment on one host: the router pinned to its own core, the engines and both "
                        "clients on the others, the attacker process at nice 19 (its own CPU is another host's).")
    p.add_argument("--out", default="results/hostile")
    p.add_argument("--attack", type=int, default=0, help=argparse.SUPPRESS)  # the attacker process: router port
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)  # the attacker process: its round
    return p


if __name__ == "__main__":
    a = parser().parse_args()
    if a.attack:
        counts, heavy, long = asyncio.run(attack_and_honest(a.attack, a.duration, 8 * 1024 * 1024,
                                                            a.honest_conversations, a.attacker, a.batch_streams,
                                                            a.seed))
        Path(a.out, "attacker.json").write_text(json.dumps(counts, indent=1, sort_keys=True))
        Path(a.out, "honest.json").write_text(json.dumps(heavy, indent=1, sort_keys=True))
        Path(a.out, "batch.json").write_text(json.dumps(long, indent=1, sort_keys=True))
    else:
        asyncio.run(main(a))
