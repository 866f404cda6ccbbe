"""The three arms of every A/B (pure: no I/O): what each sends, and a level's and a sweep's summary.

- ``off``: no prefix cache. Reuse off (``X-TurnKV-Reuse: off``) through turnkv's router, and a fresh
  ``cache_salt`` on every request, so prefill's prefix cache can hold nothing of it: prefill recomputes the
  whole prompt, as with prefix caching off (the setting of the seed benchmarks, the weakest baseline).
- ``peer``: peer-best, what a user would run instead of turnkv: a prefill engine of its own with prefix caching on
  and the offload tier's memory as more prefix cache (``StackConfig.peer``), prefix-cache-aware prefill choice (the
  router's, ``router.engines.prefix``), the same decode engines, and no decode-to-prefill reuse (reuse off).
- ``on``: turnkv as deployed: prefill prefix caching on, decode retention (device and host tier), pulls.

Arms never share a prefill cache: ``peer`` has its own engine; ``off`` shares turnkv's prefill engine, but every one
of its requests carries its own salt, so nothing it leaves there matches a later request. Arms play one after the
other (``PLAY_ORDER``): played at once they would queue behind each other on the two cores, and turnkv plays last,
so the turns decode retains for it never take decode room from the other arms.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

from bench.arm_names import LABELS
from bench.capacity import percentile
from bench.client import REUSE_OFF_HEADERS, Result

ARMS = ("off", "peer", "on")
PLAY_ORDER = ARMS
#: vLLM's ``vllm:prompt_tokens_by_source`` label values (PromptTokenStats): computed, own prefix cache, connector.
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"


def parse_arms(text: str) -> tuple[str, ...]:
    arms = tuple(a.strip() for a in text.split(",") if a.strip())
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms:
        raise ValueError(f"--arms {text!r}: use a comma list of {', '.join(ARMS)}")
    return tuple(a for a in PLAY_ORDER if a in arms)


def headers(arm: str) -> dict[str, str]:
    """The router headers of an arm's requests."""
    return {} if arm == "on" else dict(REUSE_OFF_HEADERS)


def body_extras(arm: str) -> dict[str, str]:
    """Body fields an arm adds to each request: ``off``'s salt, new every request."""
    return {"cache_salt": f"off-{uuid.uuid4().hex}"} if arm == "off" else {}


def sources_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Prompt tokens by source over a phase, from two ``{source: counter}`` reads of the arm's prefill engine."""
    return {s: round(after.get(s, 0.0) - before.get(s, 0.0)) for s in PROMPT_SOURCES}


def token_sources(arm: str, results: list[Result], prefill: dict[str, float] | None,
                  pulls_by_tier: dict[str, float] | None = None) -> dict[str, Any]:
    """Prompt tokens by source for one arm and level: computed and prefill's own cache from prefill's counters
    (``prefill``: ``sources_delta``), pulled from decode from the router's ``X-TurnKV-Reused-Tokens``, split between
    decode's device and host tier in proportion to prefill's pulls by tier (``vllm:turnkv_pulls_total{tier}``
    counts pulls, not tokens: the split is an estimate). The peer's offload tier is its prefix cache here (the CPU
    build runs no offloading connector), so its hits count as prefill cache."""
    ok = [r for r in results if r.error is None]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    pulled = sum(r.reused_tokens for r in ok) if arm == "on" else 0
    out: dict[str, Any] = {"prompt": prompt}
    if prefill:
        out["computed"] = prefill.get("local_compute", 0)
        out["prefill_cache"] = prefill.get("local_cache_hit", 0)
        out["connector"] = prefill.get("external_kv_transfer", 0)
    else:  # no counters: the router's headers alone
        cached = sum(r.prefill_cached_tokens for r in ok)
        out.update(computed=max(0, prompt - cached - pulled), prefill_cache=cached, connector=pulled)
    out["offload_tier"] = 0
    tiers = {k: v for k, v in (pulls_by_tier or {}).items() if v > 0}
    total = sum(tiers.values())
    out["pulled_device"] = round(pulled * tiers.get("device", 0) / total) if total else pulled
    out["pulled_host"] = pulled - out["pulled_device"]
    return out


def _by_turn(results: list[Result]) -> dict[str, dict[str, float | None]]:
    turns = sorted({r.turn for r in results})
    return {str(t + 1): {"p50": percentile((r.ttft_ms for r in results if r.turn == t), 50),
                         "p90": percentile((r.ttft_ms for r in results if r.turn == t), 90)} for t in turns}


def arm_summary(arm: str, results: list[Result], off: list[Result] | None, prefill: dict[str, float] | None = None,
                pulls_by_tier: dict[str, float] | None = None) -> dict[str, Any]:
    """One arm at one level: TTFT p50/p90 (every turn, turns 2+, and by turn), errors, tokens by source, and answers
    identical to the ``off`` arm's (same conversation and turn)."""
    ok = [r for r in results if r.error is None]
    later = [r for r in ok if r.turn > 0]
    off_by = {(r.conversation, r.turn): r.reply for r in (off or []) if r.error is None}
    pairs = [(r.reply, off_by[(r.conversation, r.turn)]) for r in ok if (r.conversation, r.turn) in off_by]
    return {
        "requests": len(results), "errors": len(results) - len(ok),
        "ttft_p50_ms": percentile((r.ttft_ms for r in ok), 50), "ttft_p90_ms": percentile((r.ttft_ms for r in ok), 90),
        "later_p50_ms": percentile((r.ttft_ms for r in later), 50),
        "later_p90_ms": percentile((r.ttft_ms for r in later), 90),
        "by_turn": _by_turn(ok),
        "later_turns_pulled": sum(1 for r in later if r.reused_tokens > 0), "later_turns": len(later),
        "answers_compared": len(pairs), "answers_identical": sum(1 for a, b in pairs if a == b),
        "tokens": token_sources(arm, results, prefill, pulls_by_tier),
    }


def capacity(levels: list[dict[str, Any]], arm: str, target_ms: float) -> int:
    """The most live conversations an arm served with its TTFT p90 on turns 2+ within ``target_ms`` and no errors,
    at that level and at every smaller level played (0: not even the smallest). Levels are the sweep's, so capacity is
    known to the level's resolution."""
    served = 0
    for lv in sorted((lv for lv in levels if arm in lv.get("arms", {})), key=lambda lv: lv["conversations"]):
        a = lv["arms"][arm]
        if a["later_p90_ms"] is None or a["later_p90_ms"] > target_ms or a["errors"]:
            break
        served = lv["conversations"]
    return served


def verdict(levels: list[dict[str, Any]], target_ms: float) -> dict[str, Any]:
    """Issue 36's bar: turnkv as deployed at least matches peer-best at 1x (TTFT p50 and p90 of turns 2+), and has
    at least twice its capacity at the same TTFT p90 target at 4x (capacity counted over the levels up to 4x)."""
    one = next((lv for lv in levels if lv["level"] == 1 and {"on", "peer"} <= set(lv.get("arms", {}))), None)
    out: dict[str, Any] = {"ttft_p90_target_ms": target_ms}
    if one:
        on, peer = one["arms"]["on"], one["arms"]["peer"]
        out["at_1x_p50_on_over_peer"] = _ratio(on["later_p50_ms"], peer["later_p50_ms"])
        out["at_1x_p90_on_over_peer"] = _ratio(on["later_p90_ms"], peer["later_p90_ms"])
        out["matches_at_1x"] = (out["at_1x_p50_on_over_peer"] is not None and out["at_1x_p50_on_over_peer"] <= 1.0
                                and out["at_1x_p90_on_over_peer"] is not None
                                and out["at_1x_p90_on_over_peer"] <= 1.0)
    upto4 = [lv for lv in levels if lv["level"] <= 4 and "arms" in lv]
    if any(lv["level"] == 4 for lv in upto4):
        on_cap, peer_cap = capacity(upto4, "on", target_ms), capacity(upto4, "peer", target_ms)
        out.update(capacity_on=on_cap, capacity_peer=peer_cap,
                   capacity_ratio=round(on_cap / peer_cap, 2) if peer_cap else None,
                   twice_at_4x=bool(peer_cap and on_cap >= 2 * peer_cap))
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def rows(levels: Iterable[dict[str, Any]]) -> list[list[str]]:
    """The three-arm table: one row per level and arm."""
    def ms(v: float | None) -> str:
        return f"{v:,.0f}" if v is not None else "-"

    out = []
    for lv in levels:
        for arm, a in lv.get("arms", {}).items():
            t = a["tokens"]
            turns = " / ".join(f"{ms(v['p50'])}·{ms(v['p90'])}" for v in a["by_turn"].values())
            out.append([f"{lv['level']:g}x", str(lv["conversations"]), LABELS[arm], ms(a["later_p50_ms"]),
                        ms(a["later_p90_ms"]), turns,
                        f"{t.get('computed', 0):,} / {t.get('prefill_cache', 0):,} / {t['offload_tier']:,} / "
                        f"{t['pulled_device']:,} / {t['pulled_host']:,}",
                        f"{a['answers_identical']}/{a['answers_compared']}" if arm != "off" else "-",
                        str(a["errors"])])
    return out


HEADER = ["level", "conversations", "arm", "TTFT p50, turns 2+ (ms)", "TTFT p90, turns 2+ (ms)",
          "TTFT p50·p90 by turn (ms)",
          "prompt tokens: computed / prefill cache / offload / pulled device / pulled host", "identical to off",
          "errors"]


def markdown(levels: list[dict[str, Any]], target_ms: float) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in rows(levels)]
    v = verdict(levels, target_ms)
    caps = ", ".join(f"{LABELS[arm]} {capacity(levels, arm, target_ms)}" for arm in ARMS
                     if any(arm in lv.get("arms", {}) for lv in levels))
    lines.append("")
    lines.append(f"Capacity at TTFT p90 (turns 2+) <= {target_ms:g} ms, in live conversations: {caps}.")
    if "matches_at_1x" in v:
        lines.append(f"At 1x, turnkv / peer TTFT turns 2+: p50 {v['at_1x_p50_on_over_peer']}, p90 "
                     f"{v['at_1x_p90_on_over_peer']} ({'matches' if v['matches_at_1x'] else 'does NOT match'}).")
    if "twice_at_4x" in v:
        lines.append(f"Up to 4x: capacity turnkv {v['capacity_on']} against peer {v['capacity_peer']} "
                     f"({'at least' if v['twice_at_4x'] else 'NOT'} twice).")
    return "\n".join(lines)
