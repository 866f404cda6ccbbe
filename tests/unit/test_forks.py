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
    tokens = list(range(300))
    _, out = decode.request_finished(_request("d1", tokens, RETAIN), [[1, 2, 3]])
    assert out[wire.FORK_WINDOW] == 30.0 and wire.check_offer(SECRET, out, "model-x", time.time(), 5) == "ok"
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
    assert _step(decode).turnkv_evict == {"d1": (30.0, out[wire.EXPIRES_AT])}  # announced; freed after the grace
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


def test_the_worker_keeps_a_fork_readable_turn_after_its_readers_notify_and_frees_the_others():
    from connector.worker import TurnkvWorkerMixin

    class Upstream:
        """Upstream's pull worker on a notification: the request's lease and processing entry are dropped and it
        is reported sent (vLLM then frees its blocks)."""

        def __init__(self):
            self._reqs_to_send = {"fork": 100.0, "single": 100.0, "waiting": 100.0}
            self._reqs_to_process = {"fork", "single", "waiting"}
            self.notifs = {"fork", "single"}

        def _get_new_notifs(self):
            for rid in self.notifs:
                self._reqs_to_process.remove(rid)
                self._reqs_to_send.pop(rid)
            return set(self.notifs)

    class Worker(TurnkvWorkerMixin, Upstream):
        pass

    w = Worker()
    w._turnkv_forkable = {"fork", "waiting"}
    assert w._get_new_notifs() == {"single"}
    assert w._reqs_to_send == {"fork": 100.0, "waiting": 100.0} and w._reqs_to_process == {"fork", "waiting"}
    meta = w.build_turnkv_meta()
    assert meta is not None and meta.fork_held == ["fork"]
    # the next reader's notification: kept again, until the lease (cut to the grace by an eviction) runs out
    w.notifs = {"fork"}
    assert w._get_new_notifs() == set() and w._reqs_to_send["fork"] == 100.0


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
