"""Signed offers on real engines: prefill reads decode's KV only for a valid, live, unread offer (engine metrics)."""

from __future__ import annotations

import time

import pytest
import requests

from tests.e2e.client import metric, offer_secret, words
from tests.e2e.test_token_proof import _direct_turn
from turnkv import wire

pytestmark = pytest.mark.engines

PULLED = ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"})


def offers(stack) -> dict[str, float]:
    counts = {r: metric(stack["prefill-0"], f"vllm:turnkv_offers_{r}_total")
              for r in ("forged", "replayed", "expired", "unsigned", "uncleared")}
    counts["pulled"] = metric(stack["prefill-0"], PULLED[0], **PULLED[1])
    return counts


def first_turn(stack, seed):
    messages = [{"role": "user", "content": words(stack["model_dir"], 500, seed)}]
    first = _direct_turn(stack, messages)
    follow = [*messages, {"role": "assistant", "content": first["decode"]["choices"][0]["message"]["content"]},
              {"role": "user", "content": "next"}]
    return first["decode"]["kv_transfer_params"], follow


def test_decode_returns_a_signed_offer_with_a_wall_clock_expiry(stack):
    offer, _ = first_turn(stack, 80)
    assert offer["remote_blocks_expiry_time"] < 1e9  # vLLM's own: decode's perf_counter, not Unix time
    assert abs(offer[wire.EXPIRES_AT] - (time.time() + 60)) < 5  # the stack's decoder_kv_blocks_ttl
    secret = offer_secret(stack)
    assert wire.check_offer(secret, offer, offer[wire.MODEL], time.time(), 5) == "ok"


def test_forged_replayed_expired_and_unsigned_offers_are_never_read(stack):
    secret = offer_secret(stack)
    offer, follow = first_turn(stack, 81)
    before = offers(stack)
    # forged: another conversation's blocks, more tokens than decode holds
    forged = _direct_turn(stack, follow, params={**offer, "remote_block_ids": [[b + 1 for b in offer[
        "remote_block_ids"][0]]], "remote_num_tokens": offer["remote_num_tokens"] + 500})
    # unsigned: what upstream's decode (or a peer router that drops our keys) sends
    unsigned = _direct_turn(stack, follow, params={k: v for k, v in offer.items() if k != wire.SIGNATURE})
    # expired on prefill's own clock, validly signed (what a router holding the entry too long sends)
    expired = _direct_turn(stack, follow, params=wire.sign_offer(secret, dict(offer), time.time() + 2,
                                                                  offer[wire.MODEL]))
    after = offers(stack)
    assert {k: after[k] - before[k] for k in after} == {"forged": 1, "unsigned": 1, "expired": 1, "replayed": 0,
                                                       "uncleared": 0, "pulled": 0}
    # the genuine offer is read once; the same offer again (a replay) is not read
    genuine = _direct_turn(stack, follow, params=dict(offer))
    assert genuine["prefill"]["kv_transfer_params"]["remote_prefill_cached_tokens"] > 500
    mid = offers(stack)
    replay = _direct_turn(stack, follow, params=dict(offer))
    end = offers(stack)
    assert end["replayed"] == mid["replayed"] + 1 and end["pulled"] == mid["pulled"]
    answers = {tuple(x["decode"]["choices"][0]["token_ids"]) for x in (forged, unsigned, expired, genuine, replay)}
    assert len(answers) == 1  # every refused offer was recomputed into the same greedy answer


def test_a_genuine_offer_no_router_cleared_is_not_read(stack):
    """A valid, live, unread offer sent straight to prefill (from a log, by a proxy that does not read decode's
    evictions feed) is recomputed: decode may have evicted and freed its turn before its signed expiry. A read-by
    instant stamped without the secret does not pass either; the same offer cleared by a router is read."""
    offer, follow = first_turn(stack, 82)
    before = offers(stack)
    straight = _direct_turn(stack, follow, params=dict(offer), clear=False)
    self_stamped = _direct_turn(stack, follow, params={**offer, wire.READ_BY: time.time() + 30}, clear=False)
    mid = offers(stack)
    assert {k: mid[k] - before[k] for k in mid} == {"forged": 0, "unsigned": 0, "expired": 0, "replayed": 0,
                                                   "uncleared": 2, "pulled": 0}
    assert not straight["prefill"]["kv_transfer_params"].get("remote_prefill_cached_tokens")
    cleared = _direct_turn(stack, follow, params=dict(offer))
    end = offers(stack)
    assert cleared["prefill"]["kv_transfer_params"]["remote_prefill_cached_tokens"] > 500
    assert end["pulled"] - mid["pulled"] > 500 and end["uncleared"] == mid["uncleared"]
    answers = {tuple(x["decode"]["choices"][0]["token_ids"]) for x in (straight, self_stamped, cleared)}
    assert len(answers) == 1


def test_lease_route_is_authenticated_by_the_offer_and_bounded(stack):
    decode = stack["decode-0"]
    offer, _ = first_turn(stack, 82)
    url = decode + wire.LEASE_ROUTE
    forged = requests.post(url, json={"offers": [{**offer, "remote_num_tokens": 1}], "ttl": 30}, timeout=30)
    assert forged.status_code == 403
    assert requests.post(url, json={"request_ids": [offer["remote_request_id"]], "ttl": 30},
                         timeout=30).status_code == 400
    assert requests.post(url, json={"offers": [offer] * (wire.LEASE_MAX_OFFERS + 1), "ttl": 30},
                         timeout=30).status_code == 400
    ok = requests.post(url, json={"offers": [offer], "ttl": 300}, timeout=30)
    assert ok.status_code == 200, ok.text
    renewed = ok.json()["renewed"][offer["remote_request_id"]]
    assert renewed[wire.EXPIRES_AT] > offer[wire.EXPIRES_AT] + 200
    secret = offer_secret(stack)
    assert wire.check_offer(secret, renewed, offer[wire.MODEL], time.time(), 5) == "ok"
