"""bench.arms: the three arms' requests, a level's per-arm summary, capacity and issue 36's verdict (pure)."""

from __future__ import annotations

import pytest

from bench import arms, pressure
from bench import pressure_calc as calc
from bench.capacity import percentile
from bench.client import Result
from turnkv import wire


def r(conv: int, turn: int, arm: str, ttft: float, reply: str = "x", reused: int = 0, cached: int = 0,
      prompt: int = 900, error: str | None = None) -> Result:
    return Result(conv, turn, arm, ttft_ms=ttft, reply=reply, reused_tokens=reused, prefill_cached_tokens=cached,
                  prompt_tokens=prompt, error=error)


def test_arms_are_played_in_order_and_send_what_they_are():
    assert arms.parse_arms("on, off,peer") == ("off", "peer", "on")
    with pytest.raises(ValueError, match="best"):
        arms.parse_arms("off,best")
    assert arms.headers("on") == {}
    assert arms.headers("peer") == arms.headers("off") == {wire.REUSE_HEADER: wire.REUSE_OFF}
    salts = {arms.body_extras("off")["cache_salt"] for _ in range(3)}
    assert len(salts) == 3  # a new salt every request: prefill's cache can hold nothing of off
    assert arms.body_extras("peer") == arms.body_extras("on") == {}


def test_token_sources_split_pulls_by_tier_and_read_prefills_counters():
    on = [r(0, 0, "on", 100), r(0, 1, "on", 80, reused=600), r(0, 2, "on", 90, reused=300)]
    prefill = arms.sources_delta({"local_compute": 100.0}, {"local_compute": 900.0, "local_cache_hit": 1000.0,
                                                            "external_kv_transfer": 900.0})
    assert prefill == {"local_compute": 800, "local_cache_hit": 1000, "external_kv_transfer": 900}
    t = arms.token_sources("on", on, prefill, {"device": 2.0, "host": 1.0})
    assert (t["computed"], t["prefill_cache"], t["pulled_device"], t["pulled_host"]) == (800, 1000, 600, 300)
    peer = arms.token_sources("peer", [r(0, 1, "peer", 90, cached=700, reused=0)], None)
    assert (peer["computed"], peer["prefill_cache"], peer["pulled_device"], peer["pulled_host"]) == (200, 700, 0, 0)


def test_arm_summary_compares_answers_with_off_and_times_later_turns():
    off = [r(c, t, "off", 300, reply=f"{c}{t}") for c in range(2) for t in range(3)]
    on = [r(c, t, "on", 100 + 10 * t, reply=f"{c}{t}" if (c, t) != (1, 2) else "other") for c in range(2)
          for t in range(3)]
    s = arms.arm_summary("on", on, off)
    assert (s["answers_identical"], s["answers_compared"]) == (5, 6)
    assert s["later_p50_ms"] == percentile([110, 110, 120, 120], 50) and set(s["by_turn"]) == {"1", "2", "3"}
    assert s["by_turn"]["3"]["p50"] == 120 and s["by_turn"]["1"]["p90"] == 100


def level(lv: float, n: int, on: float, peer: float, off: float = 2000.0, errors: int = 0) -> dict:
    def a(p90: float, p50: float | None = None) -> dict:
        return {"later_p50_ms": p50 or p90 / 2, "later_p90_ms": p90, "errors": errors, "by_turn": {},
                "tokens": {"offload_tier": 0, "pulled_device": 0, "pulled_host": 0}, "answers_identical": 0,
                "answers_compared": 0}

    return {"level": lv, "conversations": n, "arms": {"off": a(off), "peer": a(peer), "on": a(on)}}


def test_capacity_and_the_verdict_of_issue_36():
    levels = [level(1, 4, on=300, peer=320), level(2, 8, on=500, peer=1400), level(4, 16, on=900, peer=3000)]
    assert arms.capacity(levels, "on", 1000) == 16 and arms.capacity(levels, "peer", 1000) == 4
    v = arms.verdict(levels, 1000)
    assert v["matches_at_1x"] and v["twice_at_4x"] and v["capacity_ratio"] == 4.0
    gap = [level(1, 4, on=300, peer=320), level(2, 8, on=1200, peer=900), level(4, 16, on=900, peer=3000)]
    assert arms.capacity(gap, "on", 1000) == 4  # 4x within the target does not count past a level that missed it
    worse = [level(1, 4, on=400, peer=320), level(4, 16, on=3000, peer=3000)]
    v = arms.verdict(worse, 1000)
    assert not v["matches_at_1x"] and not v["twice_at_4x"] and v["at_1x_p90_on_over_peer"] == 1.25
    text = arms.markdown(levels, 1000)
    assert "turnkv as deployed 16" in text and "peer-best 4" in text and "at least twice" in text
    assert len(arms.rows(levels)) == 9


def test_mooncake_think_times_have_the_traces_quantiles_scaled():
    think = calc.parse_think("mooncake:0.5")
    assert (think.kind, think.seconds, think.p90) == ("lognormal", 63.0, 243.0)
    conv = pressure.conversations(pressure.PressureOptions(turns=2), 1, 0)[0]
    delays = sorted(think.delays(conv._replace(index=i) if hasattr(conv, "_replace") else
                                 type(conv)(i, conv.system, conv.user_turns), 7)[1] for i in range(2000))
    assert delays[1000] == pytest.approx(63.0, rel=0.1) and delays[1800] == pytest.approx(243.0, rel=0.15)
    with pytest.raises(ValueError):
        calc.parse_think("mooncake:0")
    assert calc.parse_think("mooncake:1").quantile(0.9) == pytest.approx(486.0)
    assert calc.parse_think("mooncake:1").quantile(0.95) == pytest.approx(712.6, abs=0.1)


def test_the_agent_preset_is_three_arms_at_target_ratios():
    opts, variants, target = pressure.options(pressure.parser().parse_args(["--agent", "--levels", "1,4"]))
    assert opts.arms == ("off", "peer", "on") and opts.levels == [1.0, 4.0] and opts.exact_replies
    assert opts.fit_from == "prefill" and target is None
    config = pressure.arms_stack(variants[0], opts.prefill_blocks)
    assert (config["prefill_blocks"], config["peer_prefill_blocks"], config["decode_blocks"]) == (35, 35, 80)
    # the TTL outlasts the think times' p95 (Mooncake's 713 s scaled by 1/24: 29.7 s) by the expiry margin
    assert config["tunables"]["decoder_kv_blocks_ttl"] == 35 and config["tunables"]["host_kv_budget_mib"] == 93
    assert config["tunables"]["conversation_ttl"] == 30
    assert config["peer"] and config["prefill_prefix_caching"]
    with pytest.raises(ValueError, match="peer-url"):
        pressure.options(pressure.parser().parse_args(["--arms", "off,peer,on", "--url", "http://x"]))
