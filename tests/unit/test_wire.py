"""Signed offers, the lease route's bounds, the replay guard and the scheduler's offer checks (no engines)."""

from __future__ import annotations

import time
import types

import pytest

from connector.offers import ReplayGuard
from turnkv import wire

SECRET = b"s" * 32


def offer(**over):
    params = {"do_remote_decode": True, "remote_engine_id": "decode-0", "remote_request_id": "r1",
              "remote_host": "10.0.0.2", "remote_port": 5600, "remote_block_ids": [[1, 2, 3]],
              "remote_num_tokens": 300, "remote_blocks_expiry_time": 1234.5, wire.BOOT: "b00t",
              wire.TOKEN_PROOF: {"v": 1, "block_size": 128, "num_tokens": 300, "digests": ["a", "b", "c"]}}
    params.update(over)
    return wire.sign_offer(SECRET, params, time.time() + 100, "model-x")


def test_a_signed_offer_verifies_and_every_edit_breaks_it():
    good = offer()
    assert wire.check_offer(SECRET, good, "model-x", time.time(), 5) == "ok"
    for key, value in (("remote_block_ids", [[7, 8, 9]]), ("remote_num_tokens", 4000), ("remote_host", "10.9.9.9"),
                       ("remote_port", 1), ("remote_engine_id", "decode-1"), (wire.BOOT, "other"),
                       ("remote_request_id", "r2"), (wire.EXPIRES_AT, time.time() + 10_000),
                       (wire.TOKEN_PROOF, {"v": 1, "block_size": 128, "num_tokens": 300, "digests": ["x"]})):
        assert wire.check_offer(SECRET, {**good, key: value}, "model-x", time.time(), 5) == "forged", key
    assert wire.check_offer(b"another deployment", good, "model-x", time.time(), 5) == "forged"
    assert wire.check_offer(SECRET, good, "another checkpoint", time.time(), 5) == "forged"
    unsigned = {k: v for k, v in good.items() if k != wire.SIGNATURE}
    assert wire.check_offer(SECRET, unsigned, "model-x", time.time(), 5) == "unsigned"
    assert wire.check_offer(None, good, "model-x", time.time(), 5) == "unsigned"


def test_expiry_is_checked_on_the_readers_wall_clock_minus_the_skew_margin():
    good = offer()
    expires = good[wire.EXPIRES_AT]
    assert wire.check_offer(SECRET, good, "model-x", expires - 6, 5) == "ok"
    assert wire.check_offer(SECRET, good, "model-x", expires - 4, 5) == "expired"
    assert wire.check_offer(SECRET, good, "model-x", expires + 1, 0) == "expired"


def test_neutralized_offer_is_a_plain_prefill():
    params = offer()
    wire.neutralize(params)
    assert params["remote_block_ids"] is None and params["remote_host"] is None and params["remote_num_tokens"] == 0


def test_offer_secret_from_env_or_file(tmp_path):
    path = tmp_path / "secret"
    path.write_text("abc\n")
    assert wire.offer_secret({wire.OFFER_SECRET_FILE_ENV: str(path)}) == b"abc"
    assert wire.offer_secret({wire.OFFER_SECRET_ENV: "xyz"}) == b"xyz"
    assert wire.offer_secret({wire.OFFER_SECRET_FILE_ENV: str(tmp_path / "missing")}) is None
    assert wire.offer_secret({}) is None


def test_replay_guard_is_single_use_and_bounded():
    now = [0.0]
    guard = ReplayGuard(max_entries=3, clock=lambda: now[0])
    assert guard.first_use("a", 10) and not guard.first_use("a", 10)
    for sig in "bcd":
        assert guard.first_use(sig, 10)
    assert len(guard) <= 3
    now[0] = 20  # expired signatures are forgotten (their offers fail the expiry check anyway)
    assert guard.first_use("e", 30) and len(guard) == 1


def test_lease_requests_are_bounded():
    pytest.importorskip("fastapi")
    from connector.leases import parse_request, renewed_offer

    with pytest.raises(ValueError, match="at most"):
        parse_request({"offers": [offer()] * (wire.LEASE_MAX_OFFERS + 1), "ttl": 10})
    for bad in ({"offers": [], "ttl": 10}, {"offers": [offer()], "ttl": 0}, {"offers": [offer()], "ttl": 99999},
                {"request_ids": ["r1"], "ttl": 10}, {"offers": [offer()], "ttl": True}):
        with pytest.raises(ValueError):
            parse_request(bad)
    offers, ttl = parse_request({"offers": [offer()], "ttl": 60})
    assert ttl == 60.0
    renewed = renewed_offer(SECRET, offers[0], mono_expiry=500.0, model="model-x", mono_now=400.0, wall_now=1e9)
    assert renewed["remote_blocks_expiry_time"] == 500.0 and renewed[wire.EXPIRES_AT] == pytest.approx(1e9 + 100)
    assert wire.check_offer(SECRET, renewed, "model-x", 1e9, 5) == "ok"


class _Upstream:
    """The slice of an upstream NIXL scheduler the mixin relies on."""

    def build_connector_meta(self, scheduler_output):
        return types.SimpleNamespace(reqs_to_recv={})

    def update_connector_output(self, connector_output):
        pass

    def __init__(self, *args, **kwargs):
        self.kv_cache_config = types.SimpleNamespace(num_blocks=100, kv_cache_tensors=[])
        self.decoder_kv_blocks_ttl = 480
        self.kv_recompute_threshold = 0
        self.block_size = 128
        self.is_bidirectional_kv_xfer_enabled = True
        self.asked: list[dict] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        params = request.kv_transfer_params
        self.asked.append(dict(params))
        if params.get("remote_block_ids"):
            return min(params["remote_num_tokens"], len(request.prompt_token_ids)), True
        return 0, False

    def request_finished(self, request, block_ids):
        if not self.is_bidirectional_kv_xfer_enabled:
            return False, None
        return True, {"do_remote_decode": True, "do_remote_prefill": False, "remote_block_ids": block_ids,
                      "remote_engine_id": "decode-0", "remote_request_id": request.request_id,
                      "remote_host": "10.0.0.2", "remote_port": 5600, "remote_num_tokens": len(request.all_token_ids),
                      "remote_blocks_expiry_time": time.perf_counter() + 480}


@pytest.fixture
def scheduler(monkeypatch, tmp_path):
    pytest.importorskip("vllm")
    from connector.scheduler import TurnkvSchedulerMixin

    monkeypatch.setenv(wire.OFFER_SECRET_ENV, SECRET.decode())
    monkeypatch.setenv(wire.MODEL_FINGERPRINT_ENV, "model-x")
    monkeypatch.setenv("TURNKV_TUNABLES_FILE", str(tmp_path / "none.json"))

    class Scheduler(TurnkvSchedulerMixin, _Upstream):
        pass

    def make():
        return Scheduler(None, "decode-0", None)

    return make


def _request(rid, tokens, params):
    return types.SimpleNamespace(request_id=rid, prompt_token_ids=list(tokens), all_token_ids=list(tokens),
                                 kv_transfer_params=params)


def _cleared(offer, within=10.0):
    """An offer as a router replays it: cleared, to be read within ``within`` seconds."""
    return wire.clear_offer(SECRET, offer, time.time() + within)


def test_decode_signs_with_a_wall_clock_expiry_and_prefill_reads_once(scheduler):
    decode, prefill = scheduler(), scheduler()
    tokens = list(range(300))
    delay, out = decode.request_finished(_request("d1", tokens, {"turnkv_retain": True}), [[1, 2, 3]])
    assert delay and abs(out[wire.EXPIRES_AT] - (time.time() + 480)) < 2
    assert wire.check_offer(SECRET, out, "model-x", time.time(), 5) == "ok"
    prompt = tokens + list(range(1000, 1100))
    count, _ = prefill.get_num_new_matched_tokens(_request("p1", prompt, _cleared(out)), 0)
    assert count == 300
    # the same offer again (a replay, cleared anew): not read, and upstream is given a plain prefill
    replay = _cleared(out)
    count, _ = prefill.get_num_new_matched_tokens(_request("p2", prompt, replay), 0)
    assert count == 0 and prefill.asked[-1]["remote_block_ids"] is None and replay["remote_host"] is None
    assert prefill.turnkv_stats.data["turnkv_offers_replayed"] == [1]


def test_prefill_refuses_forged_expired_and_unsigned_offers_before_any_read(scheduler):
    decode, prefill = scheduler(), scheduler()
    tokens = list(range(300))
    _, out = decode.request_finished(_request("d1", tokens, {"turnkv_retain": True}), [[1, 2, 3]])
    prompt = tokens + [7] * 10
    forged = _cleared({**out, "remote_block_ids": [[50, 51, 52]]})
    expired = _cleared(wire.sign_offer(SECRET, dict(out), time.time() + 2, "model-x"))  # within the 5 s margin
    unsigned = {k: v for k, v in _cleared(out).items() if k != wire.SIGNATURE}
    for i, params in enumerate((forged, expired, unsigned)):
        count, _ = prefill.get_num_new_matched_tokens(_request(f"p{i}", prompt, params), 0)
        assert count == 0 and prefill.asked[-1]["remote_block_ids"] is None
    data = prefill.turnkv_stats.data
    assert (data["turnkv_offers_forged"], data["turnkv_offers_expired"], data["turnkv_offers_unsigned"]) == \
        ([1], [1], [1])


RETAIN = {"turnkv_retain": True}


def _step(decode):
    return decode.build_connector_meta(types.SimpleNamespace(total_num_scheduled_tokens=0))


def _freed(decode, *request_ids):
    decode.update_connector_output(types.SimpleNamespace(finished_sending=set(request_ids), finished_recving=set(),
                                                         kv_connector_worker_meta=None))


def _worker_news(decode, *, pools=(), released=(), renewed=()):
    from connector.worker import TurnkvWorkerMeta

    meta = TurnkvWorkerMeta(host_pools=list(pools), host_released=list(released), renewed=list(renewed))
    decode.update_connector_output(types.SimpleNamespace(finished_sending=set(), finished_recving=set(),
                                                         kv_connector_worker_meta=meta))


def test_decode_keeps_turns_likely_to_be_read_and_evicts_only_idle_ones_when_its_share_is_full(scheduler):
    decode = scheduler()
    decode._retained_share = 0.06  # 6 of 100 blocks
    _, a = decode.request_finished(_request("a", range(300), RETAIN), [[1, 2, 3]])
    _, b = decode.request_finished(_request("b", range(300), RETAIN), [[4, 5, 6]])
    assert _step(decode).turnkv_evict == {}
    delay, c = decode.request_finished(_request("c", range(300), RETAIN), [[7, 8, 9]])
    # no room, and a and b are not idle (no reads seen yet: idle means past the TTL): c is not retained, nothing
    # is evicted (oldest-first would evict exactly the turn the next request needs)
    assert not delay and c is None and _step(decode).turnkv_evict == {}
    assert decode.turnkv_stats.data["turnkv_retention_refused"] == [1]
    assert decode.turnkv_stats.data["turnkv_retention_refusals"] == [1]  # index of "full"
    decode._idle_evict = 0.01  # retention_idle_evict: a and b are idle now
    time.sleep(0.02)
    delay, d = decode.request_finished(_request("d", range(300), RETAIN), [[10, 11, 12]])
    assert not delay and d is None  # its room frees only after the grace
    assert _step(decode).turnkv_evict == {"a": (30.0, a[wire.EXPIRES_AT])}  # the oldest idle one, announced
    assert _step(decode).turnkv_evict == {}  # told once
    assert decode.turnkv_stats.data["turnkv_retention_evicted"] == [1]
    assert decode.turnkv_stats.data["turnkv_retention_evictions"] == [0]  # index of "idle"
    _freed(decode, "a")  # the grace is over: upstream's reaper freed a's blocks
    assert decode.turnkv_stats.data["turnkv_retained_blocks"] == [3]
    delay, e = decode.request_finished(_request("e", range(300), RETAIN), [[13, 14, 15]])
    assert delay and e is not None and list(decode._retained.live) == ["b", "e"]
    # a turn larger than the share on its own is not retained, and evicts nothing
    delay, big = decode.request_finished(_request("big", range(1000), RETAIN), [list(range(20, 30))])
    assert not delay and big is None and _step(decode).turnkv_evict == {}
    assert b is not None


def test_a_turn_past_the_device_share_goes_to_the_host_tier_signed_with_its_slots(scheduler):
    decode, prefill = scheduler(), scheduler()
    decode._retained_share = 0.03
    decode._host_budget_mib = decode._host_started_mib = 64
    _worker_news(decode, pools=[(0, 0x7F0000, 8)])  # rank 0's pool: 8 slots
    tokens = list(range(300))
    _, a = decode.request_finished(_request("a", tokens, RETAIN), [[1, 2, 3]])
    delay, b = decode.request_finished(_request("b", tokens, RETAIN), [[4, 5, 6]])
    assert wire.HOST_TIER not in a and delay
    assert b["remote_block_ids"] == [[0, 1, 2]] and b[wire.HOST_TIER] == {"tier": "host", "bases": [0x7F0000],
                                                                           "blocks": 8}
    assert wire.check_offer(SECRET, b, "model-x", time.time(), 5) == "ok"
    moved = dict(b, **{wire.HOST_TIER: {"tier": "host", "bases": [0x100], "blocks": 8}})  # re-pointed: forged
    assert wire.check_offer(SECRET, moved, "model-x", time.time(), 5) == "forged"
    # the workers copy device blocks 4-6 into slots 0-2 at the next step
    assert _step(decode).turnkv_to_host == {"b": ([4, 5, 6], [0, 1, 2], b[wire.EXPIRES_AT])}
    assert decode.turnkv_stats.data["turnkv_host_retained_requests"] == [1]
    _freed(decode, "b")  # the copy is done: vLLM frees b's device blocks, the turn stays held in the pool
    assert "b" in decode._retained.live and decode._retained.host.free == 5
    # prefill reads it from the pool only when cleared, whatever TURNKV_REQUIRE_CLEARED_OFFERS says
    prefill._require_cleared = False
    prompt = tokens + [7] * 10
    count, _ = prefill.get_num_new_matched_tokens(_request("p1", prompt, dict(b)), 0)
    assert count == 0 and prefill.turnkv_stats.data["turnkv_offers_uncleared"] == [1]
    count, _ = prefill.get_num_new_matched_tokens(_request("p2", prompt, _cleared(b)), 0)
    assert count == 300 and prefill._admissions.get("p2").plan.host == ((0x7F0000,), 8)
    assert prefill.turnkv_stats.data["turnkv_pulls"] == [1]  # index of "host"
    # read: the worker hands the slots back
    _worker_news(decode, released=[("b", True)])
    assert "b" not in decode._retained.live and decode._retained.host.free == 8
    assert decode.turnkv_stats.data["turnkv_host_retained_requests"] == [0]


def test_a_lowered_host_budget_evicts_host_turns_and_a_renewal_keeps_a_turn_from_going_idle(scheduler):
    decode = scheduler()
    decode._retained_share = 0.03
    decode._host_budget_mib = decode._host_started_mib = 64
    _worker_news(decode, pools=[(0, 0x7F0000, 8)])
    decode.request_finished(_request("a", range(300), RETAIN), [[1, 2, 3]])
    decode.request_finished(_request("h", range(300), RETAIN), [[4, 5, 6]])
    assert decode._retained.get("h").tier == "host"
    since = decode._retained.get("a").since
    _worker_news(decode, renewed=["a"])
    assert decode._retained.get("a").since > since
    decode._apply_tunables({"host_kv_budget_mib": 16})  # 2 of 8 slots usable now: h (3 blocks) must go
    assert set(_step(decode).turnkv_evict) == {"h"}
    assert decode.turnkv_stats.data["turnkv_retention_evictions"] == [1]  # index of "shrunk"


def test_prefill_does_not_start_reading_a_replay_past_the_routers_read_by_instant(scheduler):
    decode, prefill = scheduler(), scheduler()
    tokens = list(range(300))
    _, out = decode.request_finished(_request("d1", tokens, RETAIN), [[1, 2, 3]])
    prompt = tokens + [7] * 10
    late = _cleared(out, within=-0.5)  # prefill queued past it
    count, _ = prefill.get_num_new_matched_tokens(_request("p1", prompt, late), 0)
    assert count == 0 and prefill.asked[-1]["remote_block_ids"] is None
    assert prefill.turnkv_stats.data["turnkv_offers_late"] == [1]
    count, _ = prefill.get_num_new_matched_tokens(_request("p2", prompt, _cleared(out)), 0)
    assert count == 300


def test_prefill_reads_only_offers_a_router_cleared(scheduler):
    """A valid signed offer that did not come through a router (replayed from a log, sent straight to prefill) is
    not read: decode may have evicted its turn, and only a router reads the evictions feed. A read-by instant
    without the router's clearance, or one moved after clearing, does not pass either."""
    decode, prefill = scheduler(), scheduler()
    tokens = list(range(300))
    _, out = decode.request_finished(_request("d1", tokens, RETAIN), [[1, 2, 3]])
    prompt = tokens + [7] * 10
    cleared = _cleared(out)
    unstamped = dict(out)
    self_stamped = {**out, wire.READ_BY: time.time() + 10}
    moved = {**cleared, wire.READ_BY: cleared[wire.READ_BY] + 60}
    other_key = wire.clear_offer(b"t" * 32, out, time.time() + 10)
    for i, params in enumerate((unstamped, self_stamped, moved, other_key)):
        count, _ = prefill.get_num_new_matched_tokens(_request(f"p{i}", prompt, params), 0)
        assert count == 0 and prefill.asked[-1]["remote_block_ids"] is None, i
    assert prefill.turnkv_stats.data["turnkv_offers_uncleared"] == [1, 1, 1, 1]
    count, _ = prefill.get_num_new_matched_tokens(_request("p9", prompt, cleared), 0)
    assert count == 300  # the refusals did not use the offer up


def test_without_required_clearance_prefill_reads_valid_offers_and_still_honours_a_read_by(scheduler, monkeypatch):
    monkeypatch.setenv(wire.REQUIRE_CLEARED_ENV, "0")  # another proxy replays offers
    decode, prefill = scheduler(), scheduler()
    tokens = list(range(300))
    _, a = decode.request_finished(_request("a", tokens, RETAIN), [[1, 2, 3]])
    _, b = decode.request_finished(_request("b", tokens, RETAIN), [[4, 5, 6]])
    prompt = tokens + [7] * 10
    assert prefill.get_num_new_matched_tokens(_request("p1", prompt, dict(a)), 0)[0] == 300
    late = {**b, wire.READ_BY: time.time() - 1}
    assert prefill.get_num_new_matched_tokens(_request("p2", prompt, late), 0)[0] == 0
    assert prefill.turnkv_stats.data["turnkv_offers_late"] == [1]


def test_clearance_is_a_mac_over_the_offer_and_its_read_by_instant():
    good = offer()
    now = time.time()
    cleared = wire.clear_offer(SECRET, good, now + 10)
    assert wire.offer_verdict(SECRET, cleared, "model-x", now, 5, require_cleared=True) == "ok"
    assert wire.offer_verdict(SECRET, cleared, "model-x", now + 11, 5, require_cleared=True) == "late"
    assert wire.offer_verdict(SECRET, good, "model-x", now, 5, require_cleared=True) == "uncleared"
    assert wire.offer_verdict(SECRET, good, "model-x", now, 5, require_cleared=False) == "ok"
    # the clearance names this offer's signature: moved onto another offer it does not verify
    other = wire.clear_offer(SECRET, offer(remote_request_id="other"), now + 10)
    swapped = {**other, wire.CLEARANCE: cleared[wire.CLEARANCE], wire.READ_BY: cleared[wire.READ_BY]}
    assert wire.offer_verdict(SECRET, swapped, "model-x", now, 5, require_cleared=True) == "uncleared"
    # the signature checks still come first, and clearing never changes what is signed
    assert wire.offer_verdict(SECRET, {**cleared, "remote_port": 1}, "model-x", now, 5, require_cleared=True) \
        == "forged"
    assert wire.check_offer(SECRET, cleared, "model-x", now, 5) == "ok"
    # an instant that crossed a JSON layer as an integer still verifies
    whole = wire.clear_offer(SECRET, good, float(int(now) + 10))
    as_int = {**whole, wire.READ_BY: int(whole[wire.READ_BY])}
    assert wire.offer_verdict(SECRET, as_int, "model-x", now, 5, require_cleared=True) == "ok"
    # without a secret the router adds only the read-by instant
    assert wire.CLEARANCE not in wire.clear_offer(None, good, now + 10)
    assert wire.CLEARANCE not in wire.clear_offer(None, cleared, now + 10)


def test_ranks_whose_host_pools_differ_turn_the_tier_off_on_every_rank(scheduler):
    """Issue 50: one offer names one slot list for every rank; the scheduler took the slot count of whichever rank
    reported first, so a rank re-fitted to fewer slots after agreeing would be read beyond its pool."""
    from connector.worker import TurnkvWorkerMeta

    agreed, split, partial = scheduler(), scheduler(), scheduler()
    for s in (agreed, split, partial):
        s._tp_size = 2
        s._host_budget_mib = s._host_started_mib = 64
    gib = 1 << 30

    def news(s, *, pools=(), granted=()):
        s.update_connector_output(types.SimpleNamespace(finished_sending=set(), finished_recving=set(),
                                                        kv_connector_worker_meta=TurnkvWorkerMeta(
                                                            host_pools=list(pools), host_tier=list(granted))))

    news(agreed, pools=[(0, 0x7F0000, 8)], granted=[(0, gib, gib, "")])
    assert agreed._host_room() == 0  # rank 1 not heard from yet
    news(agreed, pools=[(1, 0x8F0000, 8)], granted=[(1, gib, gib, "")])
    assert agreed._host_room() == 8 and agreed.turnkv_stats.data["turnkv_host_tier_granted_bytes"] == [2 * gib]
    news(split, pools=[(0, 0x7F0000, 8), (1, 0x8F0000, 6)], granted=[(0, gib, gib, ""), (1, gib, gib * 3 // 4, "")])
    news(partial, pools=[(0, 0x7F0000, 8)], granted=[(0, gib, gib, ""), (1, gib, 0, "pinning refused")])
    for s in (split, partial):
        assert s._host_room() == 0 and s._retained.host is None
        assert s.turnkv_stats.data["turnkv_host_tier_granted_bytes"] == [0]
        assert s.turnkv_stats.data["turnkv_host_tier_rank_mismatches"] == [1]
    tokens = list(range(300))
    split._retained_share = 0.03
    assert split.request_finished(_request("a", tokens, dict(RETAIN)), [[1, 2, 3]])[1] is not None
    _, second = split.request_finished(_request("b", tokens, dict(RETAIN)), [[4, 5, 6]])
    assert second is None or wire.HOST_TIER not in second  # never offered from the host tier
