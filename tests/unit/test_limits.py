"""Pure limits and the router's input/output hygiene: admission, retention, rate, request ids, error text, media."""

from __future__ import annotations

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
