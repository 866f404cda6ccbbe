"""Forks of one history all pull (issue 30): decode's offer says how long it keeps a read turn for further readers
(``fork_window``); the router replays it to every fork of the same tenant's same history until then, each replay
cleared for its own reader, and drops it after. Over fake engines that keep and free blocks as the connector does
(``bench.fake_engine``: a read past decode's hold is a stale read)."""

from __future__ import annotations

import asyncio
import time

from bench.fake_engine import FAKE_SECRET
from router.app import METRICS
from router.auth import ApiKeys, parse_keys
from tests.router.conftest import engines, router_over
from tests.router.test_flow_fake import MSGS, chat
from turnkv import wire


def branch(first_text: str, name: str) -> list[dict]:
    return [*MSGS, {"role": "assistant", "content": first_text}, {"role": "user", "content": f"branch {name}"}]


def outcome(r: dict) -> str:
    return r["headers"]["X-TurnKV-Reuse-Outcome"]


async def test_every_fork_within_the_window_pulls_and_each_reader_is_cleared_once():
    p, d = engines(1, "prefill"), engines(1, "decode", fork_window=30.0)
    async with router_over(p, d) as (s, app):
        first = await chat(s, conversation=None)
        forks = await asyncio.gather(*(chat(s, branch(first["text"], str(i)), conversation=None, stream=i % 2 == 1)
                                       for i in range(4)))
        assert [outcome(r) for r in forks] == ["hit"] * 4
        assert all(int(r["headers"]["X-TurnKV-Reused-Tokens"]) > 100 for r in forks)
        # a retry of one branch, later, pulls too
        again = await chat(s, branch(first["text"], "0"), conversation=None)
        assert outcome(again) == "hit"
        assert p[0].stats["wrong_reuse"] == p[0].stats["stale_reads"] == 0
        assert p[0].refused_offers == {}
        # every replay named its own reader: five distinct clearances of one signed offer
        replays = [kv for kv in p[0].seen_params if kv and kv.get("remote_block_ids") and kv.get(wire.READER)]
        assert len(replays) == 5 and len({kv[wire.READER] for kv in replays}) == 5
        assert len({kv[wire.SIGNATURE] for kv in replays}) == 1
        reg = app[METRICS].registry
        assert reg.get_sample_value("turnkv_router_fork_reads_total") == 4


async def test_the_same_clearance_is_read_once_even_for_a_fork_readable_offer():
    p, d = engines(1, "prefill"), engines(1, "decode", fork_window=30.0)
    async with router_over(p, d) as (s, _):
        first = await chat(s, conversation=None)
        await chat(s, branch(first["text"], "a"), conversation=None)
        [replayed] = [kv for kv in p[0].seen_params if kv and kv.get(wire.READER)]
        assert p[0]._admit_offer(dict(replayed)) == "replayed"
        forged = wire.clear_offer(FAKE_SECRET, replayed, replayed[wire.READ_BY],  # no reader: the offer's own key
                                  tenant=replayed[wire.CLEARED_TENANT])
        assert p[0]._admit_offer(forged) == "ok"  # an offer's first single-use read...
        assert p[0]._admit_offer(dict(forged)) == "replayed"  # ...and only one


async def test_past_the_window_a_fork_recomputes_and_nothing_stale_is_read():
    p, d = engines(1, "prefill"), engines(1, "decode", fork_window=1.0, eviction_grace=5.0)
    async with router_over(p, d) as (s, _):
        first = await chat(s, conversation=None)
        taken = time.time()
        assert outcome(await chat(s, branch(first["text"], "a"), conversation=None)) == "hit"
        assert outcome(await chat(s, branch(first["text"], "c"), conversation=None)) == "hit"
        # a fork's replay must be read by the end of the window the first read opened plus the slack, not within
        # the router's replay window (10 s): decode frees the turn then
        late_fork = [kv for kv in p[0].seen_params if kv and kv.get(wire.READER)][-1]
        assert late_fork[wire.READ_BY] <= taken + 1.0 + wire.FORK_READ_SLACK + 0.05
        await asyncio.sleep(1.2)
        late = await chat(s, branch(first["text"], "b"), conversation=None)
        assert outcome(late) == "miss" and late["text"]
        assert p[0].stats["stale_reads"] == 0 and p[0].stats["wrong_reuse"] == 0


async def test_without_a_fork_window_offers_stay_single_use():
    p, d = engines(1, "prefill"), engines(1, "decode")  # fork_window 0: upstream's single use
    async with router_over(p, d) as (s, app):
        first = await chat(s, conversation=None)
        ra, rb = await asyncio.gather(chat(s, branch(first["text"], "a"), conversation=None),
                                      chat(s, branch(first["text"], "b"), conversation=None))
        assert sorted([outcome(ra), outcome(rb)]) == ["hit", "miss"]
        assert not any(kv and kv.get(wire.READER) for kv in p[0].seen_params)
        assert app[METRICS].registry.get_sample_value("turnkv_router_fork_reads_total") == 0


async def test_forks_never_cross_tenants():
    keys = ApiKeys(parse_keys('{"tenants": {"acme": "key-acme-0123456789", "globex": "key-globex-0123456789"}}'))
    p, d = engines(1, "prefill"), engines(1, "decode", fork_window=30.0)
    async with router_over(p, d, keys=keys) as (s, _):
        acme = {"Authorization": "Bearer key-acme-0123456789"}
        globex = {"Authorization": "Bearer key-globex-0123456789"}
        first = await chat(s, conversation=None, headers=acme)
        assert outcome(await chat(s, branch(first["text"], "a"), conversation=None, headers=acme)) == "hit"
        assert outcome(await chat(s, branch(first["text"], "a"), conversation=None, headers=globex)) != "hit"
        assert outcome(await chat(s, branch(first["text"], "b"), conversation=None, headers=acme)) == "hit"
