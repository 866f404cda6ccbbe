"""Decode's retention shared among tenants (issue 38, item 4, retention half): the retain request names the tenant
(``turnkv.wire.TENANT``), room is shared max-min among the tenants that want it, and idle is measured per tenant
above a floor, so one tenant cannot take the whole tier or make everyone else's turns idle (no engines)."""

from __future__ import annotations

import time

import pytest

from connector.retention import Held, ReadDelays, RetentionLedger, Tier, fair_shares
from tests.unit.test_wire import RETAIN, _request, _step, scheduler  # noqa: F401
from turnkv import params, wire


def test_fair_shares_are_max_min_a_lone_tenant_gets_everything_and_small_demands_are_met_in_full():
    assert fair_shares({"a": 100}, 60) == {"a": 60}
    assert fair_shares({"a": 30}, 60) == {"a": 30}
    assert fair_shares({"a": 100, "b": 100}, 60) == {"a": 30, "b": 30}
    assert fair_shares({"a": 100, "b": 10, "c": 100}, 60) == {"b": 10, "a": 25, "c": 25}
    assert fair_shares({}, 60) == {}


def _tenant(blocks: int, tenant: str, since: float) -> Held:
    return Held(blocks, 1e12, Tier.DEVICE, since, tenant=tenant)


def test_a_tenant_under_its_share_gets_room_from_the_tenant_furthest_over_its_share_oldest_first():
    """Heavy tenant A fills the tier with turns still likely to be read (none idle); B's newcomer is under its
    fair share, so A's oldest turns go, only down to A's share. Before tenants, B was refused and nothing moved."""
    ledger = RetentionLedger()
    for i in range(6):
        ledger.hold(f"a{i}", _tenant(2, "A", since=100.0 + i))
    placement = ledger.place(2, 110.0, device_room=12, host_room=0, idle_after=600, tenant="B")
    assert placement.tier is None and [rid for rid, _ in placement.evicted] == ["a0"]  # room after the grace
    # A itself, at or over its share, gets no room from B (B holds less than its share) nor from its own fresh turns
    ledger.release("a0")
    ledger.hold("b0", _tenant(2, "B", since=111.0))  # A 10 blocks, B 2: the tier is full
    assert ledger.place(2, 113.0, 12, 0, 600, tenant="A").evicted == []
    # B keeps getting room from A until both hold their share (6 blocks each), then nothing is taken
    for i, rid in enumerate(("a1", "a2")):
        assert [r for r, _ in ledger.place(2, 113.0, 12, 0, 600, tenant="B").evicted] == [rid]
        ledger.release(rid)
        ledger.hold(f"b{i + 1}", _tenant(2, "B", since=114.0 + i))
    assert ledger.held_by_tenant(Tier.DEVICE) == {"A": 6, "B": 6}
    assert ledger.place(2, 116.0, 12, 0, 600, tenant="B").evicted == []
    assert ledger.place(2, 116.0, 12, 0, 600, tenant="A").evicted == []


def test_a_lone_tenant_keeps_todays_no_cliff_behaviour():
    ledger = RetentionLedger()
    for i in range(3):
        ledger.hold(f"a{i}", _tenant(2, "A", since=100.0 + i))
    placement = ledger.place(2, 110.0, device_room=6, host_room=0, idle_after=600, tenant="A")
    assert placement.tier is None and placement.evicted == []  # nothing idle, no other tenant: refused, as before


def test_idle_is_measured_per_tenant_above_the_floor():
    delays = ReadDelays()
    for _ in range(20):
        delays.observe(0.2, "fast")  # a tenant whose turns are read within 200 ms
    for _ in range(20):
        delays.observe(40.0, "slow")
    assert delays.idle_after(0, 480, "fast", floor=10) == 10  # not 1 s: the floor
    assert delays.idle_after(0, 480, "slow", floor=10) == 80
    assert delays.idle_after(0, 480, "new", floor=10) == 480  # no reads of its own yet: the TTL
    assert delays.idle_after(0, 480, "fast", floor=0) == 1.0
    assert delays.idle_after(30, 480, "fast", floor=10) == 30  # a configured retention_idle_evict wins
    assert params.BY_NAME["retention_idle_floor"].default == 10


def test_one_tenant_reading_fast_does_not_make_another_tenants_turns_idle():
    """Before: one ReadDelays for all, so the fast tenant's 200 ms reads made idle_after 1 s and a newcomer evicted
    the slow tenant's turn, unread for 5 s (a tool call)."""
    ledger, delays = RetentionLedger(), ReadDelays()
    for _ in range(20):
        delays.observe(0.2, "fast")
    ledger.hold("slow-turn", _tenant(4, "slow", since=100.0))
    ledger.hold("fast-turn", _tenant(2, "fast", since=103.0))

    def idle_after(tenant):
        return delays.idle_after(0, 480, tenant, floor=10)

    placement = ledger.place(2, 105.0, device_room=6, host_room=0, idle_after=idle_after, tenant="fast")
    assert placement.evicted == [] and "slow-turn" in ledger.live
    # 12 s later the fast tenant's own unread turn is idle (past the floor); the slow tenant's still is not
    placement = ledger.place(2, 116.0, 6, 0, idle_after, tenant="fast")
    assert [rid for rid, _ in placement.evicted] == ["fast-turn"]


def test_decode_takes_the_tenant_from_the_retain_request_and_shares_its_room(scheduler):  # noqa: F811
    decode = scheduler()
    decode._retained_share = 0.06  # 6 of 100 blocks
    tokens = list(range(300))
    a = [decode.request_finished(_request(f"a{i}", tokens, {**RETAIN, wire.TENANT: "A"}), [[3 * i, 3 * i + 1,
                                                                                             3 * i + 2]])[1]
         for i in range(2)]
    assert all(o[wire.TENANT] == "A" for o in a) and decode._retained.live["a0"].tenant == "A"
    delay, b = decode.request_finished(_request("b0", tokens, {**RETAIN, wire.TENANT: "B"}), [[6, 7, 8]])
    assert not delay and b is None  # no room now: A's oldest turn is announced for B's next one
    assert list(_step(decode).turnkv_evict) == ["a0"]
    assert decode.turnkv_stats.data["turnkv_retention_evicted"] == [1]


@pytest.mark.parametrize("floor", [0.0, 10.0])
def test_the_floor_is_reloadable_and_reaches_the_ledger(scheduler, floor):  # noqa: F811
    decode = scheduler()
    decode._apply_tunables({"retention_idle_floor": floor})
    for _ in range(10):
        decode._read_delays.observe(0.1, "A")
    decode._retained_share = 0.03
    decode.request_finished(_request("a0", range(300), {**RETAIN, wire.TENANT: "A"}), [[1, 2, 3]])
    decode._retained.live["a0"].since = time.time() - 5  # unread for 5 s
    decode.request_finished(_request("a1", range(300), {**RETAIN, wire.TENANT: "A"}), [[4, 5, 6]])
    assert ("a0" in _step(decode).turnkv_evict) is (floor < 5)
