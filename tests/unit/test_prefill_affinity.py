"""Prefill affinity (router.engines.prefix): the prefix key and the bounded rendezvous choice, pure."""

from __future__ import annotations

from collections import Counter

import pytest

from router import guard
from router.engines import Engine, EnginePool
from router.engines import prefix as affinity
from router.engines.policy import LeastLoad
from turnkv import params

SYSTEM = {"role": "system", "content": "You are a coding agent. " * 80}
TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": {"type": "object"}}} for i in range(3)]
MIN = int(params.get("prefill_affinity_min_bytes").default)


def body(*messages, **extra):
    return {"model": "m", "messages": list(messages), "cache_salt": "salt", **extra}


def turn(*messages, **extra):
    return guard.parse_turn("chat", body(*messages, **extra))


def prefill(n: int) -> list[Engine]:
    return [Engine(f"http://10.0.0.{i + 1}:8000", "prefill", engine_id=f"prefill-{i}") for i in range(n)]


def keys(n: int) -> list[str]:
    return [affinity.key("acme", turn({"role": "system", "content": f"prompt {i} " * 300},
                                      {"role": "user", "content": "hi"}), MIN) for i in range(n)]


def choose(key, engines, tunables=None):
    tunables = {} if tunables is None else tunables
    policy = LeastLoad()
    return affinity.choose(key, engines, now=0.0, tunables=tunables,
                           fallback=lambda: policy.choose(engines, now=0.0, preferred=None, tunables=tunables))


# -- the key ---------------------------------------------------------------------------------------------------


def test_conversations_with_one_system_prompt_share_a_key_whatever_follows():
    a = affinity.key("acme", turn(SYSTEM, {"role": "user", "content": "fix the bug"}), MIN)
    b = affinity.key("acme", turn(SYSTEM, {"role": "user", "content": "write a test"},
                                  {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}), MIN)
    assert a and a == b


def test_the_key_is_tenant_scoped_and_follows_the_render_settings_and_leading_messages():
    base = turn(SYSTEM, {"role": "user", "content": "hi"})
    key = affinity.key("acme", base, MIN)
    assert key != affinity.key("globex", base, MIN)
    assert key != affinity.key("acme", turn(SYSTEM, {"role": "user", "content": "hi"}, model="other"), MIN)
    assert key != affinity.key("acme", turn(SYSTEM, {"role": "user", "content": "hi"}, tools=TOOLS), MIN)
    other_system = {"role": "system", "content": SYSTEM["content"] + "!"}
    assert key != affinity.key("acme", turn(other_system, {"role": "user", "content": "hi"}), MIN)
    # a second leading message (a developer message) is part of the prefix
    dev = {"role": "developer", "content": "be brief"}
    assert key != affinity.key("acme", turn(SYSTEM, dev, {"role": "user", "content": "hi"}), MIN)
    assert turn(SYSTEM, dev, {"role": "user", "content": "hi"}).prefix.messages == 2


def test_no_key_without_a_shared_prefix_worth_routing_for():
    short = turn({"role": "system", "content": "You are helpful."}, {"role": "user", "content": "hi"})
    assert affinity.key("acme", short, MIN) == ""
    assert affinity.key("acme", turn({"role": "user", "content": "x" * 10_000}), MIN) == ""  # no system message
    assert affinity.key("acme", None, MIN) == ""  # n > 1, remote media: no turn
    completion = guard.parse_turn("completion", {"model": "m", "prompt": "x" * 10_000})
    assert affinity.key("acme", completion, MIN) == ""
    # long tool schemas alone are a shared prefix (templates render them first)
    many_tools = [{"type": "function", "function": {"name": f"t{i}", "description": "d" * 100}} for i in range(20)]
    assert affinity.key("acme", turn({"role": "user", "content": "hi"}, tools=many_tools), MIN)
    # the threshold is the tunable's
    assert affinity.key("acme", short, 1) != ""


def test_the_shared_prefix_costs_no_change_to_the_content_addresses():
    messages = [SYSTEM, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"}]
    t = turn(*messages)
    render = guard.render_digest("chat", body(*messages))
    assert t.lookup.digest == guard.history_digest(messages[:3], render)
    assert t.prefix.digest == guard.history_digest(messages[:1], render)
    assert t.prefix.size == len(guard._canonical(guard.canonical_message(SYSTEM)))


# -- the choice ------------------------------------------------------------------------------------------------


def test_the_same_key_goes_to_the_same_engine_whatever_the_order():
    engines = prefill(4)
    for key in keys(20):
        chosen = {choose(key, engines)[0].name for _ in range(5)}
        assert len(chosen) == 1
        assert choose(key, list(reversed(engines)))[0].name in chosen


def test_keys_spread_over_the_engines():
    engines = prefill(4)
    homes = Counter(affinity.home(k, engines).name for k in keys(400))
    assert set(homes) == {e.name for e in engines}
    assert all(60 <= n <= 140 for n in homes.values()), homes  # 100 expected each


def test_an_engine_leaving_moves_only_its_keys_and_one_joining_takes_only_keys():
    engines = prefill(4)
    ks = keys(400)
    before = {k: affinity.home(k, engines).name for k in ks}
    gone = engines[2]
    after = {k: affinity.home(k, [e for e in engines if e is not gone]).name for k in ks}
    moved = {k for k in ks if before[k] != after[k]}
    assert moved == {k for k in ks if before[k] == gone.name} and moved
    joined = [*engines, Engine("http://10.0.0.9:8000", "prefill", engine_id="prefill-9")]
    grown = {k: affinity.home(k, joined).name for k in ks}
    assert all(grown[k] in (before[k], "prefill-9") for k in ks)
    assert 40 <= sum(grown[k] == "prefill-9" for k in ks) <= 120  # about a fifth


def test_the_load_bound_spills_to_the_least_loaded_engine():
    engines = prefill(2)
    key = keys(1)[0]
    home = affinity.home(key, engines)
    other = next(e for e in engines if e is not home)
    slack = int(params.get("prefill_affinity_slack").default)
    home.outstanding = slack  # exactly the slack busier: still home
    assert choose(key, engines) == (home, "affinity")
    home.outstanding = slack + 1
    assert choose(key, engines) == (other, "load")
    home.outstanding, home.outstanding_tokens = 0, (slack + 1) * int(params.get("tokens_per_request").default)
    assert choose(key, engines) == (other, "load")  # queued prompt tokens count as load
    assert choose(key, engines, {"prefill_affinity_slack": slack + 2}) == (home, "affinity")


def test_no_key_or_slack_zero_is_todays_choice():
    engines = prefill(3)
    engines[0].outstanding, engines[1].outstanding = 3, 1
    assert choose("", engines) == (engines[2], "no_key")
    key = next(k for k in keys(50) if affinity.home(k, engines) is engines[0])
    assert choose(key, engines)[1] == "affinity"
    assert choose(key, engines, {"prefill_affinity_slack": 0}) == (engines[2], "no_key")


def test_a_returning_engine_in_slow_start_does_not_take_its_keys_back_at_once():
    engines = prefill(2)
    key = keys(1)[0]
    home = affinity.home(key, engines)
    home.returned_at = 100.0  # just back: weight 0.1, so even idle it scores ten requests
    tunables = {"slow_start": 30}
    policy = LeastLoad()
    engine, reason = affinity.choose(key, engines, now=100.0, tunables=tunables,
                                     fallback=lambda: policy.choose(engines, now=100.0, preferred=None,
                                                                    tunables=tunables))
    assert engine is not home and reason == "load"


@pytest.mark.parametrize("policy", ["least_load", "round_robin"])
def test_the_pool_retry_goes_to_the_keys_next_home(policy):
    from router.engines.policy import POLICIES

    pool = EnginePool(prefill(3), ["http://10.0.1.1:8000"], policy=POLICIES[policy]())
    key = keys(1)[0]
    first, reason = pool.pick_prefill(key)
    assert reason == "affinity" and first is affinity.home(key, pool.prefill)
    second, _ = pool.pick_prefill(key, exclude=[first])
    assert second is affinity.home(key, [e for e in pool.prefill if e is not first])
    first.healthy = False  # ejected: its keys go to their next home, the others stay
    assert pool.pick_prefill(key)[0] is second
