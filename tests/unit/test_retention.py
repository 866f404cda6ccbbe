"""Decode's retained turns above retained_kv_share: oldest evicted first, announced on the engine's evictions
feed, freed after the grace; the router's view of the feed (no engines)."""

from __future__ import annotations

import time
import types

import pytest

from connector.retention import Held, HostSlots, ReadDelays, Refusal, RetentionLedger, Tier
from router.engines.evictions import HOST_COPY_PENDING, EvictionFeed, max_age
from turnkv import params


def _held(blocks: int, since: float = 0.0, tier: Tier = Tier.DEVICE, slots: tuple[int, ...] = ()) -> Held:
    return Held(blocks, 1e12, tier, since, slots)


def test_a_turn_goes_to_the_device_then_the_host_tier_and_host_slots_come_back_when_freed():
    ledger = RetentionLedger(host=HostSlots(5))
    first = ledger.place(3, 0.0, device_room=4, host_room=5, idle_after=60)
    assert first.tier is Tier.DEVICE and not first.slots
    ledger.hold("a", _held(3))
    second = ledger.place(3, 0.0, 4, 5, 60)  # 3 + 3 > 4 on the device: the host's first free slots
    assert second.tier is Tier.HOST and second.slots == (0, 1, 2) and ledger.host.free == 2
    ledger.hold("b", _held(3, tier=Tier.HOST, slots=second.slots))
    assert ledger.used(Tier.DEVICE) == 3 and ledger.used(Tier.HOST) == 3 and ledger.blocks == 6
    assert ledger.count(Tier.HOST) == 1
    assert ledger.release("b").tier is Tier.HOST and ledger.host.free == 5
    assert ledger.place(6, 0.0, 4, 5, 60).refusal is Refusal.TOO_LARGE  # larger than either tier
    assert ledger.place(3, 0.0, 4, 5, 60, host_ok=False).refusal is Refusal.FULL  # e.g. several KV cache groups


def test_when_every_tier_is_full_the_newcomer_is_refused_and_only_idle_turns_are_evicted():
    ledger = RetentionLedger()
    for rid, since in (("a", 0.0), ("b", 50.0)):
        ledger.hold(rid, _held(2, since))
    busy = ledger.place(2, 60.0, device_room=4, host_room=0, idle_after=30)
    # a (idle 60 s) goes for the newcomer's sake, b (idle 10 s) stays; the newcomer waits for a's grace
    assert busy.tier is None and busy.refusal is Refusal.FULL and [rid for rid, _ in busy.evicted] == ["a"]
    assert list(ledger.live) == ["b"] and list(ledger.evicting) == ["a"] and ledger.used(Tier.DEVICE) == 4
    assert ledger.place(2, 61.0, 4, 0, 30).evicted == []  # a still holds its room until freed; b is not idle
    ledger.touch("b", 100.0)  # a renewed lease: wanted again
    assert ledger.place(2, 120.0, 4, 0, 30).evicted == []
    ledger.release("a")
    assert ledger.place(2, 121.0, 4, 0, 30).tier is Tier.DEVICE


def test_a_lowered_bound_evicts_the_oldest_turns_of_that_tier_only():
    ledger = RetentionLedger(host=HostSlots(8))
    for rid in "abc":
        ledger.hold(rid, _held(2))
    ledger.hold("h", _held(2, tier=Tier.HOST, slots=(0, 1)))
    assert [rid for rid, _ in ledger.shrink(Tier.DEVICE, 3)] == ["a", "b"] and list(ledger.live) == ["c", "h"]
    assert ledger.shrink(Tier.HOST, 2) == []


def test_idle_after_follows_the_waits_seen_and_the_configured_value_wins():
    delays = ReadDelays(min_samples=8)
    assert delays.idle_after(0, ttl=480) == 480  # too few reads seen: only the TTL frees turns
    for seconds in (30, 31, 32, 33, 34, 35, 36, 40, 60, 38):
        delays.observe(seconds)
    assert delays.p90() == 60 and delays.idle_after(0, ttl=480) == 120 and delays.idle_after(0, ttl=90) == 90
    assert delays.idle_after(45, ttl=480) == 45


def _cyclic_reuse(policy: str, live: int, room_turns: int, rounds: int = 12) -> float:
    """Share of later turns that find their previous turn retained: ``live`` conversations coming back in turn
    (each turn 1 block), ``room_turns`` blocks of room, no host tier. ``lru``: the old oldest-first eviction."""
    ledger, hits, later, now = RetentionLedger(), 0, 0, 0.0
    grace, think = 30.0, 35.0
    pending: list[tuple[float, str]] = []  # evicting turns and when they free
    for r in range(rounds):
        for c in range(live):
            now = r * think + c * think / live
            for at, rid in [p for p in pending if p[0] <= now]:
                ledger.release(rid)
                pending.remove((at, rid))
            prev = f"{c}-{r - 1}"
            if r > 0:
                later += 1
                if prev in ledger.live:
                    hits += 1
                    ledger.release(prev)
            if policy == "lru":
                over = ledger.blocks + 1 - room_turns
                for rid in list(ledger.live)[:max(0, over)]:
                    ledger.announce(rid)
                    pending.append((now + grace, rid))
                ledger.hold(f"{c}-{r}", _held(1, now))
                continue
            placed = ledger.place(1, now, room_turns, 0, idle_after=2 * think)
            for rid, _ in placed.evicted:
                pending.append((now + grace, rid))
            if placed.tier is not None:
                ledger.hold(f"{c}-{r}", _held(1, now))
    return hits / later


def test_no_cliff_reuse_stays_near_the_share_that_fits_where_oldest_first_collapses():
    # A third of the live conversations fit: oldest-first evicts exactly the turn needed next.
    assert _cyclic_reuse("lru", live=15, room_turns=5) < 0.1
    kept = _cyclic_reuse("keep", live=15, room_turns=5)
    assert kept >= 5 / 15 * 0.9, kept
    assert _cyclic_reuse("keep", live=5, room_turns=5) == 1.0  # everything fits: every later turn reuses


@pytest.fixture
def worker(monkeypatch):
    pytest.importorskip("vllm")
    from connector.worker import TurnkvWorkerMixin

    class Base:
        def __init__(self, *args, **kwargs):
            self._reqs_to_send: dict[str, float] = {}

    class Worker(TurnkvWorkerMixin, Base):
        pass

    w = Worker()
    import vllm.distributed.kv_transfer as kv_transfer

    monkeypatch.setattr(kv_transfer, "get_kv_transfer_group", lambda: types.SimpleNamespace(connector_worker=w))
    return w


def test_an_evicted_turn_is_announced_its_lease_cut_to_the_grace_and_never_renewed(worker):
    from connector.leases import evictions_on_worker, merge_feeds, renew_on_worker

    now, wall = time.perf_counter(), time.time()
    worker._reqs_to_send.update(a=now + 400, b=now + 400)
    worker.turnkv_evict({"a": (30.0, wall + 300)})
    assert worker._reqs_to_send["a"] <= time.perf_counter() + 30 and worker._reqs_to_send["b"] > now + 399
    # announced until the later of the offer's expiry and the lease (renewed meanwhile to ~400 s)
    feed = evictions_on_worker(None, 0)
    [[rid, until]] = feed["evicted"]
    assert rid == "a" and until == pytest.approx(wall + 400, abs=2) and feed["seq"] == 1
    assert evictions_on_worker(None, 1)["evicted"] == [] and evictions_on_worker(None, 1)["seq"] == 1
    assert renew_on_worker(None, ["a", "b"], 600) == {"b": pytest.approx(time.perf_counter() + 600, abs=2)}
    worker.turnkv_evict({"gone": (30.0, wall - 1)})  # its offer has expired anyway: nothing to announce
    assert [e[0] for e in evictions_on_worker(None, 0)["evicted"]] == ["a"]
    # ranks a step apart: every announcement, and the lowest number so the next read misses none
    merged = merge_feeds([{"epoch": "x", "seq": 2, "evicted": [["a", 5.0], ["b", 6.0]]},
                          {"epoch": "y", "seq": 1, "evicted": [["a", 5.0]]}])
    assert merged == {"epoch": "x-y", "seq": 1, "evicted": [["a", 5.0], ["b", 6.0]], "hosted": [], "seals": False,
                      "sealed": []}
    # a host-tier copy counts as done once every rank made its share (and not once announced as evicted)
    merged = merge_feeds([{"epoch": "x", "seq": 0, "evicted": [], "hosted": [["h", 9.0], ["k", 9.0], ["e", 9.0]]},
                          {"epoch": "y", "seq": 0, "evicted": [["e", 9.0]], "hosted": [["h", 8.0], ["e", 9.0]]}])
    assert merged["hosted"] == [["h", 8.0]]


def test_a_renewed_lease_is_reported_to_the_scheduler_and_hosted_turns_are_listed_on_the_feed(worker):
    from connector.leases import evictions_on_worker, renew_on_worker

    now, wall = time.perf_counter(), time.time()
    worker._reqs_to_send.update(a=now + 100)
    renew_on_worker(None, ["a", "nope"], 300)
    assert worker.build_turnkv_meta().renewed == ["a"]
    worker._turnkv_hosted["a"] = wall + 300
    assert evictions_on_worker(None, 0)["hosted"] == [["a", wall + 300]]
    worker.turnkv_evict({"a": (30.0, wall + 300)})  # evicted: no longer offered as hosted
    assert evictions_on_worker(None, 0)["hosted"] == []


def test_the_router_refuses_announced_offers_and_every_offer_of_a_feed_gone_quiet():
    feed = EvictionFeed()
    assert feed.refuses("a", 100.0, 1.0) == "evictions feed not read yet"  # a router just started
    feed.apply({"epoch": "e1", "seq": 2, "evicted": [["a", 500.0], ["old", 50.0]]}, sent_at=100.0)
    assert feed.refuses("a", 100.5, 1.0) == "evicted" and "old" not in feed.evicted and feed.seq == 2
    assert feed.refuses("b", 100.5, 1.0) is None
    assert feed.refuses("b", 100.0 + max_age(1.0) + 0.1, 1.0) == "evictions feed not read lately"
    feed.apply({"epoch": "e2", "seq": 1, "evicted": []}, sent_at=200.0)  # the engine restarted
    assert feed.evicted == {} and feed.seq == 1 and feed.refuses("a", 200.0, 1.0) is None
    feed.apply({"nonsense": True}, sent_at=300.0)  # not a feed: stays stale
    assert feed.read_at == 200.0
    # a host-tier offer waits for its copy to be listed as done
    assert feed.refuses("h", 200.5, 1.0, host_tier=True) == HOST_COPY_PENDING
    feed.apply({"epoch": "e2", "seq": 1, "evicted": [], "hosted": [["h", 900.0]]}, sent_at=201.0)
    assert feed.refuses("h", 201.5, 1.0, host_tier=True) is None and feed.refuses("h", 201.5, 1.0) is None
    feed.apply({"epoch": "e2", "seq": 1, "evicted": []}, sent_at=202.0)  # read, then freed: no longer listed
    assert feed.refuses("h", 202.5, 1.0, host_tier=True) == HOST_COPY_PENDING
    quiet = EvictionFeed()  # a feed that answered 404: whatever the engine evicts would go unseen
    quiet.unsupported()
    assert quiet.refuses("a", 1e9, 1.0) == "evictions feed unsupported"
    quiet.apply({"epoch": "q", "seq": 0, "evicted": []}, sent_at=1e9)  # re-probed, and read at last
    assert quiet.supported and quiet.refuses("a", 1e9 + 0.5, 1.0) is None


def test_the_eviction_grace_must_outlast_the_routers_view_and_the_read_window():
    values = params.defaults()
    assert values["retention_eviction_grace"] >= params.eviction_grace_needed(values) == 18.0
    with pytest.raises(params.ParamError, match="retention_eviction_grace"):
        params.validate({"replay_window": 30})
    params.validate({"replay_window": 30, "retention_eviction_grace": 40})


def test_a_restart_seen_from_the_old_processes_cursor_is_read_again_from_the_start():
    """A router that read the old process up to announcement 500 asks the new one from 500: the new process's
    own first announcements (numbered from 1 again) were not in that answer, so the feed is read again from 0
    before it counts as read (a missed eviction would be replayed after its blocks are freed)."""
    feed = EvictionFeed()
    feed.apply({"epoch": "old", "seq": 500, "evicted": []}, sent_at=100.0)
    again = feed.apply({"epoch": "new", "seq": 3, "evicted": []}, sent_at=101.0, since=500)
    assert again and feed.seq == 0 and feed.read_at == 100.0  # not counted as read
    assert not feed.apply({"epoch": "new", "seq": 3, "evicted": [["x", 900.0]]}, sent_at=101.1, since=0)
    assert feed.refuses("x", 101.2, 1.0) == "evicted" and feed.seq == 3 and feed.read_at == 101.1
    # a first read ever (no old epoch) from 0 needs no second read
    fresh = EvictionFeed()
    assert not fresh.apply({"epoch": "e", "seq": 2, "evicted": []}, sent_at=5.0, since=0)
