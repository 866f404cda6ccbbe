"""The host tier's allocation and registration plan (issue #37, item 1): a p5en TP-8 decode engine with the deploy
default budget, regions inside the cited EFA limits (``turnkv.fabric_limits``), exact pinned bytes, and the fallback
when the node refuses a registration (a fake NIXL agent that refuses what EFA refuses, at limits lower than cited)."""

from __future__ import annotations

import dataclasses
import os
import random

import pytest

from connector import host_pool_plan as hp
from connector import host_tier
from infra.instances import host_tier_budget_mib
from turnkv import fabric_limits as fl
from turnkv import params

#: A Qwen3-32B-like decode rank at TP 8: 64 layers, K and V registered apart (128 regions), 1 KV head of 128 dims
#: per rank, bf16, 128-token blocks: 32 KiB a block per region, a 4 MiB slot.
P5EN_BLOCK_LENS = [128 * 128 * 2] * 128


class FakeEfaAgent:
    """The registration calls of a NIXL agent over EFA: refuses, as ``fi_mr_reg`` does (ENOMEM), a region over the
    pages or bytes one MR may span, and a registration that would take the NIC's page entries past its budget.
    The limits are the node's, which may be lower than the cited ones the plan assumes."""

    def __init__(self, limits: fl.FabricLimits, page_size: int, pools_sharing_nic: int = 1) -> None:
        self.limits, self.page_size, self.sharing = limits, page_size, pools_sharing_nic
        self.entries = 0  # this pool's page entries on each of its NICs
        self.registered: list[tuple[int, int]] = []
        self.calls = 0

    def get_reg_descs(self, regions, mem_type):
        assert mem_type == "DRAM"
        return [(int(a), int(n)) for a, n, _dev, _name in regions]

    def register_memory(self, descs, backends=None):
        self.calls += 1
        for address, nbytes in descs:
            pages = hp.pages_spanned(address, nbytes, self.page_size)
            if pages > self.limits.max_pages_per_region or nbytes > self.limits.max_region_bytes:
                raise RuntimeError(f"NIXL_ERR_BACKEND: fi_mr_reg({nbytes} bytes, {pages} pages): Cannot allocate "
                                   "memory")
            if (self.entries + pages) * self.sharing > self.limits.page_entries_per_nic:
                raise RuntimeError("NIXL_ERR_BACKEND: fi_mr_reg: Cannot allocate memory (page entries)")
            self.entries += pages
            self.registered.append((address, nbytes))

    def deregister_memory(self, descs):
        for address, nbytes in descs:
            self.registered.remove((address, nbytes))
            self.entries -= hp.pages_spanned(address, nbytes, self.page_size)


def p5en_plans(page_size: int) -> tuple[int, list[hp.PoolPlan]]:
    budget_mib = host_tier_budget_mib("p5en.48xlarge", 8)
    share = hp.rank_share_bytes(budget_mib, 8)
    return budget_mib, [hp.plan_rank(share, P5EN_BLOCK_LENS, page_size, hp.P5EN, fl.EFA_P5EN, rank=r)
                        for r in range(8)]


def test_the_p5en_tp8_default_budget_is_planned_on_hugepages_within_the_cited_limits_pinning_exactly_the_budget():
    budget_mib, plans = p5en_plans(fl.PAGE_2M)
    print(f"\np5en TP-8 decode, host_kv_budget_mib={budget_mib} (deploy default: infra.instances; catalog default "
          f"{params.get('host_kv_budget_mib').default}), 2 MiB pages, limits {fl.EFA_P5EN}")
    for plan in plans:
        print("  " + hp.describe(plan))
    assert budget_mib == 1024 * 1024  # 1 TiB per engine: half of p5en's 2 TiB, one TP-8 engine per node
    for plan in plans:
        assert plan.violations(fl.EFA_P5EN) == []
        assert all(r.nbytes <= fl.EFA_P5EN.max_region_bytes and r.pages <= fl.EFA_P5EN.max_pages_per_region
                   for r in plan.regions)
        assert plan.pool_bytes == plan.allocated_bytes == 128 * fl.GIB  # exact: no rounding up, no tail lost
        assert plan.limited_by == "budget"
        assert plan.numa_node == (0 if plan.rank < 4 else 1)
        assert plan.pages * hp.P5EN.gpus_on(plan.numa_node) <= fl.EFA_P5EN.page_entries_per_nic
    assert sum(p.pool_bytes for p in plans) == budget_mib * fl.MIB


def test_on_regular_pages_regions_stay_under_4_gib_and_the_nic_page_entries_cap_each_rank_loudly():
    budget_mib, plans = p5en_plans(fl.PAGE_4K)
    print(f"\np5en TP-8 decode, host_kv_budget_mib={budget_mib}, 4 KiB pages")
    for plan in plans[:1]:
        print("  " + hp.describe(plan))
    for plan in plans:
        assert plan.violations(fl.EFA_P5EN) == []
        assert max(r.pages for r in plan.regions) <= 1 << 20  # libfabric PR #10402: 1M pages, 4 GB
        assert plan.limited_by == "nic-page-entries"
        # 4 pools share each NUMA node's NICs: 22M entries / 4 of 4 KiB: ~21 GiB each, not 128.
        assert plan.pages * 4 <= fl.EFA_P5EN.page_entries_per_nic
        assert 20 * fl.GIB < plan.pool_bytes < 21 * fl.GIB


def test_pytorch_would_have_pinned_a_power_of_two_and_the_plan_pins_the_exact_size():
    share = 75 * fl.GIB
    plan = hp.plan_rank(share, [4 * fl.MIB], fl.PAGE_2M, hp.NumaLayout.single(2048 * fl.GIB), fl.EFA_P5EN)
    assert plan.pool_bytes == share
    assert 1 << (share - 1).bit_length() == 128 * fl.GIB  # what CachingHostAllocator's PowerOf2Ceil would pin


def test_a_node_that_refuses_the_plan_gets_the_largest_halving_it_registers_and_nothing_stays_registered():
    _, plans = p5en_plans(fl.PAGE_2M)
    plan = plans[5]
    node = fl.FabricLimits("refuses-over-48GiB", 1 << 20, 48 * fl.GIB, fl.EFA_P5EN.page_entries_per_nic, 8)
    agent = FakeEfaAgent(node, fl.PAGE_2M)
    base = 0x7F00_0000_0000

    def attempt(p: hp.PoolPlan) -> None:
        host_tier.register_regions(agent, base, p)

    fitted = hp.fit(plan, attempt, fl.EFA_P5EN)
    print(f"\nfallback, a node refusing regions over 48 GiB: {len(fitted.refused)} refused")
    for refused, error in fitted.refused:
        print(f"  refused: {hp.describe(refused)}: {error}")
    print(f"  granted: {hp.describe(fitted.plan)}")
    assert [p.pool_bytes for p, _ in fitted.refused] == [128 * fl.GIB, 64 * fl.GIB]
    assert fitted.plan is not None and fitted.plan.limited_by == "shrunk"
    assert fitted.granted_bytes == 32 * fl.GIB
    assert agent.registered == [(base + r.offset, r.nbytes) for r in fitted.plan.regions]  # only the granted plan's


def test_a_node_that_refuses_everything_runs_without_the_tier():
    _, plans = p5en_plans(fl.PAGE_4K)
    agent = FakeEfaAgent(fl.FabricLimits("refuses-all", 1 << 20, 1 * fl.MIB, 10, 8), fl.PAGE_4K)
    fitted = hp.fit(plans[0], lambda p: host_tier.register_regions(agent, 0x1000_0000, p), fl.EFA_P5EN)
    assert fitted.plan is None and fitted.granted_bytes == 0
    assert fitted.refused and all(p.pool_bytes >= hp.MIN_POOL_BYTES for p, _ in fitted.refused)
    assert agent.registered == [] and agent.entries == 0


def test_a_node_with_fewer_page_entries_than_cited_shrinks_until_they_fit():
    _, plans = p5en_plans(fl.PAGE_4K)
    node = fl.FabricLimits("fewer-entries", 1 << 20, fl.EFA_P5EN.max_region_bytes, 8_000_000, 8)
    agent = FakeEfaAgent(node, fl.PAGE_4K, pools_sharing_nic=4)
    fitted = hp.fit(plans[0], lambda p: host_tier.register_regions(agent, 0x2000_0000, p), fl.EFA_P5EN)
    assert fitted.plan is not None and fitted.plan.pages * 4 <= 8_000_000
    assert agent.entries == fitted.plan.pages


@pytest.mark.parametrize("seed", range(20))
def test_every_slot_of_every_layer_region_lies_in_one_registered_region(seed):
    rng = random.Random(seed)
    lens = [rng.choice([512, 4096, 32768, 65536, 656 * 64]) for _ in range(rng.randint(1, 40))]
    blocks = rng.randint(1, 3000)
    page = rng.choice([fl.PAGE_4K, fl.PAGE_2M])
    limits = fl.FabricLimits("small", rng.randint(20, 400), rng.randint(70_000, 20_000_000), 1 << 40, 1)
    try:
        regions = hp.cut_regions(blocks, lens, page, limits)
    except ValueError:
        assert any(length > limits.max_region_bytes or length > (limits.max_pages_per_region - 1) * page
                   for length in lens)
        return
    assert [r.offset for r in regions] == sorted(r.offset for r in regions)
    assert sum(r.nbytes for r in regions) == blocks * sum(lens)
    for r in regions:
        assert r.nbytes <= limits.max_region_bytes and r.pages <= limits.max_pages_per_region
    edges = {r.offset for r in regions} | {r.offset + r.nbytes for r in regions}
    for base, length in zip(hp.region_bases(blocks, lens), lens, strict=True):
        for edge in edges:
            if base < edge < base + blocks * length:
                assert (edge - base) % length == 0  # a cut inside a layer region falls between slots


def test_the_numa_layout_is_read_from_sys(tmp_path):
    for node, gib in ((0, 1024), (1, 1024)):
        d = tmp_path / "devices/system/node" / f"node{node}"
        (d / "hugepages/hugepages-2048kB").mkdir(parents=True)
        (d / "meminfo").write_text(f"Node {node} MemTotal:       {gib * 1024 * 1024} kB\nNode {node} MemFree: 1 kB\n")
        (d / "hugepages/hugepages-2048kB/free_hugepages").write_text("70000\n" if node == 1 else "0\n")
    pci = [f"0000:{bus:02x}:00.0" for bus in (0x53, 0x64, 0x75, 0x86, 0x97, 0xa8, 0xb9, 0xca)]
    for i, address in enumerate(pci):
        d = tmp_path / "bus/pci/devices" / address
        d.mkdir(parents=True)
        (d / "numa_node").write_text("0\n" if i < 4 else "1\n")
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text("MemTotal:  2113929216 kB\nMemAvailable:  2000000000 kB\n")
    layout = host_tier.numa_layout(pci, str(tmp_path))
    assert layout == hp.P5EN
    # every GPU of the host counts as a pool to come, whichever this engine sees (CUDA_VISIBLE_DEVICES)
    for address in pci:
        (tmp_path / "bus/pci/devices" / address / "vendor").write_text("0x10de\n")
        (tmp_path / "bus/pci/devices" / address / "class").write_text("0x030200\n")
    nic = tmp_path / "bus/pci/devices/0000:e0:00.0"
    nic.mkdir()
    (nic / "vendor").write_text("0x1d0f\n")  # an EFA NIC: not a GPU
    (nic / "class").write_text("0x020000\n")
    assert host_tier.host_gpu_count(str(tmp_path)) == 8
    assert host_tier.host_available_bytes(str(tmp_path / "proc")) == 2000000000 * 1024
    assert host_tier.free_hugepages(1, str(tmp_path)) == 70000 and host_tier.free_hugepages(0, str(tmp_path)) == 0
    assert hp.page_size_for(70000, 128 * fl.GIB) == fl.PAGE_2M and hp.page_size_for(0, 128 * fl.GIB) == fl.PAGE_4K


def test_an_exact_size_host_buffer_is_bound_to_its_numa_node_without_rounding():
    buffer = host_tier.HostBuffer(3 * fl.MIB + 4096, fl.PAGE_4K, numa_node=0, pin=False)
    try:
        assert buffer.tensor.numel() == 3 * fl.MIB + 4096
        assert buffer.base % fl.PAGE_4K == 0
        assert buffer.numa_bound  # mbind on node 0 (every Linux host has one)
        buffer.tensor[-1] = 7
        assert int(buffer.tensor[-1]) == 7
    finally:
        buffer.close()


def test_runs_pair_consecutive_blocks_with_consecutive_slots():
    assert host_tier.runs([4, 5, 6, 9, 10, 2], [0, 1, 2, 3, 4, 9]) == [(4, 0, 3), (9, 3, 2), (2, 9, 1)]
    assert host_tier.runs([], []) == []


def test_a_configured_pool_below_the_shrink_floor_is_tried_as_configured_once():
    plan = hp.plan_rank(64 * fl.MIB, [4096] * 4, fl.PAGE_4K, hp.NumaLayout.single(1 << 40), fl.UNLIMITED)
    tried: list[int] = []
    assert hp.fit(plan, lambda p: tried.append(p.pool_bytes), fl.UNLIMITED).granted_bytes == 64 * fl.MIB
    refused: list[int] = []

    def refuse(p: hp.PoolPlan) -> None:
        refused.append(p.pool_bytes)
        raise MemoryError("no")

    assert hp.fit(plan, refuse, fl.UNLIMITED).plan is None and refused == [64 * fl.MIB]


def test_a_budget_the_host_cannot_back_is_capped_by_the_room_the_host_has_past_the_headroom():
    """issue #51 item 3: `--set host_kv_budget_mib=4000000` on a 24 GiB machine grew decode to 19.6 GB and the OOM
    killer ended it (the cap was 75% of MemTotal). Now 75% of MemAvailable past max(4 GiB, 10%), less other pools."""
    budget = params.get("host_kv_budget_mib").parse(4_000_000)
    room = hp.host_room(14 * fl.GIB, 24 * fl.GIB, 1, [])
    assert room == int(10 * fl.GIB * hp.NODE_SHARE)
    layout = hp.NumaLayout.single(24 * fl.GIB, 1, room)
    plan = hp.plan_rank(hp.rank_share_bytes(budget, 1), [64 * 1024], fl.PAGE_4K, layout, fl.UNLIMITED)
    assert plan.limited_by == "host-available" and plan.pool_bytes <= room < plan.pool_bytes + plan.slot_bytes
    assert "host-available" in hp.describe(plan)
    # Nothing past the headroom: no pool (the engine serves without the tier, loudly).
    assert hp.host_room(3 * fl.GIB, 24 * fl.GIB, 1, []) == 0


def test_pools_planned_together_split_the_room_and_a_late_one_gets_what_is_left_never_more():
    total, pools = 2048 * fl.GIB, 8
    first = hp.host_room(1900 * fl.GIB, total, pools, [])
    assert first == int((1900 - 204.8) * fl.GIB * hp.NODE_SHARE) // 8
    # Seven engines planned at once (claims not yet out of MemAvailable): the eighth gets the same share.
    planned = [hp.Claim(first, allocated=False)] * 7
    assert abs(hp.host_room(1900 * fl.GIB, total, pools, planned) - first) <= 8
    # The same seven allocated (MemAvailable fell by their bytes): still the same share, not 1/8 of what is left.
    allocated = [hp.Claim(first, allocated=True)] * 7
    assert abs(hp.host_room(1900 * fl.GIB - 7 * first, total, pools, allocated) - first) <= 8
    # Seven pools took far more than their share (another budget, an operator's): the last gets the rest, or none.
    greedy = [hp.Claim(200 * fl.GIB, allocated=True)] * 7
    assert hp.host_room(500 * fl.GIB, total, pools, greedy) == 0


def test_a_p5en_with_its_memory_available_keeps_the_deploy_default_budget():
    """The deploy default (half the host over the node's engines) fits a fresh p5en's room, every rank of 8."""
    budget = host_tier_budget_mib("p5en.48xlarge", 8)
    room = hp.host_room(1900 * fl.GIB, 2048 * fl.GIB, 8, [])
    layout = dataclasses.replace(hp.P5EN, room_bytes=room)
    plan = hp.plan_rank(hp.rank_share_bytes(budget, 8), P5EN_BLOCK_LENS, fl.PAGE_2M, layout, fl.EFA_P5EN)
    assert plan.limited_by == "budget" and plan.pool_bytes + plan.slot_bytes > hp.rank_share_bytes(budget, 8)


def test_the_hosts_ledger_splits_room_between_processes_and_forgets_the_dead(tmp_path):
    """Two engines' ranks (two processes) reserve on one host; a dead one's claim is dropped on the next read."""
    from connector.host_ledger import HostLedger

    path = tmp_path / "ledger.json"
    dead = HostLedger(path, pid=2**22 + 12345)  # above any pid_max: never alive
    mine = HostLedger(path)
    avail, total = 20 * fl.GIB, 24 * fl.GIB
    dead.settle(8 * fl.GIB)
    assert dead.pid not in mine.claims()  # a claim of a process that is not alive is not counted
    rooms: list[int | None] = []
    claimed = mine.reserve(2, total, avail, lambda room: rooms.append(room) or min(room, 3 * fl.GIB))
    assert rooms == [hp.host_room(avail, total, 2, [])] and claimed == 3 * fl.GIB
    assert mine.claims() == {mine.pid: hp.Claim(3 * fl.GIB, allocated=False)}
    other = HostLedger(path, pid=os.getppid())  # alive: another engine on this host
    other.reserve(2, total, avail, lambda room: rooms.append(room) or room)
    assert rooms[-1] == hp.host_room(avail, total, 2, [hp.Claim(3 * fl.GIB, False)])
    mine.settle(2 * fl.GIB)
    assert mine.claims()[mine.pid] == hp.Claim(2 * fl.GIB, allocated=True)
    mine.settle(0)
    assert mine.pid not in mine.claims()
    assert HostLedger(path).reserve(1, total, None, lambda room: 7 if room is None else 0) == 7
