"""Pure limits and the router's input/output hygiene: admission, retention, rate, request ids, error text, media."""

from __future__ import annotations

import math
import os

import orjson
import pytest

from router import errors, flow, guard, legs
from router.limits import Admission, TenantRetentionLedger, TokenBucket


def test_admission_global_and_per_tenant():
    a = Admission()
    assert a.try_enter("t1", 3, 2) is None and a.try_enter("t1", 3, 2) is None
    assert a.try_enter("t1", 3, 2) == "tenant"
    assert a.try_enter("t2", 3, 2) is None and a.try_enter("t3", 3, 2) == "router"
    a.leave("t1")
    assert a.try_enter("t3", 3, 2) is None and a.by_tenant == {"t1": 1, "t2": 1, "t3": 1}


def test_retention_ledger_limits_conversations_and_tokens_and_forgets_expired():
    now = [0.0]
    ledger = TenantRetentionLedger(clock=lambda: now[0])
    assert ledger.allows("t", 100, 2, 1000)
    ledger.hold("t", "k1", 600, 10)
    ledger.hold("t", "k2", 300, 20)
    assert not ledger.allows("t", 10, 2, 1000)  # conversations
    assert not ledger.allows("t", 200, 3, 1000)  # tokens
    assert ledger.allows("u", 200, 3, 1000)  # another tenant
    ledger.release("k2")
    assert ledger.usage("t") == (1, 600)
    now[0] = 11  # k1 expired
    assert ledger.allows("t", 900, 1, 1000) and ledger.usage("t") == (0, 0)


def test_retention_ledger_a_renewed_hold_outlives_its_first_expiry():
    now = [0.0]
    ledger = TenantRetentionLedger(clock=lambda: now[0])
    ledger.hold("t", "k", 100, 10)
    ledger.hold("t", "k", 100, 30)  # the same turn held again (lease renewed): its first expiry no longer applies
    now[0] = 15
    assert ledger.allows("t", 1, 10, 1000) and ledger.usage("t") == (1, 100)
    now[0] = 31
    assert ledger.allows("t", 1, 10, 1000) and ledger.usage("t") == (0, 0)


def test_retention_ledger_purge_does_not_scan_every_held_turn():
    """Each request checks its tenant's limits: with many held turns, that must not cost a pass over all of them
    (it did: 13% of the router's CPU under load), and turns taken before they expire must not pile up."""
    now = [0.0]
    ledger = TenantRetentionLedger(clock=lambda: now[0])
    for i in range(20_000):
        ledger.hold("t", f"k{i}", 1, 1000 + i)
    reads = 0
    conversations = ledger._tenants["t"].conversations

    class Counting(dict):
        def items(self):
            nonlocal reads
            reads += 1
            return super().items()

    ledger._tenants["t"].conversations = Counting(conversations)
    for _ in range(100):
        assert ledger.allows("t", 1, 100_000, 10**9)
    assert reads == 0
    for i in range(19_000):  # taken (single use) long before they expire
        ledger.release(f"k{i}")
    ledger.allows("t", 1, 100_000, 10**9)
    assert len(ledger._tenants["t"].expiries) <= 2 * 1_000 + 64
    now[0] = 1000 + 19_500
    assert ledger.allows("t", 1, 100_000, 10**9) and ledger.usage("t") == (499, 499)


def test_token_bucket():
    now = [0.0]
    bucket = TokenBucket(clock=lambda: now[0])
    assert [bucket.allow("t", 1.0, 2) for _ in range(3)] == [True, True, False]
    now[0] = 1.0
    assert bucket.allow("t", 1.0, 2) and not bucket.allow("t", 1.0, 2)


def test_client_request_ids_are_echoable_or_refused():
    assert flow.client_request_id("abc-123") == "abc-123"
    assert flow.client_request_id(None).startswith("turnkv-")
    for bad in ("café", "a\udcff", "x" * 129, "tab\there"):
        with pytest.raises(guard.RequestError):
            flow.client_request_id(bad)
    assert legs.new_leg_id() != legs.new_leg_id()


def test_leg_ids_differ_in_a_forked_worker():
    """Router processes forked from one parent (several per task) must never hand engines the same id."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.write(write, legs.new_leg_id().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(read, 100).decode()
    os.close(read)
    os.close(write)
    mine = legs.new_leg_id()
    assert len(child) == len(mine) == 39 and child[:23] != mine[:23]


def test_engine_error_text_is_passed_on_only_when_it_names_nothing_internal():
    def err(message: str, status: int = 400) -> legs.UpstreamError:
        body = orjson.dumps({"error": {"message": message}})
        return legs.UpstreamError(status, "internal", body)

    assert errors.public_message(err("temperature must be non-negative")) == "temperature must be non-negative"
    for leaky in ("bad kv_transfer_params={...}", "cannot reach 10.0.0.5", "remote_block_ids out of range",
                  "see http://decode-0:8000", "engine fd00::1 failed"):
        assert errors.public_message(err(leaky)).startswith("the model server refused the request (HTTP 400)")
    assert "10.0.0" not in errors.public_message(err("x", 502))


def test_media_behind_urls_is_not_reusable_but_inline_bytes_are():
    url = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/cat.png"}}]}
    inline = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}
    audio = {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}}]}
    video = {"role": "user", "content": [{"type": "video_url", "video_url": "https://x/v.mp4"}]}
    assert guard.has_remote_media(url) and guard.has_remote_media(video)
    assert not guard.has_remote_media(inline) and not guard.has_remote_media(audio)
    assert guard.parse_turn("chat", {"messages": [url]}) is None
    assert guard.parse_turn("chat", {"messages": [inline]}) is not None


def test_open_mode_is_refused_on_a_reachable_address():
    from router.app import check_open_mode
    from router.auth import ApiKeys, parse_keys
    from router.config import RouterConfig

    def config(host, allow=False):
        return RouterConfig(prefill=["http://p:1"], decode=["http://d:1"], host=host, allow_open=allow)

    open_keys, keys = ApiKeys(), ApiKeys(parse_keys("acme:acme-key-123"))
    for host in ("127.0.0.1", "::1", "localhost"):
        check_open_mode(config(host), open_keys)
    with pytest.raises(ValueError, match="--allow-open"):
        check_open_mode(config("0.0.0.0"), open_keys)
    check_open_mode(config("0.0.0.0", allow=True), open_keys)
    check_open_mode(config("0.0.0.0"), keys)


# --- max-min fair shares (issue 38) ----------------------------------------------------------------------------

def test_the_water_level_gives_every_ask_that_fits_and_cuts_the_heaviest_first():
    from router.fair import shares, water_level

    assert water_level(10, [1, 2, 3]) == math.inf  # all fit: nobody is cut
    assert shares(10, {"a": 1, "b": 5, "c": 9}) == {"a": 1, "b": 4.5, "c": 4.5}
    assert shares(10, {"lone": 50}) == {"lone": 10}  # alone: the whole capacity
    assert shares(9, {"a": 3, "b": 3, "c": 3}) == {"a": 3, "b": 3, "c": 3}
    cut = shares(12, {"light": 1, "honest": 6, "hostile": 1000})
    assert cut == {"light": 1, "honest": 5.5, "hostile": 5.5}  # a huge ask buys no more than the level
    assert shares(12, {"light": 1, "honest": 4, "hostile": 1000})["honest"] == 4  # under the level: never cut
    assert sum(shares(7, {"a": 2, "b": 9, "c": 0}).values()) == 7


def test_a_fair_rate_leaves_a_lone_tenant_alone_and_cuts_only_the_heaviest_under_contention():
    from router.limits import LEVEL_REFRESH, FairRate

    now = [0.0]
    fair = FairRate(window=2.0, clock=lambda: now[0])

    def run(rates: dict[str, float], seconds: float) -> dict[str, int]:
        allowed = dict.fromkeys(rates, 0)
        steps = int(seconds * 1000)
        for i in range(steps):  # 1 ms steps; each tenant asks at its own rate
            now[0] += 0.001
            for tenant, rate in rates.items():
                for _ in range(int((i + 1) * rate / 1000) - int(i * rate / 1000)):
                    allowed[tenant] += fair.allow(tenant, capacity=1000)
        return allowed

    alone = run({"lone": 3000}, 4.0)
    assert alone["lone"] == 12_000  # 3x the router's rate: nothing refused while nobody else asks
    assert LEVEL_REFRESH <= 0.1
    both = run({"light": 200, "heavy": 3000}, 6.0)
    assert both["light"] == 1200  # under the fair level: every request
    assert 0.75 * 800 * 6 <= both["heavy"] <= 1.15 * 800 * 6 + 2 * 800  # the rest of the capacity (plus a burst)


def test_a_fair_rate_keeps_a_tenants_own_ceiling():
    from router.limits import FairRate

    fair = FairRate(clock=lambda: 0.0)
    assert sum(fair.allow("t", capacity=1000, cap=1.0) for _ in range(30)) == 10  # the burst of a 1/s ceiling


def test_the_loop_is_shared_max_min_when_busy_the_heaviest_is_held_back_first():
    from router.limits import LoopShare

    now = [0.0]
    loop = LoopShare(window=2.0, clock=lambda: now[0])
    loop.charge("hostile", 1.2)  # 0.6 of the loop over the window
    loop.charge("honest", 0.6)  # 0.3: over tenant_loop_share (0.25) but under the fair level of the busy loop
    loop.charge("light", 0.02)
    assert loop.refuse("light", 0.25) is None
    assert loop.refuse("honest", 0.1) is not None  # a 0.2 busy level: 0.3 is over the fair level (0.095)
    now[0] += 0.2  # the fair level is recomputed (LEVEL_REFRESH)
    assert loop.refuse("hostile", 0.25) is not None
    assert loop.refuse("honest", 0.25) is not None  # 0.27 > the level (0.245) of a 0.5 busy loop and the floor
    only = LoopShare(window=2.0, clock=lambda: now[0])
    only.charge("alone", 1.9)
    assert only.refuse("alone", 0.25) is None  # alone: the whole loop


def test_retention_is_shared_max_min_once_the_router_is_full():
    now = [0.0]
    ledger = TenantRetentionLedger(clock=lambda: now[0])
    for i in range(10):  # a tenant alone fills the router's retention: no ceiling of its own
        assert ledger.allows("heavy", 100, math.inf, math.inf, 10, 10_000)
        ledger.hold("heavy", f"h{i}", 100, 100)
    assert not ledger.allows("heavy", 100, math.inf, math.inf, 10, 10_000)  # full, and it holds the most
    for i in range(4):  # another tenant still retains, up to its fair level (the router overshoots by at most that)
        assert ledger.allows("light", 100, math.inf, math.inf, 10, 10_000)
        ledger.hold("light", f"l{i}", 100, 100)
    assert ledger.allows("light", 100, math.inf, math.inf, 10, 10_000)
    ledger.hold("light", "l4", 100, 100)
    assert not ledger.allows("light", 100, math.inf, math.inf, 10, 10_000)  # 6 > the level (5)
    assert not ledger.allows("heavy", 100, math.inf, math.inf, 10, 10_000)
    for i in range(6):  # the heaviest shrinks as its turns are taken; at the level it retains again
        ledger.release(f"h{i}")
    assert ledger.allows("heavy", 100, math.inf, math.inf, 10, 10_000)
    assert ledger.allows("new", 10, 2, 1000, 10, 1000)  # a tenant holding nothing is under any fair level
    assert not ledger.allows("light", 10, 5, math.inf)  # a ceiling holds whatever the room
