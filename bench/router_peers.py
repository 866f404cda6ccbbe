"""The router side by side with its peers, on the project's fake engine (answers instantly), in one run.

Targets (each over the same fake prefill + decode engines, loopback only):
- ``direct``: the client talks to the decode engine itself (one leg, no router): the floor;
- ``turnkv``: ``turnkv router serve`` (this repository, default settings, in-memory store);
- ``vllm-router``: the Rust router from PyPI (``vllm-router==0.1.17 --vllm-pd-disaggregation``), default policy
  (``cache_aware``: before each request it asks both engines to render the chat and tokenize it);
- ``vllm-router-rr``: the same with ``--policy round_robin``, which sends only the two legs, as turnkv does;
- ``fastapi``: a plain FastAPI + httpx proxy like vLLM's example (``bench/fastapi_proxy.py``);
- ``turnkv-valkey``: turnkv as one replica of a scaled-out deployment, its conversation state in a Valkey/Redis
  server (``redis-server`` on loopback, started here), as the CDK stack runs more than one replica;
- ``turnkv-2x``: two such replicas on that one server, the client alternating between them as a load balancer
  does (CPU per request summed over both: what scaling out costs per request, not the cores it needs).

For each, streamed chat requests at concurrency 1, 32 and 128 (bounded request counts) and each reply length
(``--reply-tokens``, 16 by default): requests/s, TTFT p50/p99 (client side, to the first content event), the
router's CPU per request (its process tree's user + system time over the run) and its RSS. With several reply
lengths, a least-squares line through CPU per request against reply length splits the router's cost into a fixed
cost per request (intercept) and a cost per relayed event (slope). ``--event-writes`` makes the fake engine write
one event at a time, as a real engine does, instead of a whole stream in one write. ``--rate`` sends an open
loop instead: every target is offered the same requests/s (a closed loop sends a faster target more, and a busier
router batches more events per wake-up, so its CPU per request falls; at equal load the two compare fairly). All
targets run at
once and are measured in interleaved rounds (median requests/s; TTFT percentiles over all rounds), so
that a busy shared machine disturbs every target alike. Every turnkv request
carries a fresh conversation id, so the store is written on every request (the real hot path).
``--router-cpus`` pins every router (each thread of it) to the CPUs named and the client and fake engines to the
rest: a router then has what a 1-vCPU task gives it, vllm-router's thread pool included, and does not compete with
the load it is measured under. ``--memory`` also measures the RSS of a MemoryStore holding N conversations.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import orjson

from bench.fake_engine import FAKE_SECRET
from turnkv import wire

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [{"role": "system", "content": "You are a careful agent. " * 20},
          {"role": "user", "content": "Summarise the tool output below. " + "data " * 150}]


@dataclass
class Row:
    target: str
    concurrency: int
    requests: int
    errors: int
    rps: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    rss_mb: float | None = None
    extra: dict = field(default_factory=dict)
    reply_tokens: int = 16
    cpu_ms_per_request: float | None = None
    offered_rps: float | None = None  # open loop (--rate): the requests/s every target was sent


def _wait_http(url: str, timeout: float = 30) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception), urllib.request.urlopen(url, timeout=1) as r:
            if r.status == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def cpu_split(text: str, available: set[int]) -> tuple[set[int], set[int]]:
    """``--router-cpus``: the CPUs the routers run on, and the rest (client, fake engines, Valkey). Every CPU named
    must be one this process may use, and at least one must be left for the rest."""
    try:
        chosen = {int(x) for x in text.split(",") if x.strip()}
    except ValueError:
        raise ValueError(f"{text!r}: expected CPU numbers, comma-separated (e.g. 1)") from None
    if not chosen or not chosen <= available:
        raise ValueError(f"{text!r}: choose among the CPUs this process may use: "
                         f"{','.join(map(str, sorted(available)))}")
    rest = available - chosen
    if not rest:
        raise ValueError(f"{text!r} leaves no CPU for the client and the fake engines: name fewer")
    return chosen, rest


def _router_cpus(text: str) -> tuple[set[int], set[int]]:
    try:
        return cpu_split(text, os.sched_getaffinity(0))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class Proc:
    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None, log: Path | None = None,
                 cwd: Path = ROOT, cpus: set[int] | None = None):
        self.name = name
        out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115
        # Set before exec, so every thread the program starts inherits it (a Rust runtime sizes its pool by it).
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        self.p = subprocess.Popen(argv, env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True, cwd=cwd, preexec_fn=pin)

    def rss_mb(self) -> float | None:
        try:
            import psutil

            proc = psutil.Process(self.p.pid)
            return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 2**20
        except Exception:
            return None

    def cpu_s(self) -> tuple[float, float] | None:
        """User and system CPU seconds of the process and its children so far."""
        try:
            import psutil

            procs = [psutil.Process(self.p.pid)]
            procs += procs[0].children(recursive=True)
            times = [p.cpu_times() for p in procs]
            return sum(t.user for t in times), sum(t.system for t in times)
        except Exception:
            return None

    def stop(self) -> None:
        if self.p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait(5)


class Group:
    """Several processes measured as one target (the replicas of ``turnkv-2x``)."""

    def __init__(self, procs: list[Proc]) -> None:
        self.procs = procs

    def rss_mb(self) -> float | None:
        values = [p.rss_mb() for p in self.procs]
        return None if None in values else sum(v for v in values if v is not None)

    def cpu_s(self) -> tuple[float, float] | None:
        values = [p.cpu_s() for p in self.procs]
        if any(v is None for v in values):
            return None
        return sum(v[0] for v in values if v), sum(v[1] for v in values if v)

    def stop(self) -> None:
        for p in self.procs:
            p.stop()


def _wait_tcp(port: int, timeout: float = 30) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port}")


async def _one(session: aiohttp.ClientSession, url: str, ttfts: list[float], conv: bool, tokens: int) -> bool:
    body = {"model": "tiny", "messages": PROMPT, "max_tokens": tokens, "stream": True, "temperature": 0}
    if conv:
        body["conversation_id"] = uuid.uuid4().hex
    t0 = time.perf_counter()
    async with session.post(url, data=orjson.dumps(body), headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            await resp.read()
            return False
        first = True
        async for line in resp.content:
            if first and line.startswith(b"data: ") and b'"content"' in line:
                ttfts.append(time.perf_counter() - t0)
                first = False
        return not first


def arrivals(total: int, rate: float) -> list[float]:
    """Open loop: when each of ``total`` requests is sent, in seconds from the start, at a constant ``rate``
    per second (every target is offered the same load, whatever its speed)."""
    if rate <= 0:
        raise ValueError(f"rate {rate}: expected requests per second above 0")
    return [i / rate for i in range(total)]


async def load(url: str | list[str], concurrency: int, total: int, conv: bool,
               tokens: int = 16, rate: float | None = None) -> tuple[int, int, float, list[float]]:
    """``total`` streamed requests; several URLs take turns (a load balancer's round robin over replicas).

    Closed loop (``rate`` None): ``concurrency`` workers, each sending its next request when the last ended, so a
    faster target is offered more load. Open loop (``rate``): requests leave at a constant rate, at most
    ``concurrency`` in flight (one that finds no slot waits, and the achieved rate falls below the offered one);
    the elapsed time runs to the last answer."""
    urls = [url] if isinstance(url, str) else url
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    ttfts: list[float] = []
    errors = 0
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        async def send(i: int) -> None:
            nonlocal errors
            try:
                ok = await _one(session, urls[i % len(urls)], ttfts, conv, tokens)
            except Exception:
                ok = False
            errors += not ok

        t0 = time.perf_counter()
        if rate is None:
            todo = iter(range(total))

            async def worker() -> None:
                for i in todo:
                    await send(i)
            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:
            slots = asyncio.Semaphore(concurrency)

            async def paced(i: int) -> None:
                try:
                    await send(i)
                finally:
                    slots.release()
            tasks = []
            for i, at in enumerate(arrivals(total, rate)):
                await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
                await slots.acquire()
                tasks.append(asyncio.create_task(paced(i)))
            await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
    return total, errors, elapsed, ttfts


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1000


def measure_store_memory(n: int, blocks: int = 32) -> dict:
    """RSS of a MemoryStore holding n conversations (run in a fresh interpreter for a clean baseline)."""
    code = f"""
import asyncio, gc, os, time, psutil
from router.guard import History
from router.state import Entry
from router.state.memory import MemoryStore
p = psutil.Process()
gc.collect(); before = p.memory_info().rss
store = MemoryStore({n})
from turnkv import wire
params = lambda i: {{wire.DO_REMOTE_PREFILL: False, wire.DO_REMOTE_DECODE: True,
          wire.REMOTE_BLOCK_IDS: [list(range(i, i + {blocks}))], wire.REMOTE_ENGINE_ID: "decode-3",
          wire.REMOTE_REQUEST_ID: "chatcmpl-%032x" % i, wire.REMOTE_HOST: "10.0.12.34",
          wire.REMOTE_PORT: 5600, wire.TP_SIZE: 8, wire.DCP_SIZE: 1, wire.PP_SIZE: 1,
          wire.REMOTE_NUM_TOKENS: 4000 + i % 1000, wire.REMOTE_BLOCKS_EXPIRY_TIME: 1.8e9 + i,
          wire.TRANSFER_MODE: "pull"}}
async def fill():
    for i in range({n}):
        await store.put("%064x" % i, Entry(params(i), History("chat", "%040x" % 7, "%040x" % i, 12), 1.8e9, "decode-3"))
t = time.perf_counter(); asyncio.run(fill()); fill_s = time.perf_counter() - t
gc.collect(); after = p.memory_info().rss
async def take():
    t = time.perf_counter()
    for i in range(0, {n}, 97):
        assert await store.take("%064x" % i) is not None
    return (time.perf_counter() - t) / len(range(0, {n}, 97))
take_s = asyncio.run(take())
print(len(store), before, after, fill_s, take_s)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True).stdout.split()
    held, before, after, fill_s, take_s = int(out[0]), int(out[1]), int(out[2]), float(out[3]), float(out[4])
    return {"conversations": n, "block_ids_per_entry": blocks, "rss_mb": round(after / 2**20, 1),
            "added_mb": round((after - before) / 2**20, 1), "bytes_per_conversation": round((after - before) / n),
            "put_us": round(fill_s / n * 1e6, 2), "take_us": round(take_s * 1e6, 2), "held": held}


def _level(args: argparse.Namespace, chosen: list[str], targets: dict, procs: dict[str, Proc | Group], c: int,
           tokens: int, rate: float | None = None, engines: Proc | None = None) -> list[Row]:
    """One concurrency level, reply length and offered rate (None: closed loop): interleaved rounds over every
    target, one row per target. ``engines``: the fake engines, whose CPU per request says what each target costs
    the engines it talks to (connections, writes)."""
    total = args.requests_c1 if c == 1 else args.requests
    results: dict[str, list[tuple[int, int, float, list[float]]]] = {n: [] for n in chosen}
    cpu: dict[str, float] = dict.fromkeys(chosen, 0.0)
    kernel: dict[str, float] = dict.fromkeys(chosen, 0.0)  # the system-time part of cpu
    engine_cpu: dict[str, float] = dict.fromkeys(chosen, 0.0)
    for r in range(args.rounds):
        order = chosen[r % len(chosen):] + chosen[:r % len(chosen)]
        for name in order:
            endpoint = [url + "/v1/chat/completions" for url in targets[name][1]]
            proc = procs.get(name)
            before = proc.cpu_s() if proc else None
            engines_before = engines.cpu_s() if engines else None
            results[name].append(asyncio.run(load(endpoint, c, total, name.startswith("turnkv"), tokens, rate)))
            after = proc.cpu_s() if proc else None
            engines_after = engines.cpu_s() if engines else None
            if engines_before is not None and engines_after is not None:
                engine_cpu[name] += sum(engines_after) - sum(engines_before)
            if before is not None and after is not None:
                cpu[name] += (after[0] - before[0]) + (after[1] - before[1])
                kernel[name] += after[1] - before[1]
    rows = []
    for name in chosen:
        runs = results[name]
        rps = sorted(n / elapsed for n, _, elapsed, _ in runs)[len(runs) // 2]
        ttfts = [t for *_, ts in runs for t in ts]
        proc = procs.get(name)
        rss = proc.rss_mb() if proc else None
        done = sum(n for n, *_ in runs)
        row = Row(name, c, done, sum(e for _, e, *_ in runs), round(rps, 1),
                  round(pct(ttfts, 0.5), 3), round(pct(ttfts, 0.99), 3),
                  round(rss, 1) if rss is not None else None,
                  {"rps_per_round": [round(n / el, 1) for n, _, el, _ in runs],
                   "cpu_system_share": round(kernel[name] / cpu[name], 3) if cpu[name] else None,
                   "engine_cpu_ms_per_request": round(engine_cpu[name] / done * 1000, 3) if engines and done
                   else None}, tokens,
                  round(cpu[name] / done * 1000, 3) if proc and done else None, rate)
        rows.append(row)
        if rate is not None and row.rps < 0.97 * rate:
            print(f"{name}: {row.rps:.0f} of {rate:.0f} requests/s offered: saturated, so its CPU per request is "
                  "not comparable at this rate (lower --rate)", flush=True)
        offered = "" if rate is None else f"offered {rate:.0f} "
        print(f"{name:15s} c={c:<4d} tokens={tokens:<5d} {offered}{row.rps:8.1f} req/s  "
              f"TTFT p50 {row.ttft_p50_ms:7.2f} ms  "
              f"p99 {row.ttft_p99_ms:7.2f} ms  CPU {row.cpu_ms_per_request} ms/req "
              f"({row.extra['cpu_system_share']} in the kernel), engines {row.extra['engine_cpu_ms_per_request']} "
              f"ms/req  errors {row.errors}  "
              f"rss {row.rss_mb} MB  rounds {row.extra['rps_per_round']}", flush=True)
    return rows


def cost_split(rows: list[Row]) -> dict[tuple[str, int, float | None], tuple[float, float]]:
    """Per target, concurrency and offered rate, the least-squares line of CPU per request against reply length:
    (fixed ms per request, us per relayed event). Needs two reply lengths or more."""
    out = {}
    for key in {(r.target, r.concurrency, r.offered_rps) for r in rows if r.cpu_ms_per_request is not None}:
        pts = [(r.reply_tokens, r.cpu_ms_per_request) for r in rows
               if (r.target, r.concurrency, r.offered_rps) == key and r.cpu_ms_per_request is not None]
        if len({x for x, _ in pts}) < 2:
            continue
        mx = sum(x for x, _ in pts) / len(pts)
        my = sum(y for _, y in pts) / len(pts)
        slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        out[key] = (round(my - slope * mx, 3), round(slope * 1000, 2))
    return out


def run(args: argparse.Namespace) -> dict:
    base = args.port_base
    p_port, d_port = base + 100, base + 200
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    # The fake engines' offer secret, as a deployment's router holds the engines' (it clears what it replays).
    env = {"PYTHONPATH": str(ROOT), wire.OFFER_SECRET_ENV: FAKE_SECRET.decode()}
    turnkv = [py, "-m", "turnkv.cli", "router", "serve", "--prefill", f"http://127.0.0.1:{p_port}", "--decode",
              f"http://127.0.0.1:{d_port}", *(["--no-emf"] if args.no_emf else []),
              *(x for kv in args.set for x in ("--set", kv))]
    # vllm-router's default policy (cache_aware) asks both engines to render and tokenize every request before it
    # is sent; ``vllm-router-rr`` (round_robin) sends the two legs only, as turnkv does
    vllm_router = [shutil.which("vllm-router") or str(Path(py).with_name("vllm-router")), "--vllm-pd-disaggregation",
                   "--prefill", f"http://127.0.0.1:{p_port}", "--decode", f"http://127.0.0.1:{d_port}",
                   "--host", "127.0.0.1", "--log-level", "warning"]
    valkey_port = base + 9
    valkey = ["--store", f"redis://127.0.0.1:{valkey_port}"]
    # name -> (the argv of each process, the URL of each): several URLs are replicas the client alternates over
    targets: dict[str, tuple[list[list[str]], list[str]]] = {
        "direct": ([], [f"http://127.0.0.1:{d_port}"]),
        "turnkv": ([[*turnkv, "--port", str(base)]], [f"http://127.0.0.1:{base}"]),
        "vllm-router": ([[*vllm_router, "--port", str(base + 1), "--prometheus-port", str(base + 10)]],
                        [f"http://127.0.0.1:{base + 1}"]),
        "vllm-router-rr": ([[*vllm_router, "--port", str(base + 7), "--prometheus-port", str(base + 11), "--policy",
                             "round_robin"]], [f"http://127.0.0.1:{base + 7}"]),
        "fastapi": ([[py, "-m", "uvicorn", "bench.fastapi_proxy:app", "--host", "127.0.0.1", "--port", str(base + 2),
                      "--log-level", "warning", "--no-access-log"]], [f"http://127.0.0.1:{base + 2}"]),
        "turnkv-valkey": ([[*turnkv, "--port", str(base + 4), *valkey]], [f"http://127.0.0.1:{base + 4}"]),
        "turnkv-2x": ([[*turnkv, "--port", str(base + 5), *valkey], [*turnkv, "--port", str(base + 6), *valkey]],
                      [f"http://127.0.0.1:{base + 5}", f"http://127.0.0.1:{base + 6}"]),
    }
    router_cpus = None
    if args.router_cpus:  # routers on their own CPUs, as on a deployment's task; the rest here and in the engines
        router_cpus, others = args.router_cpus
        os.sched_setaffinity(0, others)
    chosen = [t for t in args.targets.split(",") if t]
    unknown = [t for t in chosen if t not in targets]
    if unknown:
        raise SystemExit(f"unknown target(s) {unknown}; known: {sorted(targets)}")
    baseline = Path(args.baseline).resolve() if args.baseline else None
    if baseline:  # another checkout's router, measured in the same interleaved rounds (before/after a change)
        targets["turnkv-baseline"] = ([[*turnkv, "--port", str(base + 3)]], [f"http://127.0.0.1:{base + 3}"])
        chosen.append("turnkv-baseline")
    engines = Proc("fake-engines", [py, "-m", "bench.fake_engine", "--port", str(p_port), "--port", str(d_port),
                                    *(["--event-writes"] if args.event_writes else [])],
                   env, out / "fake_engines.log")
    procs: dict[str, Proc | Group] = {}
    helpers: list[Proc] = []
    rows: list[Row] = []
    try:
        if any("--store" in argv for name in chosen for argv in targets[name][0]):
            if not shutil.which("redis-server"):
                raise SystemExit("the valkey targets need redis-server (make tools installs it)")
            helpers.append(Proc("valkey", ["redis-server", "--port", str(valkey_port), "--bind", "127.0.0.1",
                                           "--save", "", "--appendonly", "no"], log=out / "valkey.log"))
            _wait_tcp(valkey_port)
        _wait_http(f"http://127.0.0.1:{d_port}/health")
        for name in chosen:  # every target runs at once (idle when not measured): rounds interleave them
            own = {"PYTHONPATH": str(baseline)} if name == "turnkv-baseline" and baseline else {}
            group = [Proc(f"{name}-{i}", argv, {**env, "PREFILL": f"http://127.0.0.1:{p_port}",
                                                "DECODE": f"http://127.0.0.1:{d_port}", **own},
                          out / f"{name}{'-' + str(i) if i else ''}.log", cwd=baseline if own and baseline else ROOT,
                          cpus=router_cpus)
                     for i, argv in enumerate(targets[name][0])]
            if group:
                procs[name] = group[0] if len(group) == 1 else Group(group)
        for name in chosen:
            for url in targets[name][1]:
                _wait_http(url + "/health")
            asyncio.run(load([url + "/v1/chat/completions" for url in targets[name][1]], 32, args.warmup,
                             name.startswith("turnkv")))
        for tokens in (int(x) for x in args.reply_tokens.split(",")):
            for c in (int(x) for x in args.concurrency.split(",")):
                for rate in args.rate or [None]:
                    rows.extend(_level(args, chosen, targets, procs, c, tokens, rate, engines))
    finally:
        for proc in procs.values():
            proc.stop()
        for helper in helpers:
            helper.stop()
        engines.stop()
    summary: dict = {"rows": [asdict(r) for r in rows], "cpus": os.cpu_count(), "rounds": args.rounds,
                     "router_cpus": sorted(router_cpus) if router_cpus else None,
                     "requests": args.requests, "requests_c1": args.requests_c1, "event_writes": args.event_writes,
                     "cost_split": [{"target": t, "concurrency": c, "offered_rps": o, "fixed_ms_per_request": f,
                                     "us_per_event": e}
                                    for (t, c, o), (f, e) in sorted(cost_split(rows).items(), key=_split_order)]}
    if args.memory:
        summary["memory"] = measure_store_memory(args.memory)
        print(f"MemoryStore with {args.memory:,} conversations: {summary['memory']}", flush=True)
    (out / "peers.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    (out / "peers.md").write_text(markdown(summary))
    print(markdown(summary))
    return summary


def _split_order(item: tuple[tuple[str, int, float | None], tuple[float, float]]) -> tuple[str, int, float]:
    (target, concurrency, rate), _ = item
    return target, concurrency, rate or 0.0


def _offered(rate: float | None) -> str:
    return "closed loop" if rate is None else f"{rate:.0f}"


def markdown(summary: dict) -> str:
    rows = [Row(**r) for r in summary["rows"]]
    direct = {(r.concurrency, r.reply_tokens, r.offered_rps): r for r in rows if r.target == "direct"}
    lines = ["| target | concurrency | offered requests/s | reply tokens | requests/s | TTFT p50 ms | TTFT p99 ms | "
             "added TTFT p50 ms | CPU ms/request | of it in the kernel | engines' CPU ms/request | errors | RSS MB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        base = direct.get((r.concurrency, r.reply_tokens, r.offered_rps))
        added = r.ttft_p50_ms - base.ttft_p50_ms if base else float("nan")
        cpu = f"{r.cpu_ms_per_request:.3f}" if r.cpu_ms_per_request is not None else "-"
        kernel, engines = r.extra.get("cpu_system_share"), r.extra.get("engine_cpu_ms_per_request")
        lines.append(f"| {r.target} | {r.concurrency} | {_offered(r.offered_rps)} | {r.reply_tokens} | {r.rps:.0f} | "
                     f"{r.ttft_p50_ms:.2f} | {r.ttft_p99_ms:.2f} | {added:.2f} | {cpu} | "
                     f"{'-' if kernel is None else f'{kernel:.0%}'} | {'-' if engines is None else f'{engines:.3f}'} | "
                     f"{r.errors} | {r.rss_mb if r.rss_mb is not None else '-'} |")
    if summary.get("cost_split"):
        lines += ["", "| target | concurrency | offered requests/s | fixed CPU ms per request | "
                      "CPU us per relayed event |", "|---|---:|---:|---:|---:|"]
        lines += [f"| {x['target']} | {x['concurrency']} | {_offered(x.get('offered_rps'))} | "
                  f"{x['fixed_ms_per_request']:.3f} | {x['us_per_event']:.2f} |" for x in summary["cost_split"]]
    if summary.get("router_cpus"):
        lines += ["", f"Routers pinned to CPU {','.join(map(str, summary['router_cpus']))}; the client and the fake "
                      "engines ran on the others."]
    if "memory" in summary:
        m = summary["memory"]
        lines.append("")
        lines.append(f"MemoryStore with {m['conversations']:,} conversations ({m['block_ids_per_entry']} block ids "
                     f"each): RSS {m['rss_mb']} MB ({m['bytes_per_conversation']} bytes per conversation), put "
                     f"{m['put_us']} us, take {m['take_us']} us.")
    return "\n".join(lines) + "\n"


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected requests/s, comma-separated (e.g. 300,600)") from None
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"{text!r}: every rate must be above 0 requests/s")
    return rates


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--targets", default="direct,turnkv,vllm-router,fastapi")
    p.add_argument("--concurrency-levels", "--concurrency", dest="concurrency", default="1,32,128",
                   help="concurrency levels (requests in flight), comma-separated")
    p.add_argument("--reply-tokens", default="16", help="reply lengths, comma-separated (e.g. 16,64,256,1024)")
    p.add_argument("--event-writes", action="store_true", help="the fake engine writes one event at a time")
    p.add_argument("--requests", type=int, default=3000, help="requests per concurrency level (32, 128)")
    p.add_argument("--requests-c1", type=int, default=300)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per level (median requests/s)")
    p.add_argument("--port-base", type=int, default=28000)
    p.add_argument("--memory", type=int, default=0, help="also measure a MemoryStore with this many conversations")
    p.add_argument("--no-emf", action="store_true", help="turnkv without its per-request EMF line")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="a tunable for the turnkv target only (not the baseline), e.g. decode_migrations=0")
    p.add_argument("--baseline", help="another checkout of turnkv (e.g. main before a change): its router is measured "
                                      "as target turnkv-baseline in the same interleaved rounds")
    p.add_argument("--rate", type=_rates, default=[],
                   help="open loop: requests/s offered to every target alike, comma-separated (e.g. 300,600); "
                        "--concurrency then caps requests in flight. CPU per request compares fairly only at equal "
                        "load: in a closed loop a faster router is sent more, and batches more per wake-up")
    p.add_argument("--router-cpus", type=_router_cpus, default=None,
                   help="pin every router (all its threads) to these CPUs, comma-separated, and the client, fake "
                        "engines and Valkey to the others: one router CPU is a 1-vCPU task's share, and the "
                        "routers no longer compete with the load they are measured under")
    p.add_argument("--out", default="results/router-peers")
    return p


if __name__ == "__main__":
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    run(parser().parse_args())
