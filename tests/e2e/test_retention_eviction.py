"""Decode above retained_kv_share on real vLLM CPU engines, no host tier: a newcomer never pushes out a turn still
likely to be read, unless its tenant is under its fair share of the room; an idle one is evicted for it (announced
on decode's evictions feed, its lease cut to the grace), the router never replays it, the turn kept still reuses,
and answers equal reuse-off. On the package's engines through its ``router-evict`` (a 3 s replay window, the feed
read every 0.2 s) and ``router-keyed`` (two tenants), with the share and grace hot-reloaded from the tunables file
for this module only.

It runs first in the package (conftest.py): decode must hold no other module's turns (checked), and its own
turns live 25 s (decoder_kv_blocks_ttl, for this module only), so the next module finds decode empty soon."""

from __future__ import annotations

import json
import time

import pytest
import requests

from tests.e2e import ACME, GLOBEX, TUNABLES
from tests.e2e.client import chat, metric, wait_for, words
from turnkv import params, wire

pytestmark = pytest.mark.engines
ROUTER = "router-evict"  # a 3 s replay window, the evictions feed read every 0.2 s (conftest.py)

GRACE = 10  # >= replay_window 3 + 2 x 0.2 + 1 + expiry_skew_margin 5 (the catalog's rule)
IDLE = 2  # retention_idle_evict: a turn unread this long may go for a newer one
# 1% of the 1,024-block cache: ~10 blocks, two 4-5-block turns; no host tier (the package's decode has one)
ENGINE = {"retained_kv_share": 0.01, "retention_eviction_grace": GRACE, "retention_idle_evict": IDLE,
          "host_kv_budget_mib": 0}
# A's natural expiry (25 s) comes well after its eviction's grace ends (~3 s + GRACE): only the cut frees it in time
TTL = 25


@pytest.fixture(scope="module", autouse=True)
def engine_tunables(stack):
    """ENGINE in force on decode until the module ends (the connector re-reads the file at most once a second)."""
    assert metric(stack["decode-0"], "vllm:turnkv_retained_requests") == 0, \
        "decode already holds turns of another module: this module must run first in the package (conftest.FIRST)"
    tunables = stack["state_dir"] / "tunables.json"
    tunables.write_text(json.dumps({**ENGINE, "decoder_kv_blocks_ttl": TTL}))
    time.sleep(1.2)
    try:
        yield
    finally:
        tunables.write_text(json.dumps({**{name: TUNABLES.get(name, params.BY_NAME[name].default) for name in ENGINE},
                                        "decoder_kv_blocks_ttl": TUNABLES["decoder_kv_blocks_ttl"]}))
        time.sleep(1.2)


def test_decode_keeps_turns_likely_to_be_read_evicts_an_idle_one_and_the_router_never_replays_it(stack):
    router, decode, model_dir = stack["router"], stack["decode-0"], stack["model_dir"]
    evicted_before = metric(decode, "vllm:turnkv_retention_evicted_total")
    idle_before = metric(decode, "vllm:turnkv_retention_evictions_total", reason="idle")
    full_before = metric(decode, "vllm:turnkv_retention_refusals_total", reason="full")
    expired_before = metric(decode, "vllm:nixl_num_kv_expired_reqs_total")
    firsts = {}
    for seed in (801, 802, 803):  # A, B, then C once A and B have been idle for IDLE s
        if seed == 803:
            time.sleep(IDLE + 0.5)
        messages = [{"role": "user", "content": words(model_dir, 450, seed)}]
        reply = chat(router, messages, conversation=f"evict-{seed}")
        assert reply.status == 200
        firsts[seed] = [*messages, {"role": "assistant", "content": reply.text},
                        {"role": "user", "content": words(model_dir, 40, seed + 50)}]
    # C found the share full: the oldest idle turn (A) went for it, and C itself waits for A's grace (not retained)
    assert metric(decode, "vllm:turnkv_retention_evictions_total", reason="idle") - idle_before == 1
    assert metric(decode, "vllm:turnkv_retention_evicted_total") - evicted_before == 1
    assert metric(decode, "vllm:turnkv_retention_refusals_total", reason="full") - full_before == 1
    # the engine answers feed reads from one shared read for up to TURNKV_EVICTIONS_CACHE_MS (500 ms; its "age"
    # says how old): the announcement shows within that
    feeds = []
    assert wait_for(lambda: feeds.append(requests.get(decode + wire.EVICTIONS_ROUTE, timeout=10).json())
                    or (feeds[-1]["seq"] >= 1 and len(feeds[-1]["evicted"]) >= 1), 3), feeds[-1]
    time.sleep(1.0)  # the router reads the feed every 0.2 s
    # B was kept: it reuses, with the answer reuse-off gives
    b = chat(router, firsts[802], conversation="evict-802")
    assert b.headers["X-TurnKV-Reuse-Outcome"] == "hit" and int(b.headers["X-TurnKV-Reused-Tokens"]) > 300
    assert b.token_ids == chat(router, firsts[802], reuse=False).token_ids
    # the evicted one is not replayed (its blocks are freed after the grace): recomputed, same answer
    a = chat(router, firsts[801], conversation="evict-801")
    assert a.headers["X-TurnKV-Reuse-Outcome"] == "refused" and a.headers["X-TurnKV-Reused-Tokens"] == "0"
    assert a.token_ids == chat(router, firsts[801], reuse=False).token_ids
    # C was not retained: nothing to replay, same answer
    c = chat(router, firsts[803], conversation="evict-803")
    assert c.headers["X-TurnKV-Reuse-Outcome"] == "miss"
    assert c.token_ids == chat(router, firsts[803], reuse=False).token_ids
    # the lease was cut to the grace: upstream's reaper freed the blocks long before decoder_kv_blocks_ttl
    time.sleep(GRACE + 2)
    assert metric(decode, "vllm:nixl_num_kv_expired_reqs_total") - expired_before >= 1


def test_a_tenant_under_its_share_makes_room_from_the_tenant_over_it(stack):
    """Two tenants through the keyed router, which names each retained turn's tenant (``turnkv.wire.TENANT``): acme
    fills decode's share with two turns still likely to be read (idle only after 120 s here); globex's first turn
    finds it full, and acme's oldest turn is evicted for it though not idle (one tenant alone would be refused with
    nothing evicted: the test above needs the idle time for that). Once the grace has passed globex's next turn is
    retained and reuses; acme keeps its other turn; every answer equals reuse off."""
    router, decode, model_dir = stack["router-keyed"], stack["decode-0"], stack["model_dir"]
    tunables = stack["state_dir"] / "tunables.json"
    assert wait_for(lambda: metric(decode, "vllm:turnkv_retained_requests") == 0, TTL + 10), \
        "the test above's turns outlived their TTL"
    tunables.write_text(json.dumps({**ENGINE, "retention_idle_evict": 120, "decoder_kv_blocks_ttl": TTL}))
    time.sleep(1.2)
    idle_before = metric(decode, "vllm:turnkv_retention_evictions_total", reason="idle")
    full_before = metric(decode, "vllm:turnkv_retention_refusals_total", reason="full")

    def first(key: str, seed: int) -> list[dict]:
        messages = [{"role": "user", "content": words(model_dir, 450, seed)}]
        reply = chat(router, messages, conversation=f"share-{seed}", key=key)
        assert reply.status == 200, reply.status
        return [*messages, {"role": "assistant", "content": reply.text},
                {"role": "user", "content": words(model_dir, 40, seed + 50)}]

    acme = {seed: first(ACME, seed) for seed in (811, 812)}
    globex_first = first(GLOBEX, 821)
    # acme held the room, over its half: its oldest went for globex (not idle), globex waits for the grace
    assert metric(decode, "vllm:turnkv_retention_evictions_total", reason="idle") - idle_before == 1
    assert metric(decode, "vllm:turnkv_retention_refusals_total", reason="full") - full_before == 1
    time.sleep(GRACE + 1.5)  # the evicted turn's blocks freed
    globex = first(GLOBEX, 822)
    kept = chat(router, acme[812], conversation="share-812", key=ACME)
    assert kept.outcome == "hit" and kept.reused > 300, (kept.outcome, kept.reused)
    assert kept.token_ids == chat(router, acme[812], reuse=False, key=ACME).token_ids
    evicted = chat(router, acme[811], conversation="share-811", key=ACME)
    assert evicted.outcome in ("refused", "miss") and evicted.reused == 0, (evicted.outcome, evicted.reused)
    assert evicted.token_ids == chat(router, acme[811], reuse=False, key=ACME).token_ids
    reused = chat(router, globex, conversation="share-822", key=GLOBEX)
    assert reused.outcome == "hit" and reused.reused > 300, (reused.outcome, reused.reused)
    assert reused.token_ids == chat(router, globex, reuse=False, key=GLOBEX).token_ids
    waited = chat(router, globex_first, conversation="share-821", key=GLOBEX)  # refused at first: nothing to reuse
    assert waited.outcome == "miss" and waited.token_ids == chat(router, globex_first, reuse=False,
                                                                  key=GLOBEX).token_ids
