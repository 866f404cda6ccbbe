"""What each kind of hostile request costs the router in CPU (issue 31): the router's process CPU (user + system,
from psutil) over a batch of requests of one kind, divided by the batch, with the answers they got.

On loopback over fake engines, one kind at a time, each on its own API keys (so one kind's budgets never refuse
another's). Complements ``bench.hostile_load``, which measures the bystander's TTFT under all of them at once.

Run: ``python -m bench.hostile_cost`` (``--set NAME=VALUE`` for router tunables).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections import Counter
from typing import Any

import aiohttp
import orjson
import psutil

from bench.fake_engine import FAKE_SECRET
from bench.hostile_load import ROOT, _raw, free_port, wait_ready
from turnkv import router_env, wire

MAX_BODY = 8 * 1024 * 1024
KEYS = [f"cost-key-{i:04d}" for i in range(64)]


def _auth(i: int) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[i]}"}


async def _post(session: aiohttp.ClientSession, url: str, key: int, **kw: Any) -> str:
    try:
        async with session.post(url, headers=_auth(key), **kw) as r:
            raw = await r.read()
            try:
                limit = (orjson.loads(raw).get("error") or {}).get("limit") if r.status != 200 else None
            except (orjson.JSONDecodeError, AttributeError):
                limit = None
            return f"{r.status}:{limit}" if limit else str(r.status)
    except (aiohttp.ClientError, OSError) as exc:
        return f"client_error {type(exc).__name__}"


async def kinds(port: int, n: int) -> dict[str, Any]:
    """Each kind's batch: (name, coroutine factory returning the answers)."""
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    normal = {"model": "tiny", "messages": [{"role": "user", "content": "tell me more " * 100}], "max_tokens": 16,
              "stream": True}
    flood = orjson.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}] * 240_000})
    parked = b"{" + b" " * (MAX_BODY - 3)

    async def normal_turns(s: aiohttp.ClientSession) -> list[str]:
        return [await _post(s, url, 0, json=normal) for _ in range(n)]

    async def aborted(s: aiohttp.ClientSession) -> list[str]:
        out = []
        for _ in range(n):
            async with s.post(url, json={**normal, "max_tokens": 256}, headers=_auth(1)) as r:
                out.append(str(r.status))
                await r.content.readline()
                r.close()
        return out

    async def bad_types(s: aiohttp.ClientSession) -> list[str]:
        return [await _post(s, url, 2, json={**normal, "max_tokens": "abc"}) for _ in range(n)]

    async def oversized(_: aiohttp.ClientSession) -> list[str]:
        return [await _raw(port, KEYS[3], MAX_BODY + 1, b"{", 2.0) for _ in range(n)]

    async def flood_413(s: aiohttp.ClientSession) -> list[str]:  # within the body rate's burst: read, counted, 413
        return [await _post(s, url, 4 + i // 3, data=flood) for i in range(12)]

    async def flood_429(s: aiohttp.ClientSession) -> list[str]:  # one key, past its body rate's burst: 429
        return [await _post(s, url, 8, data=flood) for i in range(40)]

    async def parked_admitted(_: aiohttp.ClientSession) -> list[str]:  # 8 MiB - 1 byte, held 3 s: read, then 408?
        return list(await asyncio.gather(*(_raw(port, KEYS[10 + i // 2], MAX_BODY, parked, 3.0) for i in range(8))))

    async def parked_refused(_: aiohttp.ClientSession) -> list[str]:  # one key's 15 at once: the most get 429
        return list(await asyncio.gather(*(_raw(port, KEYS[20], MAX_BODY, parked, 3.0) for _ in range(15))))

    return {"normal_stream": (normal_turns, n), "aborted_stream": (aborted, n), "bad_type": (bad_types, n),
            "oversized_content_length": (oversized, n), "flood_413": (flood_413, 12), "flood_429": (flood_429, 40),
            "parked_admitted": (parked_admitted, 8), "parked_refused": (parked_refused, 15)}


async def measure(port: int, pid: int, n: int) -> dict[str, Any]:
    proc = psutil.Process(pid)
    out: dict[str, Any] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        for name, (batch, count) in (await kinds(port, n)).items():
            await asyncio.sleep(1.0)  # let lingering work of the last batch finish
            c0, t0 = sum(proc.cpu_times()[:2]), time.monotonic()
            answers = await batch(s)
            await asyncio.sleep(0.5)
            cpu = sum(proc.cpu_times()[:2]) - c0  # includes the idle 0.5 s (health probes: negligible)
            out[name] = {"requests": count, "router_cpu_ms_per_request": round(1000 * cpu / count, 2),
                         "wall_s": round(time.monotonic() - t0, 2), "answers": dict(Counter(answers))}
            print(name, json.dumps(out[name]), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=200, help="Requests per batch of the cheap kinds.")
    p.add_argument("--set", action="append", default=[], help="Router tunable NAME=VALUE (repeatable).")
    args = p.parse_args()
    p_port, d_port, r_port = free_port(), free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), wire.OFFER_SECRET_ENV: FAKE_SECRET.decode(),
           router_env.API_KEYS: json.dumps({"tenants": {f"t{i}": k for i, k in enumerate(KEYS)}})}
    py = sys.executable
    procs = [subprocess.Popen([py, "-m", "bench.fake_engine", "--port", str(p_port), "--port", str(d_port)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    router = subprocess.Popen([py, "-m", "turnkv.cli", "router", "serve", "--prefill", f"http://127.0.0.1:{p_port}",
                               "--decode", f"http://127.0.0.1:{d_port}", "--port", str(r_port), "--no-emf",
                               *(x for kv in args.set for x in ("--set", kv))], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs.append(router)
    try:
        asyncio.run(wait_ready(f"http://127.0.0.1:{r_port}"))
        print(json.dumps(asyncio.run(measure(r_port, router.pid, args.requests)), indent=1))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()
