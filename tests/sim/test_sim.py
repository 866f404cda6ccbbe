"""The schedule simulation (issue #50): its oracle and fabric on their own, replay, and the seeded runs.

``TURNKV_SIM_SCHEDULES`` sets how many seeds the default run takes (2000); ``TURNKV_SIM_SEED`` (and
``TURNKV_SIM_SCENARIO``) the seed ``-k replay`` replays with its trace (``pytest tests/sim -k replay -s``).
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")

from importlib.metadata import version

from packaging.version import Version

if Version(version("vllm")).release < (0, 32):  # the stand-ins model vLLM 0.32's NIXL connector
    pytest.skip("the simulation models vLLM 0.32's NIXL connector", allow_module_level=True)

from tests.sim.fabric import BLOCK_LEN, REGIONS, AgentView, Fabric, Memory
from tests.sim.model import Label, block_fault, block_labels
from tests.sim.runner import Summary, report, run_many, run_one

SCHEDULES = int(os.environ.get("TURNKV_SIM_SCHEDULES", "2000"))

# What each zero-violation run proves fixed (issue #50); each failed on 3717d72 (tests/sim/README.md, the seeds).
HOST_DEFECT = ("a host-tier offer the cost model declines at its first look, then allocated at a later one, is never "
               "read (from decode's device blocks at the host pool's slot numbers): connector.admission")
SPEC_DEFECT = ("with speculative decoding an offer naming its lookahead blocks is cut to the blocks its tokens fill "
               "before upstream end-trims decode's block list: connector.scheduler._names_spare_blocks")
STALL_DEFECT = ("a READ that ends after decode may have freed its blocks (its deadline plus expiry_skew_margin) is "
                "recomputed; an inline one past the wait limit is released before it is failed: ReadPlan.safe_until")


# the oracle and the fabric alone -------------------------------------------------------------------------------


def test_the_oracle_accepts_a_requests_own_prefix_and_names_every_other_content():
    prompt = [11, 12, 13, 14, 15, 16]
    own = block_labels("t0", "c0", "d1", 0, [*prompt, 17, 18])
    assert [block_fault(label, "t0", prompt, 0, i, 6) for i, label in enumerate(own)] == [None, None]
    assert block_fault(None, "t0", prompt, 0, 0, 6) == "unwritten block"
    assert block_fault(own[0], "t1", prompt, 0, 0, 6) == "tenant t0's KV"
    assert block_fault(own[0], "t0", prompt, 1, 0, 6) == "rank 0's KV on rank 1"
    assert block_fault(own[1], "t0", prompt, 0, 0, 6) == "positions 4.. where 0.. belong"
    other = Label("t0", "c9", "d2", 0, 4, (15, 99, 17, 18))
    assert block_fault(other, "t0", prompt, 0, 1, 6) == "other tokens (c9's)"
    assert block_fault(other, "t0", prompt, 0, 1, 5) is None  # only the tokens computed on count
    short = Label("t0", "c0", "d1", 0, 4, (15,))
    assert block_fault(short, "t0", prompt, 0, 1, 6) == "too few tokens"


def _fabric() -> tuple[Fabric, list[float], Memory, Memory, AgentView]:
    now = [0.0]
    fabric = Fabric(lambda: now[0], lambda _: None)
    source = Memory("decode", "device", 8, 0x1000_0000, lambda: now[0])
    local = Memory("prefill", "device", 8, 0x2000_0000, lambda: now[0])
    fabric.register("decode", source)
    fabric.register("prefill", local)
    view = AgentView(fabric, "prefill", local)
    view.add_remote_agent("decode")
    return fabric, now, source, local, view


def test_a_read_lands_what_its_source_held_when_it_ended_and_notifies_the_source():
    fabric, now, source, local, view = _fabric()
    before, after = Label("t0", "c0", "d1", 0, 0, (1,)), Label("t1", "c1", "d2", 0, 0, (2,))
    source.write(3, before)
    remote = view.prep_xfer_dlist("decode", view.get_xfer_descs((source.region_bases(), 8), "VRAM"))
    handle = view.make_prepped_xfer("READ", fabric.local_list(local), [5, 13], remote, [3, 11], b"d1:1", tag="p1")
    now[0] = 0.5
    source.write(3, after)  # rewritten long after the READ ended (its latency: 4 ms)
    assert view.check_xfer_state(handle) == "DONE"
    assert local.labels[5] == before and not fabric.copy_faults
    assert fabric.take_notifs("decode") == {"prefill": [b"d1:1"]}


def test_descriptor_ids_laid_out_with_another_count_than_the_memorys_are_a_layout_fault():
    fabric, now, source, local, view = _fabric()
    remote = view.prep_xfer_dlist("decode", view.get_xfer_descs((source.region_bases(), 8), "VRAM"))
    wrong = 6  # region 1 of block 2 as a reader believing 6 blocks per region would address it
    handle = view.make_prepped_xfer("READ", fabric.local_list(local), [2, 8 + 2], remote, [2, wrong + 2], b"")
    now[0] = 1.0
    view.check_xfer_state(handle)
    assert len(fabric.copy_faults) == 1 and "region 1 block 0" in fabric.copy_faults[0][1]
    assert "(region 0 read block 2)" in fabric.copy_faults[0][1]
    assert REGIONS == 2 and BLOCK_LEN > 0


def test_a_pool_is_only_read_where_it_is_registered_and_as_what_it_is():
    fabric, _, source, _, view = _fabric()
    pool = Memory("decode/pool", "host", 4, 0x7F00_0000, lambda: 0.0)
    fabric.register("decode", pool)
    assert fabric.lists[view.prep_xfer_dlist("decode", ((pool.region_bases(), 4), "DRAM"))].memory is pool
    with pytest.raises(RuntimeError, match="NOT_FOUND"):
        view.prep_xfer_dlist("decode", ((pool.region_bases(), 4), "VRAM"))  # host memory is no device memory
    with pytest.raises(RuntimeError, match="NOT_FOUND"):
        view.prep_xfer_dlist("decode", ((source.region_bases(), 9), "VRAM"))  # past the registered cache


# replay ----------------------------------------------------------------------------------------------------------


def test_a_seed_replays_its_schedule_exactly():
    first, again = run_one(17, trace=True), run_one(17, trace=True)
    assert first.trace == again.trace and first.stats == again.stats
    assert len(first.trace) > 50 and first.stats["prefills"] > 0


def test_replay(capsys):
    """``TURNKV_SIM_SEED=N pytest tests/sim -k replay -s``: seed N's trace (the first violation's story if any)."""
    seed = int(os.environ.get("TURNKV_SIM_SEED", "1"))
    scenario = os.environ.get("TURNKV_SIM_SCENARIO", "default")
    text = report(seed, os.environ.get("TURNKV_SIM_WHOLE") == "1", scenario)
    if "TURNKV_SIM_SEED" in os.environ:
        with capsys.disabled():
            print(f"\n{text}")
    assert "VIOLATION" not in text, f"seed {seed} ({scenario}) broke a promise; its story is above"
    assert text.startswith(f"seed {seed} ({scenario}): no violation") and "prefill computed" in text


# the seeded runs ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_run() -> Summary:
    return run_many(range(SCHEDULES))


def _verdict(summary: Summary, scenario: str) -> str:
    seed = next(iter(summary.failing))
    return (f"{len(summary.failing)} failing seeds, first {seed}: {summary.failing[seed][0]}\n"
            f"replay: python -m tests.sim --scenario {scenario} --seed {seed} --trace\n"
            + report(seed, False, scenario))


def test_the_default_schedules_exercise_every_path_they_search(default_run: Summary, capsys):
    """Not vacuous: the run reads both tiers, inline and async, copies to the host tier, evicts, forks, restarts,
    and prefill refuses late and expired offers. Prints the rate."""
    with capsys.disabled():
        print(f"\nschedule simulation (default): {default_run.describe()}")
    stats = default_run.stats
    for path in ("reads_device", "reads_host", "inline", "to_host", "evict", "forkable", "forks", "restarts",
                 "verdict_ok", "verdict_late", "verdict_expired", "replays_host", "reused_tokens"):
        assert stats[path] > 0, path
    assert default_run.schedules == SCHEDULES


def test_no_default_schedule_reads_another_requests_kv(default_run: Summary):
    """No default schedule computes on KV that is not its own (HOST_DEFECT: the path 3717d72 failed on)."""
    assert not default_run.failing, _verdict(default_run, "default")


def test_no_schedule_with_speculative_decoding_reads_another_requests_kv():
    """Nor with speculative decoding's lookahead blocks (SPEC_DEFECT)."""
    summary = run_many(range(300), scenario="spec", stop_after=1)  # most seeds past 0 fail on 3717d72
    assert not summary.failing, _verdict(summary, "spec")


def test_no_schedule_with_stalled_reads_reads_another_requests_kv():
    """Nor with READs that stall past decode's free (STALL_DEFECT)."""
    summary = run_many(range(1700, 1800), scenario="stall", stop_after=1)  # 1774 stalls on 3717d72
    assert not summary.failing, _verdict(summary, "stall")
