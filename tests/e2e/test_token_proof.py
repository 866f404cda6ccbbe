"""Token-verified reuse on real engines: pulled KV always belongs to the prompt."""

from __future__ import annotations

import time

import pytest
import requests

from tests.e2e.client import chat, metric, offer_secret, with_seals, words
from turnkv import wire

pytestmark = pytest.mark.engines

BLOCK = 128
# Renders every earlier assistant turn with a "result :" prefix that was never generated, as templates
# that strip reasoning or reformat tool calls do: text history matches, token positions do not.
REFORMATTING_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\nresult : ' + m['content'] + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def proof_counts(stack) -> dict[str, float]:
    names = ("offered_tokens", "verified_tokens", "rejected_tokens", "mismatches", "missing")
    return {n: metric(stack["prefill-0"], f"vllm:turnkv_proof_{n}_total") for n in names}


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def tokens(stack, messages, **extra) -> list[int]:
    body = {"model": "tiny", "messages": messages, "add_generation_prompt": True, **extra}
    return requests.post(f"{stack['prefill-0']}/tokenize", json=body, timeout=30).json()["tokens"]


def test_reply_rendered_differently_pulls_only_the_verified_blocks(stack):
    router, model_dir = stack["router"], stack["model_dir"]
    template = {"chat_template": REFORMATTING_TEMPLATE}
    messages = [{"role": "user", "content": words(model_dir, 700, 50)}]
    first = chat(router, messages, conversation="reformat", **template)
    assert first.status == 200, first.body
    prompt_len = len(tokens(stack, messages, **template))
    messages = [*messages, {"role": "assistant", "content": first.text},
                {"role": "user", "content": words(model_dir, 200, 51)}]
    before = proof_counts(stack)
    on = chat(router, messages, conversation="reformat", **template)
    counts = delta(proof_counts(stack), before)
    # The reply starts at prompt_len; the template inserted tokens there, so only whole blocks before it match.
    verified = prompt_len // BLOCK * BLOCK
    assert on.outcome == "token_mismatch" and on.reused == verified, (on.outcome, on.reused, verified)
    assert counts["mismatches"] == 1 and counts["verified_tokens"] == verified
    assert counts["rejected_tokens"] == counts["offered_tokens"] - verified > 0
    assert on.token_ids == chat(router, messages, reuse=False, **template).token_ids


def test_normal_turns_pull_everything_offered(stack):
    router, model_dir = stack["router"], stack["model_dir"]
    messages = [{"role": "user", "content": words(model_dir, 600, 60)}]
    first = chat(router, messages, conversation="normal-proof")
    messages = [*messages, {"role": "assistant", "content": first.text}, {"role": "user", "content": "next step"}]
    before = proof_counts(stack)
    on = chat(router, messages, conversation="normal-proof")
    counts = delta(proof_counts(stack), before)
    assert on.outcome == "hit" and on.reused == counts["verified_tokens"] == counts["offered_tokens"] > 600
    assert counts["mismatches"] == counts["rejected_tokens"] == counts["missing"] == 0


def _direct_turn(stack, messages, params=None, *, clear: bool = True) -> dict:
    """Prefill + decode straight against the engines: what a peer router holding the stack's offer secret would do
    (it clears the offer it replays, ``turnkv.wire.clear_offer``); ``clear=False`` sends the offer as it is."""
    fresh = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
             "remote_block_ids": None, "remote_host": None, "remote_port": None}
    if params is not None and clear:
        secret = offer_secret(stack)
        params = wire.clear_offer(secret, with_seals(stack["decode-0"], secret, params), time.time() + 30)
    base = {"model": "tiny", "messages": messages, "temperature": 0, "return_token_ids": True}
    p = requests.post(f"{stack['prefill-0']}/v1/chat/completions", timeout=120,
                      json={**base, "max_tokens": 1, "kv_transfer_params": params or fresh}).json()
    d = requests.post(f"{stack['decode-0']}/v1/chat/completions", timeout=120,
                      json={**base, "max_tokens": 16,
                            "kv_transfer_params": {**p["kv_transfer_params"], "turnkv_retain": True}}).json()
    return {"prefill": p, "decode": d}


def test_edited_history_replayed_by_a_careless_router_is_not_pulled(stack):
    """Even when a router replays decode's params for an edited conversation, prefill pulls nothing wrong."""
    model_dir = stack["model_dir"]
    messages = [{"role": "user", "content": words(model_dir, 500, 70)}]
    first = _direct_turn(stack, messages)
    reply = first["decode"]["choices"][0]["message"]["content"]
    edited = [{"role": "user", "content": words(model_dir, 500, 71)}, {"role": "assistant", "content": reply},
              {"role": "user", "content": "next"}]
    before = proof_counts(stack)
    pulled_before = metric(stack["prefill-0"], "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    second = _direct_turn(stack, edited, params=first["decode"]["kv_transfer_params"])
    counts = delta(proof_counts(stack), before)
    assert second["prefill"]["kv_transfer_params"]["turnkv_proof_verdict"]["verified"] == 0
    assert counts["mismatches"] == 1 and counts["verified_tokens"] == 0
    assert metric(stack["prefill-0"], "vllm:prompt_tokens_by_source_total",
                  source="external_kv_transfer") == pulled_before
    clean = _direct_turn(stack, edited)
    assert second["decode"]["choices"][0]["token_ids"] == clean["decode"]["choices"][0]["token_ids"]


def test_an_offer_restamped_with_another_boot_is_not_read(stack):
    """A decode engine that restarted keeps its id and block numbers but not its KV. The boot stamp is part of
    the signed offer, so an offer re-stamped with another boot (what a stale or confused router could send)
    fails the signature and is recomputed before any READ; an offer genuinely made by an earlier boot fails the
    worker's boot check (vllm:turnkv_stale_offers)."""
    model_dir = stack["model_dir"]
    messages = [{"role": "user", "content": words(model_dir, 500, 75)}]
    first = _direct_turn(stack, messages)
    offer = first["decode"]["kv_transfer_params"]
    assert len(offer["turnkv_boot"]) == 16
    follow = [*messages, {"role": "assistant", "content": first["decode"]["choices"][0]["message"]["content"]},
              {"role": "user", "content": "next"}]
    pulled = ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"})
    forged_before = metric(stack["prefill-0"], "vllm:turnkv_offers_forged_total")
    pulled_before = metric(stack["prefill-0"], pulled[0], **pulled[1])
    stale = _direct_turn(stack, follow, params={**offer, "turnkv_boot": "0" * 16})
    assert metric(stack["prefill-0"], "vllm:turnkv_offers_forged_total") == forged_before + 1
    assert metric(stack["prefill-0"], pulled[0], **pulled[1]) == pulled_before
    assert not stale["prefill"]["kv_transfer_params"].get("remote_prefill_cached_tokens")
    # the genuine offer (decode still holds the blocks: nothing read them) passes the check
    genuine = _direct_turn(stack, follow, params=offer)
    assert genuine["prefill"]["kv_transfer_params"].get("remote_prefill_cached_tokens", 0) > 500
    assert metric(stack["prefill-0"], "vllm:turnkv_offers_forged_total") == forged_before + 1
    assert stale["decode"]["choices"][0]["token_ids"] == genuine["decode"]["choices"][0]["token_ids"]
