"""Decode's retained turns above retained_kv_share: oldest evicted first, announced on the engine's evictions
feed, freed after the grace; the router's view of the feed (no engines)."""

from __future__ import annotations

import time
import types

import pytest

from connector.retention import RetentionLedger
from router.engines.evictions import EvictionFeed, max_age
from turnkv import params


def test_the_oldest_live_turns_make_room_and_evicting_ones_still_count():
    ledger = RetentionLedger()
    for rid in "abc":
        ledger.hold(rid, 2, 100.0)
    assert ledger.make_room(2, 8) == []  # 6 + 2 fit in 8
    evicted = ledger.make_room(3, 8)  # 6 + 3 > 8: the oldest goes
    assert [rid for rid, _ in evicted] == ["a"] and list(ledger.live) == ["b", "c"]
    assert ledger.blocks == 6  # a is evicting, not freed yet
    assert [rid for rid, _ in ledger.make_room(4, 8)] == ["b"]  # a still takes its room: b goes too
    assert not ledger.fits(7, 8) and ledger.make_room(7, 8) is None and list(ledger.live) == ["c"]
    assert ledger.release("a") and ledger.release("c") and not ledger.release("a")
    assert ledger.blocks == 2 and ledger.fits(6, 8)


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
    assert merged == {"epoch": "x-y", "seq": 1, "evicted": [["a", 5.0], ["b", 6.0]]}


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
    quiet = EvictionFeed()
    quiet.unsupported()
    assert quiet.refuses("a", 1e9, 1.0) is None


def test_the_eviction_grace_must_outlast_the_routers_view_and_the_read_window():
    values = params.defaults()
    assert values["retention_eviction_grace"] >= params.eviction_grace_needed(values) == 18.0
    with pytest.raises(params.ParamError, match="retention_eviction_grace"):
        params.validate({"replay_window": 30})
    params.validate({"replay_window": 30, "retention_eviction_grace": 40})
