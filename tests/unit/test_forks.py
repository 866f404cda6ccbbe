"""Forks that all pull (issue 30), engine side: decode signs how long it keeps a read turn for further readers,
its workers keep the blocks after a read, its scheduler evicts the turn once the window passed (read turns first
when room is needed), and prefill reads each router clearance once (pure parts and the mixins over stand-ins)."""

from __future__ import annotations

import time
import types

from connector.retention import EvictReason, Held, RetentionLedger
from tests.unit.test_wire import RETAIN, SECRET, _cleared, _freed, _request, _step, scheduler  # noqa: F401
from turnkv import wire


def test_a_clearance_names_its_reader_and_the_replay_key_is_per_reader_only_for_fork_readable_offers():
    offer = wire.sign_offer(SECRET, {"remote_request_id": "r", "remote_block_ids": [[1]], wire.FORK_WINDOW: 30.0},
                            time.time() + 60, "m")
    a = wire.clear_offer(SECRET, offer, time.time() + 10, reader="a" * 16)
    b = wire.clear_offer(SECRET, offer, a[wire.READ_BY], reader="b" * 16)
    assert wire.check_clearance(SECRET, a, time.time(), required=True) == "ok"
    assert wire.replay_key(a) != wire.replay_key(b) and wire.replay_key(a).startswith(offer[wire.SIGNATURE])
    assert wire.check_clearance(SECRET, {**a, wire.READER: "c" * 16}, time.time(), required=True) == "uncleared"
    assert wire.check_clearance(SECRET, {**a, wire.READER: 7}, time.time(), required=True) == "uncleared"
    # a single-use offer: the reader changes nothing about what is remembered
    single = wire.sign_offer(SECRET, {"remote_request_id": "r", "remote_block_ids": [[1]]}, time.time() + 60, "m")
    replay = wire.clear_offer(SECRET, single, time.time() + 10, reader="x" * 16)
    assert wire.replay_key(replay) == single[wire.SIGNATURE]
    # the window is signed: raising it is a forgery
    assert wire.check_offer(SECRET, {**offer, wire.FORK_WINDOW: 600.0}, "m", time.time(), 0) == "forged"


def test_decode_signs_the_fork_window_and_prefill_reads_each_readers_clearance_once(scheduler):  # noqa: F811
    decode, prefill = scheduler(), scheduler()
    decode._fork_window = 10.0  # fork_window set (the catalog's default is 0: single use)
    tokens = list(range(300))
    _, out = decode.request_finished(_request("d1", tokens, RETAIN), [[1, 2, 3]])
    assert out[wire.FORK_WINDOW] == 10.0 and wire.check_offer(SECRET, out, "model-x", time.time(), 5) == "ok"
    assert _step(decode).turnkv_forkable == {"d1"}  # the workers keep it after a read
    prompt = tokens + list(range(1000, 1100))
    for i, reader in enumerate(("a" * 16, "b" * 16)):
        replay = wire.clear_offer(SECRET, out, time.time() + 10, reader=reader)
        assert prefill.get_num_new_matched_tokens(_request(f"p{i}", prompt, replay), 0)[0] == 300
    again = wire.clear_offer(SECRET, out, time.time() + 10, reader="a" * 16)
    assert prefill.get_num_new_matched_tokens(_request("p9", prompt, again), 0)[0] == 0
    assert prefill.turnkv_stats.data["turnkv_offers_replayed"] == [1]
    # fork_window 0 (single use): nothing signed, nothing kept
    decode._fork_window = 0.0
    _, single = decode.request_finished(_request("d2", tokens, RETAIN), [[4, 5, 6]])
    assert wire.FORK_WINDOW not in single and _step(decode).turnkv_forkable == set()


def _fork_news(decode, *request_ids):
    from connector.worker import TurnkvWorkerMeta

    decode.update_connector_output(types.SimpleNamespace(
        finished_sending=set(), finished_recving=set(), kv_connector_worker_meta=TurnkvWorkerMeta(fork_held=list(
            request_ids))))


def test_a_read_turn_is_kept_for_the_window_then_evicted_and_its_first_read_is_the_one_delay_sample(scheduler):  # noqa: F811
    decode = scheduler()
    decode._fork_window = 0.2
    _, out = decode.request_finished(_request("d1", range(300), RETAIN), [[1, 2, 3]])
    _fork_news(decode, "d1")
    _fork_news(decode, "d1")  # a second fork's read, and the other ranks' reports: one sample
    assert decode._retained.live["d1"].read_at is not None and len(decode._read_delays._delays) == 1
    assert decode.turnkv_stats.data["turnkv_fork_holds"] == [1]
    assert _step(decode).turnkv_evict == {}
    time.sleep(0.25)
    _fork_news(decode)  # any step's output after the window
    # announced; freed once no router replay can still be read: the slack after the window and the clocks' margin,
    # not the eviction grace (30 s), which waits for routers to read the evictions feed
    assert _step(decode).turnkv_evict == {"d1": (wire.FORK_READ_SLACK + 5.0, out[wire.EXPIRES_AT])}
    reasons = decode.turnkv_stats.data["turnkv_retention_evictions"]
    assert reasons[-1] == list(EvictReason).index(EvictReason.READ)
    _freed(decode, "d1")
    assert not decode._retained.live and not decode._retained.evicting and len(decode._read_delays._delays) == 1


def test_room_for_a_newcomer_comes_from_read_turns_before_idle_ones():
    ledger = RetentionLedger()
    now = 1000.0
    ledger.hold("idle", Held(3, now + 480, since=now - 900))  # unread for 900 s: idle
    ledger.hold("read", Held(3, now + 480, since=now - 5, read_at=now - 1))  # read a second ago: kept for forks
    ledger.hold("fresh", Held(3, now + 480, since=now - 5))
    placement = ledger.place(3, now, device_room=9, host_room=0, idle_after=600)
    assert [rid for rid, _ in placement.evicted] == ["read"]
    placement = ledger.place(3, now, device_room=6, host_room=0, idle_after=600)
    assert [rid for rid, _ in placement.evicted] == ["idle"]  # then the idle one; the fresh unread one stays
    assert list(ledger.live) == ["fresh"]


def test_fork_reads_are_taken_before_upstream_counts_them_one_read_per_readers_notifications():
    from connector.worker import ForkReads

    reads = ForkReads()
    reads.forkable = {"fork"}
    assert not reads.take(b"single:1") and not reads.take(b"HB:fork") and not reads.take(b"\xff")
    # two prefill engines of TP 2 reading this rank (2 readers each), their notifications interleaved
    assert all(reads.take(m) for m in (b"fork:2", b"fork:2", b"fork:2"))
    assert reads.drain() == ["fork"] and reads.drain() == []
    assert reads.take(b"fork:2") and reads.drain() == ["fork"]
    reads.forget({"fork"})  # freed (the lease ran out): its notifications go to upstream again
    assert not reads.take(b"fork:1")


def test_the_pull_worker_keeps_a_fork_readable_turn_leased_while_forks_read_and_frees_the_others():
    from connector.worker import TurnkvWorkerMixin

    class Agent:
        def __init__(self):
            self.pending = {}

        def get_new_notifs(self):
            out, self.pending = self.pending, {}
            return out

    class Upstream:
        """Upstream's pull worker on a notification: the request's lease and processing entry are dropped and it
        is reported sent (vLLM then frees its blocks); a request it no longer tracks is an error."""

        def __init__(self):
            self.nixl_wrapper = Agent()
            self._reqs_to_send = {"fork": 100.0, "single": 100.0}
            self._reqs_to_process = {"fork", "single"}
            self.unknown = []

        def _get_new_notifs(self):
            done = set()
            for msgs in self.nixl_wrapper.get_new_notifs().values():
                for msg in msgs:
                    rid = msg.decode().rsplit(":", 1)[0]
                    if rid not in self._reqs_to_send:
                        self.unknown.append(rid)
                        continue
                    self._reqs_to_process.remove(rid)
                    self._reqs_to_send.pop(rid)
                    done.add(rid)
            return done

    class Worker(TurnkvWorkerMixin, Upstream):
        pass

    w = Worker()
    w.start_load_kv = None  # not used here
    w._turnkv_fork_reads.forkable = {"fork"}
    w.nixl_wrapper.pending = {"prefill-a": [b"fork:1", b"single:1"], "prefill-b": [b"fork:1"]}  # two forks at once
    assert w._get_new_notifs() == {"single"} and w.unknown == []
    assert w._reqs_to_send == {"fork": 100.0} and w._reqs_to_process == {"fork"}
    assert w.build_turnkv_meta().fork_held == ["fork"]
    w.nixl_wrapper.pending = {"prefill-c": [b"fork:1"]}  # a retry, later: still leased
    assert w._get_new_notifs() == set() and w._reqs_to_send == {"fork": 100.0}


def test_prefill_reports_its_own_prefix_cache_hits_apart_and_the_router_counts_only_pulled_tokens(
        scheduler, monkeypatch):  # noqa: F811
    """With prefix caching on (as deployed), upstream's remote_prefill_cached_tokens counts local hits and pulled
    tokens together; the connector reports the local ones apart and the router subtracts them."""
    from router.legs import prefill_cached_tokens, reused_tokens

    prefill = scheduler()
    decode_out = scheduler().request_finished(_request("d1", range(300), RETAIN), [[1, 2, 3]])[1]
    prompt = list(range(300)) + list(range(1000, 1100))
    request = _request("p1", prompt, _cleared(decode_out))
    assert prefill.get_num_new_matched_tokens(request, 128)[0] > 0  # 128 tokens hit locally, the rest pulled
    upstream = type(prefill).__mro__[2]
    monkeypatch.setattr(upstream, "request_finished", lambda self, req, blocks: (False, {  # its answer to decode
        "do_remote_prefill": True, "remote_prefill_cached_tokens": 300}))
    _, out = prefill.request_finished(request, [[7]])
    assert out[wire.PREFILL_LOCAL_TOKENS] == 128
    assert prefill_cached_tokens(out) == 128 and reused_tokens(out) == 172
    assert reused_tokens({"remote_prefill_cached_tokens": 300}) == 300  # an engine without turnkv's connector
    assert prefill_cached_tokens({wire.PREFILL_LOCAL_TOKENS: True}) == 0


def test_offers_are_fork_readable_only_while_the_device_tier_is_at_most_three_quarters_full(scheduler):  # noqa: F811
    decode = scheduler()
    decode._fork_window = 10.0
    decode._retained_share = 0.09  # 9 of 100 blocks: forks while at most 6.75 are held (FORK_ROOM_SHARE)
    offers = [decode.request_finished(_request(f"d{i}", range(300), RETAIN), [[3 * i, 3 * i + 1, 3 * i + 2]])[1]
              for i in range(3)]
    assert [wire.FORK_WINDOW in o for o in offers] == [True, True, False]  # 3, 6, then 9 blocks held
    assert _step(decode).turnkv_forkable == {"d0", "d1"}


def test_push_takes_a_fork_readable_turns_read_notifications_off_the_writers_queue():
    from connector.push_worker import KEPT_FOR_FORKS, RetainedReadNotifs
    from connector.worker import ForkReads

    worker = types.SimpleNamespace(_turnkv_fork_reads=ForkReads(), world_size=1, _reqs_to_send={"fork": 1.0},
                                   _reqs_to_process={"fork", "other"})
    worker._turnkv_fork_reads.forkable = {"fork"}
    notifs = RetainedReadNotifs(worker)
    for msg in (b"fork:1", b"other:1"):
        notifs.put(msg)
    assert notifs.get_nowait() == KEPT_FOR_FORKS and notifs.get_nowait() == b"other:1"
    assert worker._turnkv_fork_reads.drain() == ["fork"]


def test_after_a_turn_was_refused_for_room_offers_are_single_use_for_the_cooldown(scheduler, monkeypatch):  # noqa: F811
    """Sustained retention pressure: a read turn kept for forks would take the room the next conversation's turn
    needs, so once decode refused a turn for lack of room it signs offers single use for FORK_PRESSURE_COOLDOWN."""
    from connector import scheduler as sched

    decode = scheduler()
    decode._fork_window = 10.0
    decode._retained_share = 0.06  # 6 of 100 blocks
    offers = [decode.request_finished(_request(f"d{i}", range(300), RETAIN), [[3 * i, 3 * i + 1, 3 * i + 2]])[1]
              for i in range(3)]
    assert wire.FORK_WINDOW in offers[0] and offers[2] is None  # the third did not fit: refused
    _freed(decode, "d0", "d1")  # room again
    _, after = decode.request_finished(_request("d3", range(300), RETAIN), [[9, 10, 11]])
    assert after is not None and wire.FORK_WINDOW not in after  # single use: decode was under pressure lately
    monkeypatch.setattr(sched, "FORK_PRESSURE_COOLDOWN", 0.0)  # the cooldown is over
    _freed(decode, "d3")
    _, later = decode.request_finished(_request("d4", range(300), RETAIN), [[12, 13, 14]])
    assert wire.FORK_WINDOW in later


def test_a_reload_of_the_retention_room_or_the_window_ends_the_pressure_cooldown(scheduler):  # noqa: F811
    decode = scheduler()
    decode._refused_at = time.time()
    decode._apply_tunables({"fork_window": 10.0})
    assert decode._fork_room(1)  # an operator set the window (or the room) again: pressure is measured afresh
