"""The planner's two retention tiers: what the device cache and the host tier hold, the share that fits (reuse
degrades to it, no cliff), and decode nodes sized with the host tier's room."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.unit.test_plan_simulate import WORKLOAD, fleet
from turnkv.plan import closed_form
from turnkv.plan.workload import Workload, sample


def test_tiers_fill_the_device_room_first_then_the_host_and_report_what_fits():
    # 90% of a 100 GiB cache less 30 GiB in use leaves 60 GiB of device room
    assert closed_form.tiers(50, 30, 100, 0) == (50, 0, 1.0)
    assert closed_form.tiers(100, 30, 100, 0) == (60, 0, 0.6)  # no host tier: 60% fits
    assert closed_form.tiers(100, 30, 100, 25) == (60, 25, 0.85)
    assert closed_form.tiers(100, 30, 100, 500) == (60, 40, 1.0)
    assert closed_form.tiers(0, 30, 100, 0) == (0, 0, 1.0)


@pytest.fixture(scope="module")
def workload_turns():
    w = Workload.from_dict(WORKLOAD)
    return w, sample(w, 3000, 1)


def test_reuse_falls_to_the_share_that_fits_and_a_host_tier_restores_it():
    w = Workload.from_dict({**WORKLOAD, "num_clients": 1000})  # 30x the live conversations: one node cannot hold them
    turns = sample(w, 3000, 1)
    crowded = replace(fleet(), prefill_nodes=2, decode_nodes=1)
    device_only = closed_form.evaluate(crowded, w, turns=turns).retention
    with_host = closed_form.evaluate(replace(crowded, host_kv_gib=4096), w, turns=turns).retention
    assert device_only.fits < 1 and device_only.host_gib_per_decode == 0
    assert with_host.fits == 1 and with_host.host_gib_per_decode > 0
    assert with_host.reuse_share == pytest.approx(device_only.reuse_share / device_only.fits)


def test_a_host_tier_needs_no_more_decode_nodes_and_usually_fewer(workload_turns):
    w, turns = workload_turns
    device_only, _ = closed_form.size_fleet(fleet(), w, turns=turns)
    with_host, _ = closed_form.size_fleet(fleet(host_kv_gib=1024), w, turns=turns)
    assert with_host.decode_nodes <= device_only.decode_nodes
    assert with_host.decode_nodes < device_only.decode_nodes or device_only.decode_nodes == 1
