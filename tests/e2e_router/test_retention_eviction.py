"""Decode above retained_kv_share on real vLLM CPU engines: the oldest retained turn is evicted (announced on
decode's evictions feed, its lease cut to the grace), the router never replays it, the newest still reuses,
and answers equal reuse-off. Ports 28020 (router), 28120/28220, 25640+."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import requests

from tests.e2e.client import chat, engine_stack, metric, words
from turnkv import wire
from turnkv.local.stack import StackConfig

pytestmark = pytest.mark.engines

STATE = Path(__file__).resolve().parents[2] / ".turnkv" / "e2e-router-evict"
GRACE = 10  # >= replay_window 3 + 2 x 0.2 + 1 + expiry_skew_margin 5 (the catalog's rule)
# 1% of the 1,024-block cache: ~10 blocks, two 4-5-block turns; the third evicts the first
ENGINE = {"retained_kv_share": 0.01, "retention_eviction_grace": GRACE}


@pytest.fixture(scope="module")
def stack():
    STATE.mkdir(parents=True, exist_ok=True)
    (STATE / "tunables.json").write_text(json.dumps(ENGINE))  # the connector's hot-reloaded tunables file
    config = StackConfig(state_dir=STATE, router_port=28020, prefill_port=28120, decode_port=28220,
                         side_channel_base=25640, kv_cache_gib=1,
                         tunables={"decoder_kv_blocks_ttl": 60, "conversation_ttl": 45, "replay_window": 3,
                                   "evictions_interval": 0.2, **ENGINE})
    with engine_stack(config) as running:
        yield running


def test_decode_evicts_its_oldest_turn_and_the_router_never_replays_it(stack):
    router, decode, model_dir = stack["router"], stack["decode-0"], stack["model_dir"]
    firsts = {}
    for seed in (301, 302, 303):  # A, B, C: C's retention evicts A (the oldest)
        messages = [{"role": "user", "content": words(model_dir, 450, seed)}]
        reply = chat(router, messages, conversation=f"evict-{seed}")
        assert reply.status == 200
        firsts[seed] = [*messages, {"role": "assistant", "content": reply.text},
                        {"role": "user", "content": words(model_dir, 40, seed + 50)}]
    assert metric(decode, "vllm:turnkv_retention_evicted_total") >= 1
    feed = requests.get(decode + wire.EVICTIONS_ROUTE, timeout=10).json()
    assert feed["seq"] >= 1 and len(feed["evicted"]) >= 1, feed
    time.sleep(1.0)  # the router reads the feed every 0.2 s
    # the newest turn was retained: it reuses, with the answer reuse-off gives
    c = chat(router, firsts[303], conversation="evict-303")
    assert c.headers["X-TurnKV-Reuse-Outcome"] == "hit" and int(c.headers["X-TurnKV-Reused-Tokens"]) > 300
    assert c.token_ids == chat(router, firsts[303], reuse=False).token_ids
    # the evicted one is not replayed (its blocks are freed after the grace): recomputed, same answer
    a = chat(router, firsts[301], conversation="evict-301")
    assert a.headers["X-TurnKV-Reuse-Outcome"] == "refused" and a.headers["X-TurnKV-Reused-Tokens"] == "0"
    assert a.token_ids == chat(router, firsts[301], reuse=False).token_ids
    # the lease was cut to the grace: upstream's reaper freed the blocks long before decoder_kv_blocks_ttl
    time.sleep(GRACE + 2)
    assert metric(decode, "vllm:nixl_num_kv_expired_reqs_total") >= 1
