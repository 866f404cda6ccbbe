"""bench.router_peers' load generator (closed and open loop) and its CPU pinning of the routers."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from bench import router_peers


def test_arrivals_are_evenly_spaced_at_the_rate():
    assert router_peers.arrivals(4, 200.0) == [0.0, 0.005, 0.01, 0.015]
    with pytest.raises(ValueError, match="above 0"):
        router_peers.arrivals(3, 0)


@pytest.mark.parametrize("text", ["0", "-5", "fast", ","])
def test_rate_flag_refuses_what_is_not_a_positive_rate(text):
    with pytest.raises(argparse.ArgumentTypeError):
        router_peers._rates(text)


def test_rate_flag_reads_a_list():
    assert router_peers.parser().parse_args(["--rate", "300,600"]).rate == [300.0, 600.0]
    assert router_peers.parser().parse_args([]).rate == []


@contextlib.asynccontextmanager
async def _sse_server(delay: float) -> AsyncIterator[tuple[str, list[float]]]:
    """A stand-in for a streaming chat endpoint: records when each request came, answers after ``delay``."""
    seen: list[float] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        seen.append(time.perf_counter())
        await request.read()
        await asyncio.sleep(delay)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\ndata: [DONE]\n\n')
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/v1/chat/completions", seen
    finally:
        await runner.cleanup()


async def test_open_loop_sends_at_the_offered_rate_whatever_the_target_speed():
    async with _sse_server(delay=0.0) as (url, seen):
        total, errors, elapsed, ttfts = await router_peers.load(url, 32, 20, False, rate=100.0)
    assert (total, errors, len(ttfts)) == (20, 0, 20)
    # 20 requests at 100/s: the last leaves 0.19 s after the first, though the server answers at once
    assert seen[-1] - seen[0] == pytest.approx(0.19, abs=0.05)
    assert elapsed >= 0.19


async def test_open_loop_never_has_more_than_concurrency_in_flight():
    async with _sse_server(delay=0.1) as (url, seen):
        total, errors, elapsed, _ = await router_peers.load(url, 2, 6, False, rate=1000.0)
    assert (total, errors) == (6, 0)
    # two slots, 0.1 s per answer: three waves, so the achieved rate is far below the offered 1,000/s
    assert elapsed >= 0.29
    assert seen[2] - seen[0] >= 0.09


async def test_closed_loop_keeps_concurrency_requests_in_flight():
    async with _sse_server(delay=0.1) as (url, seen):
        total, errors, elapsed, _ = await router_peers.load(url, 3, 6, False)
    assert (total, errors) == (6, 0)
    assert seen[2] - seen[0] < 0.05  # the first three leave together
    assert 0.19 <= elapsed < 0.6


@pytest.fixture
def bench_router(monkeypatch):
    """``turnkv bench router ARGS`` with the benchmark itself replaced: (invoke, the argument sets it was run with)."""
    from typer.testing import CliRunner

    from turnkv.cli import app

    seen: list[argparse.Namespace] = []
    monkeypatch.setattr(router_peers, "run", seen.append)
    runner = CliRunner()
    return (lambda *args: runner.invoke(app, ["bench", "router", *args])), seen


def test_cli_hands_the_rate_to_the_benchmark_and_refuses_a_bad_one(bench_router):
    invoke, seen = bench_router
    assert invoke("--rate", "150,300").exit_code == 0
    assert seen[-1].rate == [150.0, 300.0]
    assert invoke().exit_code == 0
    assert seen[-1].rate == []  # closed loop
    res = invoke("--rate", "0")
    assert res.exit_code == 2
    assert len(seen) == 2  # nothing run


def test_router_cpus_leave_the_rest_to_the_load():
    assert router_peers.cpu_split("1", {0, 1}) == ({1}, {0})
    assert router_peers.cpu_split("2,3", {0, 1, 2, 3}) == ({2, 3}, {0, 1})
    with pytest.raises(ValueError, match="leaves no CPU"):
        router_peers.cpu_split("0,1", {0, 1})
    with pytest.raises(ValueError, match="choose among the CPUs this process may use: 0,1"):
        router_peers.cpu_split("7", {0, 1})
    with pytest.raises(ValueError, match="comma-separated"):
        router_peers.cpu_split("one", {0, 1})


def test_a_pinned_process_and_every_thread_it_starts_stay_on_its_cpus(tmp_path):
    cpu = min(os.sched_getaffinity(0))
    out = tmp_path / "affinity.txt"
    # the child starts a thread after exec (as a Rust runtime or uvloop's resolver would) and reports both
    code = ("import os, threading; seen = []; t = threading.Thread(target=lambda: seen.append("
            "sorted(os.sched_getaffinity(0)))); t.start(); t.join(); "
            "print(sorted(os.sched_getaffinity(0)), seen[0])")
    proc = router_peers.Proc("pinned", [sys.executable, "-c", code], log=out, cpus={cpu})
    assert proc.p.wait(30) == 0
    assert out.read_text().split() == [f"[{cpu}]", f"[{cpu}]"]


def test_cli_hands_the_router_cpus_over_and_refuses_a_bad_list(bench_router):
    invoke, seen = bench_router
    if len(os.sched_getaffinity(0)) > 1:
        cpu = max(os.sched_getaffinity(0))
        assert invoke("--router-cpus", str(cpu)).exit_code == 0
        assert seen[-1].router_cpus == ({cpu}, os.sched_getaffinity(0) - {cpu})
    res = invoke("--router-cpus", ",".join(map(str, os.sched_getaffinity(0))))
    assert res.exit_code == 2
    assert "leaves no CPU" in res.output
    assert invoke("--router-cpus", "9999").exit_code == 2
