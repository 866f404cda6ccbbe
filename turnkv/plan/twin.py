"""The local twin: predict what `turnkv bench capacity` measures on the local stack, before it runs. Pure.

`bench capacity` plays, at each level N, N conversations at once in a closed loop (each sends its next turn as
soon as the previous reply ends: no think time), reuse off then reuse on, on one prefill and one decode engine
that share this machine's cores. The twin describes the same conversations as a planner workload (one token per
word, the chat template's tokens per message), prices every turn with the closed form (``turn_costs``: the hops,
prefill over what prefill's own prefix cache holds, the pull of the tail it lacks and its fixed cost, the
transfers) at the calibrated local-cpu constants, and queues them by exact mean value analysis of the closed
loop: N clients over one processor-shared CPU station (both engines' compute: prefill chunks and decode
steps) and a delay for the rest. Each turn's compute is stretched by the jobs it shares the CPU with
(``1 + Q(N-1)``, the arrival theorem), at the number of conversations actually active together (the
benchmark staggers their starts and each plays only a few turns: ``overlap``). The highest level sustained
follows `bench capacity`'s rule: the last level, going up, whose TTFT p90 stays within twice the reuse-off p90
of the lowest level.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from turnkv.plan import closed_form as m
from turnkv.plan.workload import Distribution, Workload, sample

#: bench.workload's system prompt opens with these words ("you are an agent . tools : search read open run
#: test ."), and the chat template adds tokens per message (demo.json: 518 tokens for 500 system words).
SYSTEM_OPENING = 13
TEMPLATE_PER_MESSAGE = 3
SYSTEM_EXTRA = 18  # opening words + the system message's template tokens + the sequence start
#: Later turns open with "tool result :" or "user :" (3 or 2 words).
ROLE_HINT = (2, 3)
#: bench.capacity's default target: this many times the reuse-off p90 of the lowest level.
TARGET_FACTOR = 2.0
#: bench.capacity's default --stagger: seconds between conversation starts.
STAGGER_S = 0.2


@dataclass(frozen=True)
class CapacitySpec:
    """The arguments of `turnkv bench capacity` that shape its conversations."""

    turns: int = 6
    system_words: int = 200
    first_user_words: int = 300
    turn_words: int = 200
    max_tokens: int = 16

    def workload(self, conversations: int) -> Workload:
        """The same conversations as a planner workload (vLLM's generator format, one token per word)."""
        first_new = self.turn_words + sum(ROLE_HINT) / 2
        return Workload(
            num_conversations=conversations,
            num_turns=Distribution("constant", {"value": 2.0 * self.turns}),
            common_prefix_num_tokens=Distribution("constant", {"value": float(self.system_words + SYSTEM_EXTRA)}),
            prefix_num_tokens=Distribution("constant", {"value": float(max(self.first_user_words - first_new, 0))}),
            num_tokens=Distribution("uniform", {"min": float(self.turn_words + ROLE_HINT[0]),
                                                "max": float(self.turn_words + ROLE_HINT[1])}),
            output_num_tokens=Distribution("constant", {"value": float(self.max_tokens)}),
            num_clients=conversations, template_tokens_per_message=TEMPLATE_PER_MESSAGE)


def mva_stretch(clients: int, demand_s: float, delay_s: float) -> tuple[float, float]:
    """(stretch 1 + Q(N-1) a job sees at the CPU, throughput in turns/s) of a closed loop of ``clients`` over
    one processor-shared station of mean ``demand_s`` per turn and a delay of ``delay_s`` (exact MVA)."""
    q = 0.0
    stretch, x = 1.0, 0.0
    for n in range(1, clients + 1):
        stretch = 1.0 + q
        r = demand_s * stretch
        x = n / (r + delay_s) if r + delay_s > 0 else 0.0
        q = x * r
    return stretch, x


def overlap(clients: int, length_s: float, stagger_s: float) -> float:
    """Conversations a turn shares the machine with, on average, itself included, when conversation i starts at
    i x ``stagger_s`` and lasts ``length_s``: the mean over pairs of the share of one's time the other is active."""
    if clients <= 1 or length_s <= 0:
        return 1.0
    i = np.arange(clients)
    gap = np.abs(i[:, None] - i[None, :]) * stagger_s
    return float(np.clip(1 - gap / length_s, 0.0, 1.0).sum() / clients)


def mva_stretch_at(clients: float, demand_s: float, delay_s: float) -> tuple[float, float]:
    """``mva_stretch`` at a fractional client count (linear between the whole counts around it)."""
    lo = max(1, int(np.floor(clients)))
    a, b = mva_stretch(lo, demand_s, delay_s), mva_stretch(lo + 1, demand_s, delay_s)
    w = min(max(clients - lo, 0.0), 1.0)
    return a[0] + w * (b[0] - a[0]), a[1] + w * (b[1] - a[1])


def _decode_s(fleet: m.Fleet, context: np.ndarray, tokens: np.ndarray, token_s: float | None) -> np.ndarray:
    """CPU seconds decode spends on a reply: ``token_s`` per token when measured (``fit_decode``), else one step per
    token priced as a one-token prefill over the context."""
    if token_s is not None:
        return tokens * token_s
    step = m.compute_s(fleet, np.ones_like(context), context) + fleet.decode.efficiency.step_overhead_s
    return tokens * step


def predict_level(fleet: m.Fleet, spec: CapacitySpec, clients: int, arm: str,
                  decode_token_s: float | None = None, seen: int = 0, stagger: float = STAGGER_S) -> dict[str, Any]:
    """Predicted TTFT p50/p90 (ms) over all turns of ``clients`` conversations at once, its reuse share of later
    turns, and the CPU stretch. ``seen``: conversations an earlier level already played (bench capacity builds
    the same conversations from one seed at every level, and temperature 0 gives the same replies, so with a
    prefix cache on prefill their prompts are cached whole); the reuse-on arm runs after reuse off at the same
    level, so with a prefix cache all of its prompts are cached whole."""
    wl = spec.workload(clients)
    turns = sample(wl, clients, 0)
    fl = replace(fleet, prefill_nodes=1, decode_nodes=1)
    # The working set is far below the local engines' KV caches: prefill's cache keeps every conversation.
    cache = m.prefill_cache(fl, turns, lam_turns=1e-9, tpot=0.0)
    cached = cache.cached
    if fl.prefill_prefix_caching:
        block = fl.block_size
        whole = np.floor((turns.prompt_tokens - 1) / block) * block  # vLLM computes at least the last token
        replayed = np.full(turns.conv.shape, arm == "on") | (turns.conv < seen)
        cached = np.where(replayed, np.maximum(whole, cached), cached)
    costs = m.turn_costs(fl, turns.prompt_tokens, turns.history_tokens, cached, cache.offloaded)
    pulled = costs.pull if arm == "on" else np.zeros_like(costs.pull)
    compute = np.where(pulled, costs.compute_on, costs.compute_off)
    unqueued = np.where(pulled, costs.ttft_on, costs.ttft_off)
    fixed = unqueued - compute  # hops, transfers, the pull's fixed cost, decode's first step: no CPU queueing
    out = turns.output_tokens.astype(float)
    decode = _decode_s(fl, turns.prompt_tokens.astype(float), out - 1, decode_token_s)
    # bench capacity starts conversation i at i x stagger and plays its turns back to back: the conversations
    # overlap only in part, so the loop holds fewer clients than the level on average (a fixed point: how long a
    # conversation lasts depends on the queueing it meets)
    demand, delay = float((compute + decode).mean()), float(fixed.mean())
    active = float(clients)
    for _ in range(30):
        stretch, rate = mva_stretch_at(active, demand, delay)
        length = spec.turns * (delay + demand * stretch)
        active = overlap(clients, length, stagger)
    ttft = (fixed + compute * stretch) * 1000
    later = turns.turn > 0
    return {"concurrency": clients, "ttft_p50_ms": round(float(np.percentile(ttft, 50)), 1),
            "ttft_p90_ms": round(float(np.percentile(ttft, 90)), 1),
            "reuse_share": round(float(pulled[later].mean()), 3) if later.any() else None,
            "cpu_stretch": round(stretch, 3), "turns_per_s": round(rate, 3), "active": round(active, 2),
            "prompt_tokens": [int(turns.prompt_tokens[turns.turn == t].mean()) for t in range(spec.turns)]}


def predict(fleet: m.Fleet, spec: CapacitySpec, levels: list[int],
            decode_token_s: float | None = None) -> dict[str, Any]:
    """Every level, both arms, and the levels sustained under bench capacity's default target."""
    rows = [{"concurrency": c, "off": predict_level(fleet, spec, c, "off", decode_token_s, max(levels[:i], default=0)),
             "on": predict_level(fleet, spec, c, "on", decode_token_s, max(levels[:i], default=0))}
            for i, c in enumerate(levels)]
    target = TARGET_FACTOR * rows[0]["off"]["ttft_p90_ms"]

    def sustained(arm: str) -> int:
        best = 0
        for r in rows:
            if r[arm]["ttft_p90_ms"] > target:
                break
            best = r["concurrency"]
        return best

    token_ms = None if decode_token_s is None else round(decode_token_s * 1000, 3)
    return {"spec": spec.__dict__, "decode_token_ms": token_ms,
            "levels": rows, "target_ms": round(target, 1),
            "sustained_off": sustained("off"), "sustained_on": sustained("on")}


def compare(predicted: dict[str, Any], measured: dict[str, Any]) -> list[dict[str, Any]]:
    """Predicted against `bench capacity`'s capacity.json, per level, arm and statistic: relative error."""
    out = []
    by_level = {lv["concurrency"]: lv for lv in measured["levels"]}
    for row in predicted["levels"]:
        lv = by_level.get(row["concurrency"])
        if lv is None:
            continue
        for arm in ("off", "on"):
            for key in ("ttft_p50_ms", "ttft_p90_ms"):
                got, want = row[arm][key], lv[arm][key]
                out.append({"concurrency": row["concurrency"], "arm": arm, "stat": key, "predicted": got,
                            "measured": want, "error": None if not want else round(got / want - 1, 4)})
            out.append({"concurrency": row["concurrency"], "arm": arm, "stat": "reuse_share",
                        "predicted": row[arm]["reuse_share"], "measured": lv[arm]["reuse_share"], "error": None})
    return out


def fit_decode(fleet: m.Fleet, spec: CapacitySpec, measured: dict[str, Any]) -> float:
    """The one constant calibration cannot give: CPU seconds per decoded token under load (both engines share the
    cores), fitted so the reuse-off p50 at the highest level of a *calibration* capacity run matches (bisection)."""
    levels = sorted(lv["concurrency"] for lv in measured["levels"])
    top = max(measured["levels"], key=lambda lv: lv["concurrency"])
    seen = max(levels[:-1], default=0)
    want = top["off"]["ttft_p50_ms"]
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        got = predict_level(fleet, spec, top["concurrency"], "off", mid, seen)["ttft_p50_ms"]
        lo, hi = (mid, hi) if got < want else (lo, mid)
    return (lo + hi) / 2
