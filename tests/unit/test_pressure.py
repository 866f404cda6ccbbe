"""bench.pressure: the fit, think times, decode's metrics by label, a level's summary, and a whole sweep against
the router over fake engines (bench.fake_engine) on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from aiohttp import web

from bench import fake_engine, pressure
from bench import pressure_calc as calc
from bench import pressure_report as report
from bench.client import Result
from bench.fake_engine import FAKE_SECRET, FakeEngine, start
from bench.workload import Conversation, WorkloadSpec, build
from tests.conftest import free_port
from turnkv import params

# -- fit -------------------------------------------------------------------------------------------------


def test_fit_is_room_over_blocks_of_a_last_turn():
    # 0.02 x 10,000 blocks = 200 blocks of room; 1,148 tokens at 16 a block = 72 blocks: 2 conversations fit
    fit = calc.compute_fit(10_000, 16, 0.02, 1148)
    assert (fit.room_blocks, fit.blocks_per_conversation, fit.conversations) == (200, 72, 2)
    assert fit.source == "metrics" and fit.as_dict()["num_gpu_blocks"] == 10_000
    assert calc.compute_fit(100, 16, 0.01, 5000).conversations == 1  # never 0: a level needs a conversation
    with pytest.raises(ValueError):
        calc.compute_fit(0, 16, 0.5, 100)


def test_levels_are_multiples_of_the_fit():
    assert [calc.conversations_at(x, 5) for x in (0.5, 1, 2, 4, 8)] == [2, 5, 10, 20, 40]
    assert calc.conversations_at(0.1, 3) == 1
    assert calc.parse_levels("0.5,1,2") == [0.5, 1.0, 2.0]
    for bad in ("2,1", "0,1", "a", ""):
        with pytest.raises(ValueError):
            calc.parse_levels(bad)


def test_last_turn_tokens_count_every_message_and_reply():
    conv = Conversation(0, "s s s", ("a b", "c", "d e f"))
    # 3 system + 6 user words + 3 replies of 10 + 6 messages (system, 3 user, 2 earlier replies) x the allowance
    assert calc.last_turn_tokens(conv, 10) == 3 + 6 + 30 + 6 * calc.TEMPLATE_TOKENS_PER_MESSAGE
    filed = Conversation(0, "s", ("a", "b"), max_tokens=(7, 9))
    assert calc.last_turn_tokens(filed, 10) == 1 + 2 + 16 + 4 * calc.TEMPLATE_TOKENS_PER_MESSAGE


# -- think times -----------------------------------------------------------------------------------------


def test_think_times_fixed_exponential_and_from_a_file():
    conv = build(WorkloadSpec(conversations=1, turns=4, system_words=3, first_user_words=3, turn_words=3))[0]
    assert calc.parse_think("fixed:35").delays(conv, 1) == [0.0, 35.0, 35.0, 35.0]
    exp = calc.parse_think("exp:35")
    first = exp.delays(conv, 1)
    assert first == exp.delays(conv, 1) and first != exp.delays(conv, 2)  # seeded
    assert first[0] == 0.0 and all(x > 0 for x in first[1:])
    many = [d for i in range(400) for d in exp.delays(Conversation(i, "s", ("a",) * 6), 3)[1:]]
    assert sum(many) / len(many) == pytest.approx(35, rel=0.1)
    filed = Conversation(0, "s", ("a", "b", "c"), think_s=(0.0, 2.5, 4.0))
    assert calc.parse_think("file").delays(filed, 1) == [0.0, 2.5, 4.0]
    for bad in ("35", "gamma:3", "fixed:-1", "exp:x"):
        with pytest.raises(ValueError):
            calc.parse_think(bad)


def test_variants_carry_their_tunables():
    v = calc.parse_variant("host=retained_kv_share=0.02,host_kv_budget_mib=512")
    assert v == calc.Variant("host", {"retained_kv_share": 0.02, "host_kv_budget_mib": 512})
    assert calc.parse_variant("plain") == calc.Variant("plain", {})
    for bad in ("=a=1", "x=a", "x=a=b"):
        with pytest.raises(ValueError):
            calc.parse_variant(bad)


# -- metrics by label ------------------------------------------------------------------------------------

METRICS_BEFORE = """\
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="8192",engine="0"} 1.0
# TYPE vllm:turnkv_retention_evictions_total counter
vllm:turnkv_retention_evictions_total{engine="0",reason="idle"} 2.0
vllm:turnkv_retention_evictions_created{engine="0",reason="idle"} 1.7e9
# TYPE vllm:turnkv_retention_refusals_total counter
vllm:turnkv_retention_refusals_total{engine="0",reason="full"} 1.0
vllm:turnkv_retention_refusals_total{engine="1",reason="full"} 3.0
# TYPE vllm:turnkv_retained_bytes gauge
vllm:turnkv_retained_bytes{engine="0",model_name="tiny"} 1048576.0
# TYPE vllm:turnkv_host_retained_bytes gauge
vllm:turnkv_host_retained_bytes{engine="0",model_name="tiny"} 0.0
# TYPE vllm:turnkv_host_pull_overhead_seconds gauge
vllm:turnkv_host_pull_overhead_seconds{engine="0",model_name="tiny"} 0.004
# TYPE vllm:turnkv_host_tier_configured_bytes gauge
vllm:turnkv_host_tier_configured_bytes{engine="0",model_name="tiny"} 536870912.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running 0.0
"""

METRICS_AFTER = METRICS_BEFORE.replace('reason="idle"} 2.0', 'reason="idle"} 7.0').replace(
    'host_retained_bytes{engine="0",model_name="tiny"} 0.0',
    'host_retained_bytes{engine="0",model_name="tiny"} 4194304.0') + """\
# TYPE vllm:turnkv_host_pool_bytes gauge
vllm:turnkv_host_pool_bytes{engine="0",model_name="tiny"} 536870912.0
# TYPE vllm:turnkv_retention_evicted_total counter
vllm:turnkv_retention_evicted_total{engine="0"} 4.0
"""


def test_metrics_are_summed_by_tier_and_reason():
    series = calc.turnkv_series(METRICS_BEFORE)
    assert series['vllm:turnkv_retention_refusals_total{reason="full"}'] == 4.0  # two engines, one reason
    assert series["vllm:turnkv_retained_bytes"] == 1048576.0
    assert not any("created" in k or "num_requests" in k for k in series)
    assert calc.cache_config(METRICS_BEFORE) == (8192, 16)
    assert calc.cache_config("vllm:num_requests_running 0\n") is None
    deltas = calc.counter_deltas(series, calc.turnkv_series(METRICS_AFTER))
    assert deltas == {'vllm:turnkv_retention_evictions_total{reason="idle"}': 5.0,
                      "vllm:turnkv_retention_evicted_total": 4.0,
                      'vllm:turnkv_retention_refusals_total{reason="full"}': 0.0}
    assert calc.sum_by(deltas, "vllm:turnkv_retention_evictions_total") == 5.0
    peaks = calc.gauge_peaks([series, calc.turnkv_series(METRICS_AFTER), series])
    assert peaks["vllm:turnkv_host_retained_bytes"] == {"peak": 4194304.0, "last": 0.0}
    assert peaks["vllm:turnkv_host_pool_bytes"] == {"peak": 536870912.0, "last": 0.0}
    # bytes held, not the host tier's settings or its pull costs (the table printed those as "MiB" before)
    assert sorted(report.short_gauge(k) for k in peaks) == ["all", "host", "host_pool"]
    assert report._mib({"tier_bytes": peaks}) == "all 1.0, host 4.0, host_pool 512.0"
    pulls = {'vllm:turnkv_pulls_total{tier="device"}': 3.0, 'vllm:turnkv_pulls_total{tier="host"}': 9.0,
             "vllm:turnkv_read_bytes_total": 5.0}
    assert report._pulls({"prefill_counters": pulls}) == "device 3, host 9"


# -- a level's summary -----------------------------------------------------------------------------------


def _r(conv: int, turn: int, arm: str, ttft: float, reused: int = 0, reply: str = "x", error: str | None = None):
    return Result(conv, turn, arm, ttft_ms=ttft, reused_tokens=reused, reply=reply, error=error,
                  reuse_outcome="hit" if reused else ("none" if turn == 0 else "miss"))


def test_level_summary_counts_reuse_percentiles_and_identical_answers():
    on = [_r(0, 0, "on", 100), _r(0, 1, "on", 20, 500), _r(0, 2, "on", 30, 600),
          _r(1, 0, "on", 110), _r(1, 1, "on", 90), _r(1, 2, "on", 95, reply="y")]
    off = [_r(0, 0, "off", 100), _r(0, 1, "off", 120), _r(0, 2, "off", 130),
           _r(1, 0, "off", 110), _r(1, 1, "off", 125), _r(1, 2, "off", 0, error="HTTP 500")]
    s = calc.level_summary(on, off)
    assert (s["later_turns"], s["later_turns_reused"], s["reuse_share"]) == (4, 2, 0.5)
    assert s["reuse_outcomes"] == {"hit": 2, "miss": 2}
    assert (s["errors_on"], s["errors_off"]) == (0, 1)
    assert (s["answers_compared"], s["answers_identical"]) == (5, 5)  # the failed off turn is not compared
    assert (s["ttft_on_p50_ms"], s["ttft_on_p90_ms"]) == (90, 110)
    assert (s["ttft_off_p50_ms"], s["ttft_off_p90_ms"]) == (120, 130)
    assert (s["ttft_on_later_p50_ms"], s["ttft_on_later_p90_ms"]) == (30, 95)
    assert (s["ttft_off_later_p50_ms"], s["ttft_off_later_p90_ms"]) == (125, 130)
    assert calc.p90_ratio(s) == pytest.approx(1.37) and calc.p90_ratio(s, "") == pytest.approx(1.18)
    on[1].reply = "different"
    assert calc.level_summary(on, off)["answers_identical"] == 4


def test_cli_flags_become_options_and_variants():
    args = pressure.parser().parse_args(["--quick", "--url", "http://x", "--variant", "mine=retained_kv_share=0.1"])
    opts, variants, target = pressure.options(args)
    assert (opts.levels, opts.turns, opts.think) == ([1.0, 2.0], 3, calc.Think("fixed", 1.0))
    assert variants == [calc.Variant("mine", {"retained_kv_share": 0.1})] and target.url == "http://x"
    opts, variants, target = pressure.options(pressure.parser().parse_args([]))
    assert [v.name for v in variants] == ["device only", "host tier"] and target is None
    assert variants[1].tunables == {"retained_kv_share": 0.02, "host_kv_budget_mib": 512}
    assert params.validate(variants[1].tunables)  # the default variants' tunables are catalog engine tunables
    opts, variants, _ = pressure.options(pressure.parser().parse_args(["--quick"]))
    assert (opts.levels, opts.workload.system_words, opts.max_seconds) == ([1.0, 2.0], 100, 600)
    assert variants == [calc.Variant("device only", {"retained_kv_share": 0.01})]
    with pytest.raises(ValueError, match="one variant"):
        pressure.options(pressure.parser().parse_args(["--url", "http://x", "--variant", "a", "--variant", "b"]))


# -- the whole harness over fake engines -----------------------------------------------------------------


def _fake_metrics(decode: FakeEngine, blocks: int, block_size: int):
    """decode's /metrics as turnkv's connector would show it, from the fake decode's own counts."""

    async def metrics(_: web.Request) -> web.Response:
        evicted, held = decode.stats.get("evicted", 0), decode.stats["decode"] - decode.stats.get("evicted", 0)
        return web.Response(text=(
            f'vllm:cache_config_info{{block_size="{block_size}",num_gpu_blocks="{blocks}"}} 1.0\n'
            f'vllm:turnkv_retention_evictions_total{{reason="idle"}} {evicted}\n'
            f'vllm:turnkv_retention_refusals_total{{reason="full"}} 0\n'
            f'vllm:turnkv_retained_bytes{{tier="device"}} {held * 1024}\n'))

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    return app


@contextmanager
def fake_stack(retain_limit: int, blocks: int, block_size: int) -> Iterator[tuple[str, str]]:
    """Router + one fake prefill and one fake decode (holding ``retain_limit`` turns, oldest evicted first) and
    decode's metrics, served from a thread of their own (the harness runs its own event loop)."""
    from router.app import build_app
    from router.config import RouterConfig

    loop = asyncio.new_event_loop()
    ready, stop = threading.Event(), None
    ports = {"router": free_port(), "metrics": free_port()}
    runners: list[web.AppRunner] = []

    async def up() -> None:
        nonlocal stop
        stop = asyncio.Event()
        prefill = FakeEngine(free_port(), role="prefill", engine_id="prefill-0")
        decode = FakeEngine(free_port(), role="decode", engine_id="decode-0", retain_limit=retain_limit,
                            eviction_grace=30.0)
        runners.extend(await start([prefill, decode]))
        config = RouterConfig(prefill=[f"http://127.0.0.1:{prefill.port}"],
                              decode=[f"http://127.0.0.1:{decode.port}"],
                              tunables={"health_interval": 60, "conversation_ttl": 45, "decoder_kv_blocks_ttl": 60,
                                        "evictions_interval": 0.2},
                              key_secret=b"test-secret", emf=False, offer_secret=FAKE_SECRET)
        for app, port in ((build_app(config), ports["router"]),
                          (_fake_metrics(decode, blocks, block_size), ports["metrics"])):
            runner = web.AppRunner(app, handler_cancellation=True)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            runners.append(runner)
        ready.set()
        await stop.wait()
        for r in reversed(runners):
            await r.cleanup()

    thread = threading.Thread(target=loop.run_until_complete, args=(up(),), daemon=True)
    thread.start()
    assert ready.wait(20)
    try:
        yield f"http://127.0.0.1:{ports['router']}", f"http://127.0.0.1:{ports['metrics']}"
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(20)


def test_sweep_over_fake_engines_reports_reuse_falling_past_the_fit(tmp_path, monkeypatch):
    # the fake engine opens each reply with its request id (different on every request): drop that word, so a
    # reply depends only on the prompt, as greedy decoding's does
    monkeypatch.setattr(fake_engine, "token_text", lambda token, *, request_id="", kv_from="":
                        "" if request_id else f"kv-{kv_from} " if kv_from else f"w{token} ")
    opts = pressure.PressureOptions(levels=[1.0, 2.0], turns=3, think=calc.Think("fixed", 0.5), stagger=0,
                            workload=WorkloadSpec(turns=3, system_words=20, first_user_words=30, turn_words=10,
                                                  max_tokens=8, seed=3), timeout=20, max_seconds=120)
    tokens = pressure.tokens_per_conversation(opts)
    per = -(-tokens // 16)
    # room for exactly 2 conversations at the default share (0.5): 2 x per blocks out of 4 x per
    with fake_stack(retain_limit=2, blocks=4 * per, block_size=16) as (url, metrics_url):
        result = pressure.run(opts, [calc.Variant("fake", {})], tmp_path,
                              url=pressure.Target(url, metrics_url, decode_pid=None))
    (variant,) = result["variants"]
    assert variant["fit"] == {"conversations": 2, "source": "metrics", "num_gpu_blocks": 4 * per, "block_size": 16,
                              "retained_kv_share": 0.5, "room_blocks": 2 * per, "last_turn_tokens": tokens,
                              "blocks_per_conversation": per}
    one, two = variant["levels"]
    assert (one["level"], one["conversations"], two["conversations"]) == (1.0, 2, 4)
    for level in (one, two):
        n = level["conversations"]
        assert level["requests"] == n * 3 * 2 and level["errors_on"] == level["errors_off"] == 0
        assert level["answers_compared"] == level["answers_identical"] == n * 3
        assert level["later_turns"] == n * 2 and level["turns_skipped"] == 0
        assert level["ttft_on_p90_ms"] is not None and level["ttft_off_later_p90_ms"] is not None
        assert level["decode_metrics"] and level["decode_rss_mib"] is None and level["prefill_counters"] is None
        assert 'vllm:turnkv_retained_bytes{tier="device"}' in level["tier_bytes"]
    # everything fits: every later turn reuses. Twice the room: the fake decode evicts oldest first, the router
    # reads that on decode's feed (every 0.2 s, the think time is 0.5 s) and refuses those turns, which recompute
    assert one["reuse_share"] == 1.0 and one["reuse_outcomes"] == {"hit": 4}
    assert two["reuse_share"] < 1.0 and two["reuse_outcomes"]["refused"] >= 2
    assert two["evictions"] > one["evictions"]  # (the fake also evicts turns already read: 1x counts some)
    assert two["decode_counters"]['vllm:turnkv_retention_evictions_total{reason="idle"}'] == two["evictions"]
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["variants"][0]["levels"][1]["conversations"] == 4 and saved["meta"]["url"] == url
    lines = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(lines) == (2 + 4) * 3 * 2 and {x["arm"] for x in lines} == {"on", "off"}
    assert (tmp_path / "pressure.png").stat().st_size > 10_000
    assert len(report.rows(result)) == 2 and report.fit_line(variant).startswith("fake: fit 2 conversations")
    # at 80 columns the rows print as records that fit, not as a 13-column table folded mid-cell (issue #49)
    text = report.records(result)
    assert text.splitlines()[0] == "fake at 1x (2 conversations)" and "  identical: 6/6" in text
    assert max(map(len, text.splitlines())) <= 80, text


def test_turnkv_bench_pressure_command_over_fake_engines(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from turnkv.cli import app

    monkeypatch.setattr(fake_engine, "token_text", lambda token, *, request_id="", kv_from="":
                        "" if request_id else f"kv-{kv_from} " if kv_from else f"w{token} ")
    with fake_stack(retain_limit=0, blocks=1000, block_size=16) as (url, metrics_url):
        got = CliRunner().invoke(app, ["bench", "pressure", "--url", url, "--decode-url", metrics_url, "--fit", "2",
                                       "--variant", "fake", "--levels", "0.5,1,4", "--max-conversations", "4",
                                       "--turns", "2", "--think", "exp:0.2",
                                       "--system-words", "10", "--first-user-words", "10", "--turn-words", "5",
                                       "--out", str(tmp_path)])
    assert got.exit_code == 0, got.output
    saved = json.loads((tmp_path / "summary.json").read_text())
    (variant,) = saved["variants"]
    assert variant["fit"]["source"] == "given" and variant["fit"]["conversations"] == 2
    assert [lv["conversations"] for lv in variant["levels"]] == [1, 2, 8]
    assert [lv["reuse_share"] for lv in variant["levels"][:2]] == [1.0, 1.0]
    assert variant["levels"][2]["skipped"] == "over --max-conversations 4"  # 8 conversations: not played
    assert "skipped: over" in got.output  # the table's row for the level not played
    assert saved["meta"]["think"] == {"kind": "exp", "seconds": 0.2}


def test_stack_mode_starts_a_stack_per_level_and_plays_a_workload_file(tmp_path, monkeypatch):
    """The stack path without vLLM: ``stack_target`` stands in with the fake stack, once per level, given the
    variant's tunables; conversations, lengths and think times come from a workload file, cut to --turns."""
    monkeypatch.setattr(fake_engine, "token_text", lambda token, *, request_id="", kv_from="":
                        "" if request_id else f"kv-{kv_from} " if kv_from else f"w{token} ")
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps({
        "filetype": "generate_conversations", "num_conversations": 500,
        "prompt_input": {"num_turns": {"distribution": "constant", "value": 5},
                         "common_prefix_num_tokens": {"distribution": "constant", "value": 20},
                         "prefix_num_tokens": {"distribution": "constant", "value": 30},
                         "num_tokens": {"distribution": "constant", "value": 10}},
        "prompt_output": {"num_tokens": {"distribution": "constant", "value": 6}},
        "num_clients": 4, "think_time_s": {"distribution": "constant", "value": 0.2}}))
    started: list[dict] = []

    @contextmanager
    def fake_target(variant, state_dir, port_base, opts=None):
        started.append(dict(variant.tunables))
        with fake_stack(retain_limit=0, blocks=1000, block_size=16) as (url, metrics_url):
            yield pressure.Target(url, metrics_url, decode_pid=os.getpid(), prefill_url=metrics_url), None

    monkeypatch.setattr(pressure, "stack_target", fake_target)
    args = pressure.parser().parse_args(["--levels", "1,2,8", "--max-conversations", "8", "--turns", "3",
                                         "--think", "file", "--workload",
                                         str(workload), "--fit", "2", "--variant", "host=host_kv_budget_mib=64"])
    opts, variants, target = pressure.options(args)
    assert target is None and opts.planned.num_conversations == 500
    result = pressure.run(opts, variants, tmp_path / "out")
    assert started == [{"host_kv_budget_mib": 64}] * 2  # one stack per level; none for the level over the bound
    one, two, eight = result["variants"][0]["levels"]
    assert eight == {"level": 8.0, "conversations": 16, "skipped": "over --max-conversations 8"}
    assert (one["conversations"], two["conversations"]) == (2, 4)
    assert two["later_turns"] == 4 * 2 and two["reuse_share"] == 1.0  # 3 of the file's 5 turns
    assert two["answers_identical"] == 4 * 3
    assert two["reuse_on_phase_s"] >= 0.4  # two think times of 0.2 s from the file
    assert two["decode_rss_mib"]["peak"] > 10  # this process stands in for decode
    assert two["prefill_counters"] == {'vllm:turnkv_retention_evictions_total{reason="idle"}': 0.0,
                                       'vllm:turnkv_retention_refusals_total{reason="full"}': 0.0}


def test_quick_mode_for_the_demo_against_a_running_router(tmp_path, monkeypatch):
    monkeypatch.setattr(fake_engine, "token_text", lambda token, *, request_id="", kv_from="":
                        "" if request_id else f"kv-{kv_from} " if kv_from else f"w{token} ")
    with fake_stack(retain_limit=0, blocks=1000, block_size=16) as (url, metrics_url):
        result = pressure.quick(tmp_path, url=url, decode_url=metrics_url, fit=1)
    levels = result["variants"][0]["levels"]
    assert [(lv["level"], lv["conversations"], lv["requests"]) for lv in levels] == [(1.0, 1, 6), (2.0, 2, 12)]
    assert all(lv["answers_identical"] == lv["answers_compared"] for lv in levels)
    assert (tmp_path / "summary.json").exists() and (tmp_path / "pressure.png").exists()
