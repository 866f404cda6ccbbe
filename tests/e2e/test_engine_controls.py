"""Connector controls on real engines: retain on demand and hot-reloaded tunables."""

from __future__ import annotations

import json
import time

import pytest
import requests

from tests.e2e.client import chat, metric, wait_for, words

pytestmark = pytest.mark.engines


def decode_kv_usage(stack) -> float:
    return metric(stack["decode-0"], "vllm:kv_cache_usage_perc")


def test_only_reusable_turns_retain_decode_blocks(stack):
    router, model_dir = stack["router"], stack["model_dir"]
    assert wait_for(lambda: decode_kv_usage(stack) == 0.0, 90), "decode still holds blocks from earlier tests"
    one_shot = chat(router, [{"role": "user", "content": words(model_dir, 1500, 80)}], reuse=False)
    assert one_shot.status == 200
    time.sleep(0.5)
    assert decode_kv_usage(stack) == 0.0, "a request with reuse off pinned decode blocks"
    turn = chat(router, [{"role": "user", "content": words(model_dir, 1500, 81)}])  # no id: any turn may go on
    assert turn.status == 200
    assert decode_kv_usage(stack) > 0.0, "a turn must keep its KV for the next turn"


def test_hot_reload_of_the_recompute_threshold(stack):
    router, model_dir = stack["router"], stack["model_dir"]
    tunables = stack["state_dir"] / "tunables.json"
    messages = [{"role": "user", "content": words(model_dir, 300, 90)}]

    def next_turn(conversation: str):
        first = chat(router, messages, conversation=conversation)
        return chat(router, [*messages, {"role": "assistant", "content": first.text},
                             {"role": "user", "content": "go on"}], conversation=conversation)

    try:
        tunables.write_text(json.dumps({"kv_recompute_threshold": 100000}))
        time.sleep(1.2)
        cold = next_turn("reload-a")
        assert cold.outcome == "recompute" and cold.reused == 0, "threshold above the offer: prefill recomputes"
        tunables.write_text(json.dumps({"kv_recompute_threshold": -1}))  # refused, last good value stays
        time.sleep(1.2)
        still = next_turn("reload-b")
        assert still.reused == 0
        log = (stack["state_dir"] / "logs" / "prefill-0.log").read_text()
        assert "refused kv_recompute_threshold: -1 is out of range" in log
    finally:
        tunables.write_text(json.dumps({"kv_recompute_threshold": 64, "decoder_kv_blocks_ttl": 60}))
        time.sleep(1.2)
    warm = next_turn("reload-c")
    assert warm.outcome == "hit" and warm.reused > 300


def test_tiny_reuse_is_recomputed_and_large_reuse_pulled(stack):
    router, model_dir = stack["router"], stack["model_dir"]
    prefill = stack["prefill-0"]

    def decisions():
        return (metric(prefill, "vllm:turnkv_decisions_total", decision="pull"),
                metric(prefill, "vllm:turnkv_decisions_total", decision="recompute"))

    short = [{"role": "user", "content": "hello you"}]
    first = chat(router, short, conversation="tiny", max_tokens=8)
    pulls, recomputes = decisions()
    tiny = chat(router, [*short, {"role": "assistant", "content": first.text}, {"role": "user", "content": "more"}],
                conversation="tiny", max_tokens=8)
    assert tiny.outcome == "recompute" and tiny.reused == 0, "fewer tokens than kv_recompute_threshold"
    assert decisions() == (pulls, recomputes + 1)
    long = [{"role": "user", "content": words(model_dir, 1200, 95)}]
    first = chat(router, long, conversation="large")
    large = chat(router, [*long, {"role": "assistant", "content": first.text}, {"role": "user", "content": "more"}],
                 conversation="large")
    assert large.reused > 1200 and decisions()[0] == pulls + 1
    # The cost model has learned both sides by now and exports them: compute from the engine's steps, the
    # transfer from the NIXL READ the worker posted (far below recomputing), the handshake apart.
    compute = metric(prefill, "vllm:turnkv_compute_seconds_per_token")
    pull = metric(prefill, "vllm:turnkv_pull_seconds_per_token")
    assert compute > 0 and 0 < pull < compute
    assert metric(prefill, "vllm:turnkv_handshake_seconds") > 0
    assert metric(prefill, "vllm:turnkv_decision_reasons_total", reason="floor") >= 1
    assert metric(prefill, "vllm:turnkv_decision_tokens") > 1200


def test_router_renews_a_conversation_lease_past_the_engine_ttl(stack):
    router, model_dir = stack["router"], stack["model_dir"]
    tunables = stack["state_dir"] / "tunables.json"
    messages = {name: [{"role": "user", "content": words(model_dir, 400, seed)}]
                for name, seed in (("leased", 100), ("unleased", 101))}
    try:
        tunables.write_text(json.dumps({"decoder_kv_blocks_ttl": 12, "kv_recompute_threshold": 64}))
        time.sleep(1.2)
        firsts = {name: chat(router, m, conversation=name) for name, m in messages.items()}
        so_far = [*messages["leased"], {"role": "assistant", "content": firsts["leased"].text}]
        renewed = requests.post(f"{router}/v1/conversations/lease", timeout=30,
                                json={"messages": so_far, "model": "tiny", "ttl": 60})
        assert renewed.status_code == 200, renewed.text
        assert 45 < renewed.json()["expires_in"] <= 50  # 60 s minus the router's expiry margin
        missing = requests.post(f"{router}/v1/conversations/lease", timeout=30,
                                json={"messages": [*so_far[:-1], {"role": "assistant", "content": "never said"}],
                                      "model": "tiny"})
        assert missing.status_code == 404
        time.sleep(16)  # past the engine's 12 s TTL (+ prefill's 5 s safety margin)
        seconds = {name: chat(router, [*m, {"role": "assistant", "content": firsts[name].text},
                                       {"role": "user", "content": "go on"}], conversation=name)
                   for name, m in messages.items()}
    finally:
        tunables.write_text(json.dumps({"kv_recompute_threshold": 64, "decoder_kv_blocks_ttl": 60}))
        time.sleep(1.2)
    assert seconds["leased"].outcome == "hit" and seconds["leased"].reused > 400
    assert seconds["unleased"].reused == 0, "without renewal the engine TTL expired and prefill recomputed"
