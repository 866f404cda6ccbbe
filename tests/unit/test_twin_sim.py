"""The event-simulation twin of `turnkv bench capacity` (turnkv.plan.twin_sim): pure, deterministic."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from turnkv.cli import app
from turnkv.engine_args import EngineSpec
from turnkv.plan import architectures, hardware
from turnkv.plan import closed_form as m
from turnkv.plan import twin_sim as ts


def fleet() -> m.Fleet:
    inst = hardware.load("local-cpu")
    return m.Fleet(architectures.tiny_local(), inst, inst, 1, 1, block_size=EngineSpec.block_size,
                   prefill_prefix_caching=True, host_kv_gib=0.0)


CONSTS = ts.SimConstants(decode_step_s=0.009, decode_seq_s=0.001, contention=0.0)
#: The calibration run of 2026-12-06-c: 10 turns, 150/250/150 words, 32-token replies (bench capacity --seed 101).
CALIB = ts.conversation(10, 150, 250, 150, 32)
SYSTEM = 150 + ts.SYSTEM_EXTRA - 1


def records(levels, consts=CONSTS, conv=CALIB, **kw):
    sim = ts.Simulation(fleet(), consts, system_tokens=SYSTEM, **kw)
    return sim.run([conv] * max(levels), levels)


def test_conversations_in_tokens_match_what_the_engines_counted():
    # prompt_tokens and the decode-held history the calibration run's router reported, turn by turn
    assert [t.prompt for t in CALIB] == [421, 612, 802, 993, 1183, 1374, 1564, 1755, 1945, 2136]
    assert CALIB[1].history == 421 + 32 - 1  # 384 cached + 68 pulled in the measured run


def test_one_conversation_is_the_closed_form():
    f = fleet()
    conv = ts.conversation(4, 200, 300, 200, 16)
    got = [r.ttft_ms for r in records([1], conv=conv) if r.arm == "off"]
    prompt = np.array([t.prompt for t in conv])
    # reuse off: a fresh cache salt every request, so decode too reads the whole prompt (no history it holds)
    costs = m.turn_costs(f, prompt, np.zeros_like(prompt))
    # decode's first step: the fitted one in place of the closed form's (the hop held the rest)
    want = (costs.ttft_off - m.decode_step_s(f, prompt)) * 1000
    assert got == pytest.approx(want, rel=1e-6)


def test_the_reuse_arm_pulls_what_the_measured_run_pulled():
    rs = [r for r in records([1, 2]) if r.arm == "on"]
    one = [r for r in rs if r.level == 1]
    # measured: prefill's cache held whole blocks of the turn before; turns 2-5, 7 and 9 pulled a tail of >= 64
    assert [r.prefill_cached_tokens for r in one] == [0, 384, 512, 768, 896, 1152, 1280, 1536, 1664, 1920]
    assert [r.reused_tokens for r in one] == [0, 68, 131, 65, 128, 0, 125, 0, 122, 0]
    replayed = [r for r in rs if r.level == 2 and r.conv == 0]
    assert [r.prefill_cached_tokens for r in replayed][:2] == [384, 512] and not any(r.reused_tokens for r in replayed)
    newcomer = [r for r in rs if r.level == 2 and r.conv == 1]
    assert newcomer[0].prefill_cached_tokens == 128  # the shared system prompt's block
    assert all(r.reused_tokens == 0 and r.prefill_cached_tokens == 0 for r in records([1]) if r.arm == "off")


def test_more_conversations_never_lower_a_turn():
    solo = {(r.arm, r.turn): r.ttft_ms for r in records([1]) if r.conv == 0}
    crowd = {(r.arm, r.turn): r.ttft_ms for r in ts.Simulation(fleet(), CONSTS, system_tokens=SYSTEM).run(
        [CALIB] * 4, [4]) if r.conv == 0}
    assert all(crowd[k] >= solo[k] - 1e-9 for k in solo)
    assert sum(crowd.values()) > sum(solo.values())


def test_decode_batches_concurrent_sequences_in_one_step():
    conv = ts.conversation(2, 50, 50, 50, 32)
    solo = ts.summarize(records([1], conv=conv, stagger_s=0.0), [1])["levels"][0]["off"]["token_ms"]
    two = ts.summarize(ts.Simulation(fleet(), CONSTS, stagger_s=0.0).run([conv] * 2, [2]), [2])
    pair = two["levels"][0]["off"]["token_ms"]
    assert solo == pytest.approx(10.0)  # 9 + 1 ms per step at one sequence
    assert solo < pair <= 11.0 + 1e-9  # both in each step: 9 + 2 x 1 ms, not 2 x 10


def test_prefill_steps_take_a_chunk_budget_and_charge_later_chunks():
    sim = ts.Simulation(fleet(), CONSTS)
    one = sim.prefill_step_s([(1000, 0)], continuing_only=False)
    both = sim.prefill_step_s([(1000, 0), (1000, 0)], continuing_only=False)
    assert both == pytest.approx(2 * one)
    step = fleet().prefill.efficiency.step_overhead_s
    assert sim.prefill_step_s([(1000, 0)], continuing_only=True) == pytest.approx(one + step)


def test_a_small_prefill_cache_evicts_least_recently_used_blocks():
    roomy = [r for r in records([1, 2]) if r.arm == "on" and r.level == 2 and r.conv == 0]
    tight = [r for r in records([1, 2], prefill_blocks=4) if r.arm == "on" and r.level == 2 and r.conv == 0]
    assert roomy[0].prefill_cached_tokens == 384 and tight[0].prefill_cached_tokens < 384


def test_contention_slows_steps_only_when_both_engines_are_busy():
    slow = dataclasses.replace(CONSTS, contention=1.0)
    assert [r.ttft_ms for r in records([1], slow)] == [r.ttft_ms for r in records([1])]  # never overlap alone
    assert (ts.summarize(records([1, 4], slow), [1, 4])["levels"][1]["off"]["ttft_mean_ms"]
            > ts.summarize(records([1, 4]), [1, 4])["levels"][1]["off"]["ttft_mean_ms"])


def test_the_simulation_is_deterministic():
    a = ts.simulate(fleet(), CONSTS, [CALIB] * 8, [1, 2, 4, 8], SYSTEM)
    b = ts.simulate(fleet(), CONSTS, [CALIB] * 8, [1, 2, 4, 8], SYSTEM)
    assert a == b
    assert [lv["off"]["samples"] for lv in a["levels"]] == [10, 20, 40, 80]


def test_fit_recovers_the_constants_of_a_simulated_calibration_run():
    truth = ts.SimConstants(decode_step_s=0.008, decode_seq_s=0.0015, contention=0.3)
    levels = [1, 2, 4, 8]
    rows = [dataclasses.asdict(r) | {"conversation": r.conv, "error": None} for r in records(levels, truth)]
    got = ts.fit(fleet(), [CALIB] * 8, levels, rows, SYSTEM, shares_core=False)
    assert got.salt_scope == "request"
    assert got.decode_step_s + got.decode_seq_s == pytest.approx(0.0095, rel=1e-3)
    assert got.decode_seq_s == pytest.approx(0.0015, rel=0.1)
    # the contention barely moves a prefill-bound top level, so the check is that the fit reproduces what it saw
    want = ts.summarize(records(levels, truth), levels)["levels"][-1]["off"]["ttft_mean_ms"]
    assert ts.summarize(records(levels, got), levels)["levels"][-1]["off"]["ttft_mean_ms"] == pytest.approx(want,
                                                                                                          rel=0.03)


def test_fit_reads_the_salt_scope_off_the_records():
    base = {"arm": "off", "error": None, "prefill_cached_tokens": 0}
    rows = [base | {"level": 1, "turn": t, "conversation": 0} for t in range(3)]
    assert ts.salt_scope(rows) == "request"
    own = [r | {"prefill_cached_tokens": 128 * r["turn"]} for r in rows]
    assert ts.salt_scope(own) == "conversation"


def test_fit_recovers_the_hops_cost_per_prompt_token():
    truth = ts.SimConstants(decode_step_s=0.008, decode_seq_s=0.0015, hop_per_token_s=4e-6, hop_shares_core=True)
    levels = [1, 2, 4]
    rows = [dataclasses.asdict(r) | {"conversation": r.conv, "error": None} for r in records(levels, truth)]
    got = ts.fit(fleet(), [CALIB] * 4, levels, rows, SYSTEM)
    assert got.hop_shares_core and got.hop_per_token_s == pytest.approx(4e-6, rel=0.05)


def test_hops_cost_per_prompt_token_and_share_a_busy_core():
    long = ts.conversation(2, 150, 1000, 150, 16)
    plain = [r.ttft_ms for r in records([1], conv=long)]
    per_token = [r.ttft_ms for r in records([1], dataclasses.replace(CONSTS, hop_per_token_s=1e-5), conv=long)]
    # two hops of 1e-5 s per prompt token each
    assert [b - a for a, b in zip(plain, per_token, strict=True)] == pytest.approx(
        [2 * 1e-5 * t.prompt * 1000 for t in long] * 2, rel=1e-6)
    alone = [r.ttft_ms for r in records([1], dataclasses.replace(CONSTS, hop_shares_core=True))]
    assert alone == [r.ttft_ms for r in records([1])]  # one conversation: no hop meets a busy engine
    shared = dataclasses.replace(CONSTS, hop_shares_core=True)
    assert (ts.summarize(records([1, 4], shared), [1, 4])["levels"][1]["on"]["ttft_mean_ms"]
            > ts.summarize(records([1, 4]), [1, 4])["levels"][1]["on"]["ttft_mean_ms"])


# -- bench pressure ----------------------------------------------------------------------------------------------

PRESSURE = ts.conversation(4, 100, 200, 100, 96, think_s=1.0)


def pressure(counts, room, consts=CONSTS, prefix_caching=True):
    f = dataclasses.replace(fleet(), prefill_prefix_caching=prefix_caching)
    return ts.simulate_pressure(f, consts, PRESSURE, counts, room, 100 + ts.SYSTEM_EXTRA - 1)


def test_the_pressure_fit_counts_as_the_benchmark_does():
    from bench import pressure_calc
    from bench.workload import WorkloadSpec, build

    conv = build(WorkloadSpec(conversations=1, turns=4, system_words=100, first_user_words=200, turn_words=100,
                              max_tokens=96))[0]
    tokens = pressure_calc.last_turn_tokens(conv, 96)
    want = pressure_calc.compute_fit(2048, 128, 0.01, tokens).conversations
    assert ts.pressure_fit(4, 100, 200, 100, 96, 20, 128) == want


def test_a_read_turn_frees_its_room_for_the_next():
    # room for one conversation's largest turn: one conversation pulls every later turn
    room = math.ceil((PRESSURE[-1].prompt + 95) / 128)
    (row,) = pressure([1], room)
    assert row["reuse_share"] == 1.0 and row["later_turns"] == 3


def test_a_full_retention_room_refuses_newcomers_instead_of_evicting_the_oldest():
    room = math.ceil((PRESSURE[-1].prompt + 95) / 128)
    one, four = pressure([1, 4], room)
    assert one["reuse_share"] == 1.0
    # the first level's last turn is held (never read, not idle within the floor): little room for the next level
    assert four["reuse_share"] < 0.5
    roomy = pressure([1, 4], 10_000)
    assert [r["reuse_share"] for r in roomy] == [1.0, 1.0]
    assert roomy[1]["ttft_on_later_p50_ms"] < four["ttft_on_later_p50_ms"]  # pulls beat recomputing the tail


def test_the_reuse_off_phase_neither_pulls_nor_finds_a_cache():
    (row,) = pressure([2], 10_000)
    assert row["ttft_off_later_p50_ms"] > row["ttft_on_later_p50_ms"]


def test_without_a_prefill_prefix_cache_a_turn_pulls_or_recomputes_its_whole_history():
    bare = ts.Simulation(dataclasses.replace(fleet(), prefill_prefix_caching=False), CONSTS, system_tokens=SYSTEM).run(
        [CALIB], [1])
    on = [r for r in bare if r.arm == "on"]
    assert all(r.prefill_cached_tokens == 0 for r in bare)
    assert [r.reused_tokens for r in on] == [0] + [t.history for t in CALIB[1:]]  # every history is pulled whole
    room = math.ceil((PRESSURE[-1].prompt + 95) / 128)
    _, four = pressure([1, 4], room, prefix_caching=False)
    _, cached_four = pressure([1, 4], room)
    assert four["ttft_on_later_p50_ms"] > cached_four["ttft_on_later_p50_ms"]  # refused turns recompute it all


# -- the commands ------------------------------------------------------------------------------------------------

RUNS = Path(__file__).resolve().parents[2] / "bench" / "twin_runs" / "2026-12-06-d"
W7 = ["--levels", "1,2,4,8", "--turns", "12", "--system-words", "200", "--first-user-words", "300", "--turn-words",
      "80", "--max-tokens", "24"]


def test_the_committed_prediction_is_what_the_command_prints(tmp_path):
    """docs/planning.md quotes w7's prediction: the command reproduces it from the committed calibration only."""
    out = tmp_path / "w7.json"
    res = CliRunner().invoke(app, ["plan", "twin", "--state-dir", str(RUNS / "state"), "--constants",
                                   str(RUNS / "sim-constants.json"), *W7, "--out", str(out),
                                   "--measured", str(RUNS / "w7-capacity" / "capacity.json")])
    assert res.exit_code == 0, res.output
    got = json.loads(out.read_text())
    assert got["levels"] == json.loads((RUNS / "w7-predicted.json").read_text())["levels"]
    errors = [c["error"] for c in got["comparison"] if c["error"] is not None]
    assert len(errors) == 16 and sum(abs(e) <= 0.25 for e in errors) == 15


def test_the_commands_refuse_what_they_cannot_use(tmp_path):
    empty = tmp_path / "run"
    empty.mkdir()
    res = CliRunner().invoke(app, ["plan", "twin", "--state-dir", str(RUNS / "state"), "--fit", str(empty)])
    assert res.exit_code == 2 and "records.jsonl" in res.output
    bad = tmp_path / "c.json"
    bad.write_text("[1]")
    res = CliRunner().invoke(app, ["plan", "twin", "--state-dir", str(RUNS / "state"), "--constants", str(bad)])
    assert res.exit_code == 2 and "--fit" in " ".join(res.output.split())
    res = CliRunner().invoke(app, ["plan", "twin-pressure", "--state-dir", str(tmp_path), "--constants", str(bad)])
    assert res.exit_code == 2 and "turnkv plan calibrate" in " ".join(res.output.split())


def test_bench_capacity_records_every_request_under_its_level(monkeypatch, tmp_path):
    """`bench capacity --records`: what `plan twin --fit` reads, each request under the level that played it."""
    from bench import capacity
    from bench.client import Result

    async def sweep(url, workload, levels, stagger, on_result, on_level, **kw):
        done = []
        for level in levels:
            for arm in ("off", "on"):
                for conv in range(level):
                    on_result(Result(conv, 0, arm, ttft_ms=10.0 * level, latency_ms=50.0, completion_tokens=16))
            done.append({"concurrency": level, "off": {"errors": 0}, "on": {"errors": 0}})
            on_level(done)
        return done

    monkeypatch.setattr(capacity, "sweep", sweep)
    monkeypatch.setattr(capacity, "write", lambda levels, out, target, meta: {"levels": levels})
    monkeypatch.setattr(capacity, "markdown", lambda result: "")
    res = CliRunner().invoke(app, ["bench", "capacity", "--concurrency-levels", "1,2", "--records", "--out",
                                   str(tmp_path)])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert [(r["level"], r["arm"], r["conversation"]) for r in rows] == [
        (1, "off", 0), (1, "on", 0), (2, "off", 0), (2, "off", 1), (2, "on", 0), (2, "on", 1)]
    assert all(r["ttft_ms"] == 10.0 * r["level"] and "reply" not in r for r in rows)
    other = tmp_path / "plain"
    other.mkdir()
    plain = CliRunner().invoke(app, ["bench", "capacity", "--concurrency-levels", "1", "--out", str(other)])
    assert plain.exit_code == 0
    assert not (other / "records.jsonl").exists()


def test_a_kv_load_during_a_busy_decode_step_costs_one_more_step():
    loaded = dataclasses.replace(CONSTS, kv_load_step=True)
    assert [r.ttft_ms for r in records([1], loaded)] == [r.ttft_ms for r in records([1])]  # idle decode: no wait
    conv = ts.conversation(2, 50, 50, 50, 64)
    plain = ts.Simulation(fleet(), CONSTS, stagger_s=0.0).run([conv] * 4, [4])
    late = ts.Simulation(fleet(), loaded, stagger_s=0.0).run([conv] * 4, [4])
    assert sum(r.ttft_ms for r in late) > sum(r.ttft_ms for r in plain)
    assert all(b.ttft_ms >= a.ttft_ms - 1e-9 for a, b in zip(plain, late, strict=True) if (a.conv, a.turn, a.arm) == (
        b.conv, b.turn, b.arm))


def _steal_run(consts: ts.SimConstants) -> dict[int, float]:
    """Two one-turn conversations, reuse off, the second sent while prefill computes the first's long prompt."""
    conv = ts.conversation(1, 150, 1000, 150, 16)
    sim = ts.Simulation(fleet(), consts, stagger_s=0.05, system_tokens=SYSTEM)
    return {r.conv: r.ttft_ms for r in sim.run([conv] * 2, [2], arms=("off",))}


def test_a_hop_on_a_busy_core_delays_its_engines_next_step_by_its_own_work():
    shared = dataclasses.replace(CONSTS, hop_shares_core=True, hop_when_sent=True)
    base, steal = _steal_run(shared), _steal_run(dataclasses.replace(shared, hop_steals_step=True))
    work_ms = fleet().prefill.efficiency.request_overhead_s * 1000  # the second turn's prefill hop (no per-token part)
    assert steal[0] == pytest.approx(base[0])  # the first turn's step started before the hop: untouched
    assert steal[1] - base[1] == pytest.approx(work_ms, rel=1e-6)  # the second's own step pays the hop's work
    # without core sharing no hop meets its engine's step loop, so nothing is taken from it
    assert (_steal_run(dataclasses.replace(CONSTS, hop_steals_step=True, hop_when_sent=True))
            == _steal_run(dataclasses.replace(CONSTS, hop_when_sent=True)))
    # one conversation: no hop meets a busy engine
    alone = dataclasses.replace(shared, hop_steals_step=True)
    assert [r.ttft_ms for r in records([1], alone)] == [r.ttft_ms for r in records([1], shared)]


def test_a_hops_share_of_a_step_that_ended_is_not_charged_to_a_later_one():
    sim = ts.Simulation(fleet(), dataclasses.replace(CONSTS, hop_shares_core=True, hop_steals_step=True))
    engine = ts._Engine(busy=True)
    assert sim._hop(engine, 0.01) == pytest.approx(0.02) and engine.debt == pytest.approx(0.01)
    idle = ts._Engine()
    assert sim._hop(idle, 0.01) == pytest.approx(0.01) and idle.debt == 0.0
    # a pressure run with think times: engines idle between turns, so debts are dropped, and every turn still ends
    rows = ts.simulate_pressure(dataclasses.replace(fleet(), prefill_prefix_caching=False),
                                dataclasses.replace(CONSTS, hop_shares_core=True, hop_steals_step=True),
                                PRESSURE, [2, 4], 20, 100 + ts.SYSTEM_EXTRA - 1)
    assert [r["later_turns"] for r in rows] == [6, 12]


def test_a_turn_meets_its_engine_as_it_is_when_the_turn_is_sent():
    shared = dataclasses.replace(CONSTS, hop_shares_core=True)
    short = ts.conversation(1, 20, 50, 20, 4)

    def ttfts(consts: ts.SimConstants) -> dict[int, float]:
        sim = ts.Simulation(fleet(), consts, stagger_s=0.02, system_tokens=20 + ts.SYSTEM_EXTRA - 1)
        return {r.conv: r.ttft_ms for r in sim.run([short] * 2, [2], arms=("off",))}

    # attempt 4 priced both first turns' hops at the phase's start, with prefill idle; sent 20 ms later, the
    # second meets the first's prefill step, so its hop shares the core and ends after that short step
    at_start, when_sent = ttfts(shared), ttfts(dataclasses.replace(shared, hop_when_sent=True))
    assert when_sent[0] == pytest.approx(at_start[0])
    assert when_sent[1] > at_start[1] + 1.0
    # nothing changes without core sharing
    assert ttfts(CONSTS) == ttfts(dataclasses.replace(CONSTS, hop_when_sent=True))


def test_the_committed_pressure_prediction_is_what_attempt_5_prints(tmp_path):
    """docs/planning.md quotes p4's prediction (attempt 5): the command reproduces it from the committed calibration."""
    runs = RUNS.parent / "2026-12-06-e"
    out = tmp_path / "p4.json"
    res = CliRunner().invoke(app, ["plan", "twin-pressure", "--state-dir", str(RUNS / "state"), "--constants",
                                   str(RUNS / "sim-constants.json"), "--levels", "1,2,4,8", "--turns", "4",
                                   "--think-s", "1.5", "--system-words", "60", "--first-user-words", "300",
                                   "--turn-words", "60", "--max-tokens", "32", "--retained-kv-share", "0.015",
                                   "--attempt", "5", "--out", str(out)])
    assert res.exit_code == 0, res.output
    got = json.loads(out.read_text())
    assert got["levels"] == json.loads((runs / "p4-predicted.json").read_text())["levels"]
    assert got["constants"]["hop_steals_step"] and got["constants"]["hop_when_sent"]
