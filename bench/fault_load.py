"""Fault and load: many multi-turn conversations through the router for minutes while engines are killed
and restarted. Reports client-visible errors, reuse outcomes (lost reuse), wrong reuse, and the router's
memory over time.

- ``--engines fake`` (default): bench.fake_engine processes, one per engine, so they can be killed. A
  fake decode writes its request id into its reply and a fake prefill checks that the history it is
  asked to pull for contains that reply: any cross-conversation or stale replay counts as wrong reuse.
- ``--engines real``: vLLM CPU engines of the local stack (2 prefill + 2 decode); wrong reuse is checked
  by replaying a sample of turns with reuse off and comparing token ids (greedy decoding).

Run: ``python -m bench.fault_load --duration 120 --conversations 64`` (ports 28300+).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import aiohttp

from bench import engine_metrics
from turnkv import params, wire

ROOT = Path(__file__).resolve().parent.parent


class EngineProc:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], port: int, log: Path) -> None:
        self.name, self.argv, self.env, self.port, self.log = name, argv, env, port, log
        self.p: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.p = subprocess.Popen(self.argv, env={**os.environ, **self.env}, stdout=out, stderr=subprocess.STDOUT,
                                      start_new_session=True, cwd=ROOT)

    def kill(self) -> None:
        if self.p and self.p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait(10)

    @property
    def alive(self) -> bool:
        return self.p is not None and self.p.poll() is None


def rss_mb(pid: int) -> float:
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss / 2**20
    except Exception:
        return float("nan")


async def wait_http(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                async with s.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} not up after {timeout} s")


async def conversation(session, url, idx, args, stats: Counter, outcomes: Counter, checks: list, stop: float,
                       lost: list):
    rng = random.Random(idx)
    conv = f"fl-{idx}-{uuid.uuid4().hex[:6]}"
    messages = [{"role": "user", "content": " ".join(rng.choice("abcdefgh") * 3 for _ in range(args.words))}]
    turn = 0
    while time.monotonic() < stop:
        body = {**request_settings(args), "messages": messages, "stream": rng.random() < 0.5,
                "conversation_id": conv, "return_token_ids": True}
        text, error, reused = "", None, 0
        try:
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                outcome = resp.headers.get(wire.REUSE_OUTCOME_HEADER, "?")
                reused = int(resp.headers.get(wire.REUSED_TOKENS_HEADER) or 0)
                if resp.status != 200:
                    error = f"http_{resp.status}"
                    await resp.read()
                elif body["stream"]:
                    async for line in resp.content:
                        if line.startswith(b": turnkv reuse_outcome="):  # headers left before the outcome
                            fields = dict(f.split("=", 1) for f in line[2:].decode().split()[1:] if "=" in f)
                            outcome, reused = fields.get("reuse_outcome", outcome), int(fields.get("reused_tokens", 0))
                        if line.startswith(b"data: {"):
                            event = json.loads(line[6:])
                            if "error" in event:
                                error = "stream_error_event"
                            for c in event.get("choices", []):
                                text += c["delta"].get("content") or ""
                else:
                    data = await resp.json()
                    text = data["choices"][0]["message"]["content"]
        except Exception as exc:
            error, outcome = type(exc).__name__, "?"
        stats["requests"] += 1
        if error:
            stats["errors"] += 1
            stats[f"error:{error}"] += 1
            messages = messages[:1]  # start the conversation over
            turn = 0
            continue
        outcomes[f"turn{'1' if turn == 0 else 'N'}:{outcome}"] += 1
        if turn:
            stats["later_turns"] += 1
            stats["later_turns_pulled"] += reused > 0  # prefill really read decode's KV (reused tokens > 0)
            if reused <= 0:
                lost.append((time.monotonic(), outcome))
        if args.engines == "real" and turn and (rng.random() < args.check_fraction
                                                or (args.check_pulled and reused > 0)):
            checks.append((list(messages), body["stream"], text, replay_body(body), reused > 0))
        messages = [*messages, {"role": "assistant", "content": text},
                    {"role": "user", "content": " ".join(rng.choice("ijklmnop") * 2 for _ in range(20))}]
        turn += 1
        if turn >= args.turns:
            messages, turn = messages[:1], 0
        await asyncio.sleep(rng.random() * args.think)


async def chaos(engines: list[EngineProc], args, log: list, stop: float) -> None:
    rng = random.Random(7)
    while time.monotonic() < stop - args.restart_after:
        await asyncio.sleep(args.kill_every)
        victim = rng.choice(engines)
        if not victim.alive:
            continue
        victim.kill()
        log.append((round(time.monotonic(), 1), "kill", victim.name))
        await asyncio.sleep(args.restart_after)
        victim.start()
        log.append((round(time.monotonic(), 1), "restart", victim.name))
        with contextlib.suppress(RuntimeError):  # one engine down at a time: wait until it is back
            await wait_http(f"http://127.0.0.1:{victim.port}/health", max(5.0, stop - time.monotonic()))
            log.append((round(time.monotonic(), 1), "healthy", victim.name))


#: A later turn within this many seconds after an engine came back counts as "after a restart".
AFTER_RESTART_S = 30.0


def phase_of(t: float, faults: list) -> str:
    """Where a lost later turn fell among the faults (pure): before any, while an engine was down (killed, not yet
    healthy), within ``AFTER_RESTART_S`` of it being back, or calm."""
    phase = "before any fault"
    for at, kind, name in faults:
        if at > t:
            break
        if kind in ("kill", "restart"):
            phase = f"{name} down"
        elif kind == "healthy":
            phase = f"{name} back" if t - at <= AFTER_RESTART_S else "calm"
    return phase


def lost_by_phase(lost: list, faults: list) -> dict[str, dict[str, int]]:
    """Later turns that pulled nothing (``(time, outcome)``, or ``(time, what, count)``), by outcome and by
    ``phase_of`` (pure)."""
    out: dict[str, Counter] = {}
    for t, outcome, *count in lost:
        out.setdefault(outcome, Counter())[phase_of(t, faults)] += int(count[0]) if count else 1
    return {k: dict(v.most_common()) for k, v in sorted(out.items())}


#: Decode's retention counters sampled during a real-engine run (connector.retention): turns it evicted to stay
#: under retained_kv_share, and turns it declined to retain (no room: their next turns miss).
RETENTION_COUNTERS = {"evicted": "vllm:turnkv_retention_evicted_total",
                      "refused": "vllm:turnkv_retention_refused_total"}


def counter_increase(last: dict, key: tuple, value: float) -> float:
    """How much a Prometheus counter rose since its last sample (pure): a restarted engine starts from 0."""
    prev = last.get(key, 0.0)
    last[key] = value
    return value - prev if value >= prev else value


#: Prefill's refusals of offers past their read deadline (at a scheduler look or right before the READ).
LATE_COUNTERS = {"late": "vllm:turnkv_offers_late_total"}


def retention_samples(text: str, counters: dict[str, str] = RETENTION_COUNTERS) -> dict[str, float]:
    """The retention counters (or other ``counters``) of one engine's /metrics text."""
    return engine_metrics.totals(text, counters)


async def sample_retention(engines: list[EngineProc], found: list, stop: float, every: float = 2.0,
                           role: str = "decode", counters: dict[str, str] | None = None) -> None:
    """Real engines: the ``role`` engines' counters (decode's retention counters unless told) every ``every`` s, as
    (time, kind, increase)."""
    last: dict = {}
    decode = [e for e in engines if e.name.startswith(role)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s:
        while time.monotonic() < stop:
            for e in decode:
                text = await engine_metrics.fetch(s, f"http://127.0.0.1:{e.port}")
                if text is None:
                    continue  # down: its counters start over when it is back
                counts = retention_samples(text, counters or RETENTION_COUNTERS)
                for kind, value in counts.items():
                    if (rise := counter_increase(last, (e.name, kind), value)) > 0:
                        found.append((time.monotonic(), f"{kind} on {e.name}", rise))
            await asyncio.sleep(every)


def request_settings(args) -> dict:
    """What every load request asks for besides its messages (reply length, sampling): replays ask the same."""
    return {"model": "tiny", "max_tokens": args.max_tokens, "temperature": 0}


def replay_body(sent: dict) -> dict:
    """The reuse-off replay of a load request: its own messages and settings, unary, without the load's extras
    (a replay with another reply length would count every longer answer as wrong reuse)."""
    return {k: v for k, v in sent.items() if k not in ("stream", "conversation_id", "return_token_ids")} | {
        "messages": list(sent["messages"])}


async def verify(url: str, checks: list, limit: int, budget_s: float = 180.0) -> Counter:
    """Real engines: replay sampled turns with reuse off; a reuse that changed the answer is wrong reuse.
    Bounded by ``budget_s`` in all (a broken stack must not hold the report back for an hour)."""
    result: Counter = Counter()
    deadline = time.monotonic() + budget_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        # Turns that pulled decode's KV first: a wrong reuse can only be one of them.
        for _messages, _stream, text, body, pulled in sorted(checks, key=lambda c: not c[4])[:limit]:
            if time.monotonic() > deadline:
                result["not_replayed"] += 1
                continue
            try:
                async with s.post(url + "/v1/chat/completions", json=body,
                                  headers={wire.REUSE_HEADER: wire.REUSE_OFF}) as r:
                    if r.status != 200:
                        result["unverifiable"] += 1
                        continue
                    same = (await r.json())["choices"][0]["message"]["content"] == text
            except (TimeoutError, aiohttp.ClientError):
                result["unverifiable"] += 1
                continue
            result["same" if same else "wrong_reuse"] += 1
            result["pulled_turns_checked"] += pulled
    return result


async def main(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    base = args.port_base
    env = {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    engines: list[EngineProc] = []
    supervisor = None
    mode_args: list[str] = []
    router_env: dict[str, str] = {}  # the engines' offer secret: the router clears the offers it replays
    if args.engines == "fake":
        from bench.fake_engine import FAKE_SECRET

        router_env[wire.OFFER_SECRET_ENV] = FAKE_SECRET.decode()
        if args.mode != "pull":
            raise SystemExit("--mode push needs --engines real (the fake engine speaks the pull protocol)")
        for role, off in (("prefill", 100), ("decode", 200)):
            for i in range(2):
                port = base + off + i
                engines.append(EngineProc(f"{role}-{i}", [py, "-m", "bench.fake_engine", "--port", str(port)], env,
                                          port, out / f"{role}-{i}.log"))
        for e in engines:
            e.start()
        prefill = [f"http://127.0.0.1:{e.port}" for e in engines if e.name.startswith("prefill")]
        decode = [f"http://127.0.0.1:{e.port}" for e in engines if e.name.startswith("decode")]
        for e in engines:
            await wait_http(f"http://127.0.0.1:{e.port}/health", 30)
    else:
        from turnkv.engine_args import Mode
        from turnkv.local.stack import StackConfig, Supervisor, plan

        config = StackConfig(state_dir=out / "stack", router_port=base + 50, prefill_port=base + 100,
                             prefill_prefix_caching=False,  # the seeds' setting: the A/B measures reuse
                             decode_port=base + 200, side_channel_base=25650, prefill_engines=2, decode_engines=2,
                             kv_cache_gib=1, tunables={"decoder_kv_blocks_ttl": args.engine_ttl,
                                                         "conversation_ttl": args.engine_ttl - 15,
                                                         **dict(engine_set(v) for v in args.engine_set)},
                             mode=Mode(args.mode))
        supervisor = Supervisor(config.state_dir)
        supervisor.down()
        state = supervisor.up(config)
        specs = {p.name: p for p in plan(config)}
        for name, comp in state["components"].items():
            if comp["kind"] == "engine":
                proc = EngineProc(name, specs[name].argv, specs[name].env, comp["port"], specs[name].log)
                proc.p = type("P", (), {"pid": comp["pgid"], "poll": lambda self: None,
                                        "wait": lambda self, t=None: None})()
                engines.append(proc)
        # The stack's own router flags name the engines (push: prefill's engine id and side channel too).
        planned = specs["router"].argv
        prefill = [planned[i + 1] for i, a in enumerate(planned) if a == "--prefill"]
        decode = [planned[i + 1] for i, a in enumerate(planned) if a == "--decode"]
        mode_args = ["--mode", args.mode]
        router_env.update(specs["router"].env)
    router_port = base
    router = subprocess.Popen([py, "-m", "turnkv.cli", "router", "serve", "--port", str(router_port),
                               *[a for u in prefill for a in ("--prefill", u)],
                               *[a for u in decode for a in ("--decode", u)],
                               "--set", "health_interval=1", "--set", "first_token_timeout=30",
                               "--set", "prefill_timeout=30", "--no-emf", *mode_args,
                               *[a for v in args.router_set for a in ("--set", v)]],
                              env={**os.environ, **env, **router_env}, stdout=open(out / "router.log", "wb"),  # noqa: SIM115
                              stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    url = f"http://127.0.0.1:{router_port}"
    stats: Counter = Counter()
    outcomes: Counter = Counter()
    checks: list = []
    lost: list = []
    retention: list = []
    late: list = []
    events: list = []
    memory: list[float] = []
    try:
        await wait_http(url + "/ready", 60)
        t0 = time.monotonic()
        stop = t0 + args.duration

        async def sample_memory() -> None:
            while time.monotonic() < stop:
                memory.append(round(rss_mb(router.pid), 1))
                await asyncio.sleep(5)

        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
            await asyncio.gather(
                *(conversation(session, url, i, args, stats, outcomes, checks, stop, lost)
                  for i in range(args.conversations)),
                chaos(engines, args, events, stop), sample_memory(),
                *([sample_retention(engines, retention, stop),
                   sample_retention(engines, late, stop, role="prefill", counters=LATE_COUNTERS)]
                  if args.engines == "real" else []))
        verified = await verify(url, checks, args.check_limit) if checks else Counter()
        elapsed = time.monotonic() - t0
        fake_stats = {}
        if args.engines == "fake":
            async with aiohttp.ClientSession() as s:
                for e in engines:
                    with contextlib.suppress(Exception):
                        async with s.get(f"http://127.0.0.1:{e.port}/stats") as r:
                            fake_stats[e.name] = await r.json()
        report = {
            "engines": args.engines, "mode": args.mode, "duration_s": round(elapsed, 1),
            "engine_ttl_s": args.engine_ttl if args.engines == "real" else None,
            "conversations": args.conversations,
            "requests": stats["requests"], "requests_per_s": round(stats["requests"] / elapsed, 1),
            "client_errors": stats["errors"], "errors_by_kind": {k[6:]: v for k, v in stats.items()
                                                                 if k.startswith("error:")},
            "outcomes": dict(outcomes),
            "later_turns": stats["later_turns"], "later_turns_pulled": stats["later_turns_pulled"],
            "not_pulled_by_phase": lost_by_phase(lost, events),
            "decode_retention_by_phase": lost_by_phase(retention, events),
            "prefill_late_offers_by_phase": lost_by_phase(late, events),
            "wrong_reuse": (sum(s.get("wrong_reuse", 0) for s in fake_stats.values()) if args.engines == "fake"
                            else verified.get("wrong_reuse", 0)),
            "verified": dict(verified), "faults": events, "router_rss_mb": memory,
            "engine_stats_since_last_restart": fake_stats,
        }
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(router.pid, signal.SIGTERM)
        router.wait(10)
        for e in engines:  # restarted engines are ours, not the supervisor's
            e.kill()
        if supervisor is not None:
            supervisor.down()
    (out / "fault_load.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "engine_stats_since_last_restart"}, indent=2))
    return report


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engines", choices=("fake", "real"), default="fake")
    p.add_argument("--mode", choices=("pull", "push"), default="pull",
                   help="KV transfer mode of the real engines (push: prefill WRITEs into decode, bi-directional)")
    p.add_argument("--duration", type=float, default=120)
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--turns", type=int, default=8, help="turns before a conversation starts over")
    p.add_argument("--words", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--think", type=float, default=0.2, help="max seconds between turns")
    p.add_argument("--kill-every", type=float, default=10)
    p.add_argument("--restart-after", type=float, default=5)
    p.add_argument("--check-fraction", type=float, default=0.1, help="real engines: turns re-run with reuse off")
    p.add_argument("--check-limit", type=int, default=50)
    p.add_argument("--check-pulled", action="store_true",
                   help="real engines: also re-run every later turn that pulled decode's KV (checked first)")
    p.add_argument("--engine-ttl", type=int, default=60,
                   help="real engines: decoder_kv_blocks_ttl in s (the catalog's default is "
                        f"{params.get('decoder_kv_blocks_ttl').default}; 60 keeps retained "
                        "blocks from filling the 1 GiB caches in short runs)")
    p.add_argument("--port-base", type=int, default=28300)
    p.add_argument("--out", default="results/fault-load")
    p.add_argument("--engine-set", action="append", default=[], metavar="NAME=VALUE",
                   help="real engines: an engine tunable (repeatable), e.g. retained_kv_share=0.02 for retention "
                        "pressure")
    p.add_argument("--router-set", action="append", default=[], metavar="NAME=VALUE",
                   help="a router tunable (repeatable), e.g. conversation_ttl=20 to see the store's memory settle")
    return p


def engine_set(text: str) -> tuple[str, float]:
    """``NAME=VALUE`` of ``--engine-set`` (the stack validates it against the catalog)."""
    name, sep, value = text.partition("=")
    if not sep:
        raise SystemExit(f"--engine-set {text!r}: expected NAME=VALUE")
    return name.strip(), float(value)


if __name__ == "__main__":
    asyncio.run(main(parser().parse_args()))
