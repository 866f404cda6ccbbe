"""Pure pieces of the retention-pressure sweep (``bench.pressure``): no I/O, so each is unit-tested on its own.

Levels are multiples of the conversations whose last turn fits in decode's retention room, so a sweep reads
the same on any engine size: 1x is "exactly full", 4x is "four live conversations per retained slot".
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

from bench import engine_metrics
from bench.capacity import percentile
from bench.client import Result
from bench.workload import Conversation

#: Chat-template tokens around each message (role markers) that words alone do not count; a small allowance so
#: the fit errs towards fewer conversations, and the measured last-turn prompt is reported beside it.
TEMPLATE_TOKENS_PER_MESSAGE = 4


# -- fit ---------------------------------------------------------------------------------------------


def last_turn_tokens(conv: Conversation, reply_tokens: int) -> int:
    """Tokens decode retains after a conversation's last turn: its whole prompt plus the reply (one word is one
    token with the local tiny model; an approximation against a real tokenizer)."""
    turns = len(conv.user_turns)
    replies = list(conv.max_tokens) if conv.max_tokens else [reply_tokens] * turns
    words = len(conv.system.split()) + sum(len(u.split()) for u in conv.user_turns) + sum(replies)
    messages = 1 + turns + (turns - 1)  # system, every user turn, the replies before the last one
    return words + messages * TEMPLATE_TOKENS_PER_MESSAGE


@dataclass(frozen=True)
class Fit:
    """How many conversations' last turns fit in decode's retention room, and what that was computed from."""

    conversations: int
    source: str  # "metrics" (decode's cache_config_info) or "given" (--fit)
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    retained_kv_share: float | None = None
    room_blocks: int | None = None
    last_turn_tokens: int | None = None
    blocks_per_conversation: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def compute_fit(num_gpu_blocks: int, block_size: int, share: float, tokens_per_conversation: int) -> Fit:
    """Room (``share`` x decode's KV blocks) over the blocks one conversation's last turn holds, at least 1."""
    if num_gpu_blocks <= 0 or block_size <= 0 or tokens_per_conversation <= 0:
        raise ValueError("blocks, block size and tokens per conversation must be positive")
    room = int(share * num_gpu_blocks)
    per = math.ceil(tokens_per_conversation / block_size)
    return Fit(max(1, room // per), "metrics", num_gpu_blocks, block_size, share, room, tokens_per_conversation, per)


def conversations_at(level: float, fit: int) -> int:
    """Live conversations for a level (a multiple of ``fit``), at least one."""
    return max(1, round(level * fit))


def parse_levels(text: str) -> list[float]:
    try:
        levels = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--levels {text!r}: expected a comma list of multiples such as 0.5,1,2,4,8") from None
    if not levels or any(v <= 0 for v in levels) or levels != sorted(set(levels)):
        raise ValueError(f"--levels {text!r}: expected increasing positive multiples such as 0.5,1,2,4,8")
    return levels


# -- think times -------------------------------------------------------------------------------------


#: Mooncake's public FAST'25 conversation trace: time between a session's turns, p50 126 s and p90 486 s (as quoted
#: in issue 36). ``mooncake:SCALE`` plays a log-normal with these quantiles times SCALE.
MOONCAKE_THINK_P50_S = 126.0
MOONCAKE_THINK_P90_S = 486.0
#: The standard normal's 90th percentile (a log-normal's sigma from its p50 and p90).
Z90 = 1.2815515655446004


@dataclass(frozen=True)
class Think:
    """Pause before each later turn: ``fixed`` seconds, ``exp`` (exponential, this mean, seeded per conversation),
    ``lognormal`` (median ``seconds``, 90th percentile ``p90``, seeded) or ``file`` (the workload file's own
    per-turn think times)."""

    kind: str
    seconds: float = 0.0
    p90: float = 0.0

    def delays(self, conv: Conversation, seed: int) -> list[float]:
        """Seconds to wait before each turn of ``conv`` (0 before the first)."""
        n = len(conv.user_turns)
        if self.kind == "file":
            given = list(conv.think_s) or [0.0] * n
            return [0.0, *(float(x) for x in given[1:n])]
        if self.kind == "fixed":
            return [0.0] + [self.seconds] * (n - 1)
        rng = random.Random(f"{seed}-{conv.index}")
        if self.kind == "lognormal":
            sigma = math.log(self.p90 / self.seconds) / Z90 if self.seconds > 0 else 0.0
            return [0.0] + [self.seconds * math.exp(sigma * rng.gauss(0.0, 1.0)) if self.seconds > 0 else 0.0
                            for _ in range(n - 1)]
        return [0.0] + [rng.expovariate(1 / self.seconds) if self.seconds > 0 else 0.0 for _ in range(n - 1)]

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "seconds": self.seconds, **({"p90": self.p90} if self.kind == "lognormal" else {})}

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile of the pause (None for ``file`` and ``exp``-free kinds it cannot say)."""
        if self.kind == "fixed":
            return self.seconds
        if self.kind == "exp":
            return -self.seconds * math.log(1 - q)
        if self.kind == "lognormal":
            sigma = math.log(self.p90 / self.seconds) / Z90 if self.seconds > 0 else 0.0
            return self.seconds * math.exp(sigma * NormalDist().inv_cdf(q))
        return None

    def mean(self) -> float | None:
        if self.kind == "lognormal":
            sigma = math.log(self.p90 / self.seconds) / Z90 if self.seconds > 0 else 0.0
            return self.seconds * math.exp(sigma**2 / 2)
        return None if self.kind == "file" else self.seconds


def parse_think(text: str) -> Think:
    """``fixed:35``, ``exp:35``, ``mooncake:SCALE`` (Mooncake's think times times SCALE) or ``file``."""
    kind, _, value = text.partition(":")
    if kind == "file" and not value:
        return Think("file")
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if kind == "mooncake" and seconds > 0:
        return Think("lognormal", MOONCAKE_THINK_P50_S * seconds, MOONCAKE_THINK_P90_S * seconds)
    if kind not in ("fixed", "exp") or seconds < 0:
        raise ValueError(f"--think {text!r}: expected fixed:SECONDS, exp:MEAN_SECONDS, mooncake:SCALE (> 0) or file")
    return Think(kind, seconds)


# -- variants ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    name: str
    tunables: dict[str, int | float] = field(default_factory=dict)


def _number(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        return float(text)


def parse_variant(text: str) -> Variant:
    """``NAME=KEY=VALUE,KEY=VALUE`` (or just ``NAME``): a name and the engine tunables its stack starts with.
    Names are checked by the stack against the catalog (turnkv.params), not here."""
    name, _, rest = text.partition("=")
    if not name.strip():
        raise ValueError(f"--variant {text!r}: expected NAME=KEY=VALUE[,KEY=VALUE...]")
    tunables: dict[str, int | float] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--variant {text!r}: {item!r} is not KEY=VALUE")
        try:
            tunables[key.strip()] = _number(value.strip())
        except ValueError:
            raise ValueError(f"--variant {text!r}: {value!r} is not a number") from None
    return Variant(name.strip(), tunables)


DEFAULT_VARIANTS = ("device only=retained_kv_share=0.02",
                    "host tier=retained_kv_share=0.02,host_kv_budget_mib=512")


# -- Prometheus text: bench.engine_metrics reads it --------------------------------------------------

turnkv_series = engine_metrics.turnkv_series


def cache_config(text: str) -> tuple[int, int] | None:
    """(num_gpu_blocks, block_size) from vLLM's ``vllm:cache_config_info`` labels, or None."""
    config = engine_metrics.cache_config(text)
    return (config.num_gpu_blocks, config.block_size) if config else None


def is_counter(key: str) -> bool:
    return key.split("{")[0].endswith("_total")


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Counters' increase over a level (a series missing before counts from 0)."""
    return {k: round(v - before.get(k, 0.0), 3) for k, v in sorted(after.items()) if is_counter(k)}


#: Decode's retained bytes as its connector exports them (``connector.stats``): both tiers, the host tier, and the host
#: pool's size. Not the host tier's configured or granted size (settings) nor its pull costs (seconds).
TIER_GAUGES = ("vllm:turnkv_retained_bytes", "vllm:turnkv_host_retained_bytes", "vllm:turnkv_host_pool_bytes")


def is_tier_gauge(key: str) -> bool:
    """Retained bytes per tier (``TIER_GAUGES``)."""
    return key.split("{")[0] in TIER_GAUGES


def gauge_peaks(samples: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Peak and last value of each tier gauge over a level's samples (taken every few seconds), in
    ``TIER_GAUGES``' order."""
    keys = sorted({k for s in samples for k in s if is_tier_gauge(k)},
                  key=lambda k: (TIER_GAUGES.index(k.split("{")[0]), k))
    return {k: {"peak": max(s.get(k, 0.0) for s in samples), "last": samples[-1].get(k, 0.0)} for k in keys}


def sum_by(deltas: dict[str, float], metric: str) -> float:
    """Total of one counter over its labels (``vllm:turnkv_retention_evictions_total`` -> all reasons)."""
    return sum(v for k, v in deltas.items() if k.split("{")[0] == metric)


# -- a level's summary -------------------------------------------------------------------------------


def level_summary(on: list[Result], off: list[Result]) -> dict[str, Any]:
    """One level: reuse share of later turns (a turn reused when the router reports tokens prefill pulled,
    ``X-TurnKV-Reused-Tokens`` > 0), TTFT p50/p90 per arm, answers identical to reuse off, errors."""
    ok_on = [r for r in on if r.error is None]
    ok_off = [r for r in off if r.error is None]
    later = [r for r in ok_on if r.turn > 0]
    reused = sum(1 for r in later if r.reused_tokens > 0)
    outcomes: dict[str, int] = {}
    for r in later:
        outcomes[r.reuse_outcome or "-"] = outcomes.get(r.reuse_outcome or "-", 0) + 1
    off_by = {(r.conversation, r.turn): r.reply for r in ok_off}
    pairs = [(r.reply, off_by[(r.conversation, r.turn)]) for r in ok_on if (r.conversation, r.turn) in off_by]
    return {
        "requests": len(on) + len(off),
        "errors_on": len(on) - len(ok_on),
        "errors_off": len(off) - len(ok_off),
        "later_turns": len(later),
        "later_turns_reused": reused,
        "reuse_share": round(reused / len(later), 3) if later else None,
        "reuse_outcomes": dict(sorted(outcomes.items())),
        "reused_tokens": sum(r.reused_tokens for r in later),
        # turns 2+ (where reuse acts; first turns are alike in both arms and queue together at the level's start)
        "ttft_on_later_p50_ms": percentile((r.ttft_ms for r in later), 50),
        "ttft_on_later_p90_ms": percentile((r.ttft_ms for r in later), 90),
        "ttft_off_later_p50_ms": percentile((r.ttft_ms for r in ok_off if r.turn > 0), 50),
        "ttft_off_later_p90_ms": percentile((r.ttft_ms for r in ok_off if r.turn > 0), 90),
        # every turn
        "ttft_on_p50_ms": percentile((r.ttft_ms for r in ok_on), 50),
        "ttft_on_p90_ms": percentile((r.ttft_ms for r in ok_on), 90),
        "ttft_off_p50_ms": percentile((r.ttft_ms for r in ok_off), 50),
        "ttft_off_p90_ms": percentile((r.ttft_ms for r in ok_off), 90),
        "answers_compared": len(pairs),
        "answers_identical": sum(1 for a, b in pairs if a == b),
        "last_turn_prompt_tokens_max": max((r.prompt_tokens or 0 for r in ok_on), default=0),
    }


def p90_ratio(level: dict[str, Any], which: str = "later_") -> float | None:
    """TTFT p90 reuse off / on, turns 2+ by default (above 1: reuse is faster)."""
    off, on = level.get(f"ttft_off_{which}p90_ms"), level.get(f"ttft_on_{which}p90_ms")
    return round(off / on, 2) if off and on else None


def total_requests(conversations: Iterable[int], turns: int) -> int:
    """Requests of a sweep: every conversation's turns, reuse on then off."""
    return sum(conversations) * turns * 2
