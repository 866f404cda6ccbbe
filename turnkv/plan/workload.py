"""The workload file: vLLM's multi-turn generator format (``benchmarks/multi_turn``), plus load.

The generator's fields are kept as vLLM reads them (``bench_dataset.py``): ``num_conversations``,
``prompt_input.num_turns`` (counts *messages*, user and assistant: rounded up to an even number, at
least 2), ``common_prefix_num_tokens`` (one sample shared by every conversation, prepended to the first
user message), ``prefix_num_tokens`` (per conversation, also on the first message), ``num_tokens``
(each user message) and ``prompt_output.num_tokens`` (each reply). Distributions: constant (value),
uniform (min, max), lognormal (average [+ median_ratio, default 0.85] or mean + sigma), zipf (alpha)
and poisson (alpha), each with an optional ``max``. turnkv adds two optional top-level fields:
``num_clients`` (conversations in flight at once, default 1) and ``think_time_s`` (seconds between a
reply and the next user message: a number or a distribution, default 0). Pure: no I/O but ``load``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


class WorkloadError(ValueError):
    """A workload file turnkv cannot read; the message names the field and the fix."""


#: The keys each level of the file may hold: vLLM's generator fields (``generate_multi_turn.json``) and turnkv's
#: additions. Anything else is refused, naming the closest known key: a mistyped ``num_clent`` would otherwise
#: plan for the default silently.
TOP_KEYS = ("filetype", "num_conversations", "text_files", "print_stats", "prompt_input", "prompt_output",
            "num_clients", "think_time_s", "template_tokens_per_message", "description")
INPUT_KEYS = ("num_turns", "common_prefix_num_tokens", "prefix_num_tokens", "num_tokens")
OUTPUT_KEYS = ("num_tokens",)
DISTRIBUTION_KEYS = ("distribution", "value", "min", "max", "average", "median_ratio", "mean", "sigma", "alpha")


def _known_keys(conf: dict[str, Any], known: tuple[str, ...], where: str) -> None:
    import difflib

    for key in conf:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise WorkloadError(f"{where}unknown key {key!r}: {hint}the keys are {', '.join(known)}")


@dataclass(frozen=True)
class Distribution:
    kind: str
    params: dict[str, float]
    max: float | None = None

    @classmethod
    def parse(cls, conf: Any, where: str) -> Distribution:
        if isinstance(conf, (int, float)):
            return cls("constant", {"value": float(conf)})
        if not isinstance(conf, dict) or "distribution" not in conf:
            raise WorkloadError(f"{where}: expected {{\"distribution\": ...}} or a number, got {conf!r}")
        _known_keys(conf, DISTRIBUTION_KEYS, f"{where}: ")
        kind = conf["distribution"]
        need = {"constant": ("value",), "uniform": ("min", "max"), "zipf": ("alpha",), "poisson": ("alpha",)}
        if kind == "lognormal":
            keys = ("average",) if "average" in conf else ("mean", "sigma")
        elif kind in need:
            keys = need[kind]
        else:
            raise WorkloadError(f"{where}: unknown distribution {kind!r}; use constant, uniform, lognormal, "
                                "zipf or poisson")
        missing = [k for k in keys if k not in conf]
        if missing:
            raise WorkloadError(f"{where}: {kind} needs {', '.join(missing)}")
        params = {k: float(conf[k]) for k in keys}
        if kind == "lognormal" and "average" in conf:
            ratio = float(conf.get("median_ratio") or 0.85)
            if not 0 < ratio < 1:
                raise WorkloadError(f"{where}: median_ratio must be in (0, 1)")
            params["median_ratio"] = ratio
        if kind == "uniform" and params["min"] > params["max"]:
            raise WorkloadError(f"{where}: uniform min {params['min']} > max {params['max']}")
        cap = None if kind in ("constant", "uniform") else conf.get("max")
        return cls(kind, params, float(cap) if cap else None)

    def _lognormal(self) -> tuple[float, float]:
        p = self.params
        if "average" in p:  # vLLM: sigma^2 = 2 ln(mean/median), mu = ln(median)
            median = p["average"] * p["median_ratio"]
            return math.log(median), math.sqrt(2 * math.log(p["average"] / median))
        return p["mean"], p["sigma"]

    def sample(self, rng: np.random.Generator, size: int, integer: bool = True) -> np.ndarray:
        p = self.params
        if self.kind == "constant":
            out = np.full(size, p["value"])
        elif self.kind == "uniform":
            if integer and p["min"].is_integer() and p["max"].is_integer():
                out = rng.integers(int(p["min"]), int(p["max"]) + 1, size=size).astype(float)
            else:
                out = rng.uniform(p["min"], p["max"], size=size)
        elif self.kind == "zipf":
            out = rng.zipf(p["alpha"], size=size).astype(float)
        elif self.kind == "poisson":
            out = rng.poisson(p["alpha"], size=size).astype(float)
        else:
            mu, sigma = self._lognormal()
            out = rng.lognormal(mu, sigma, size=size)
            if "average" in p and size > 0:  # vLLM rescales each batch to the exact average
                out *= p["average"] / out.mean()
        if self.max is not None:
            out = np.minimum(out, self.max)
        return np.round(out) if integer else out

    def mean(self) -> float:
        """Expected value (numerically for capped distributions)."""
        p = self.params
        if self.kind == "constant":
            return p["value"]
        if self.kind == "uniform":
            return (p["min"] + p["max"]) / 2
        if self.kind == "lognormal" and "average" in p and self.max is None:
            return p["average"]
        if self.kind == "poisson" and self.max is None:
            return p["alpha"]
        return float(self.sample(np.random.default_rng(0), 200_000, integer=False).mean())


@dataclass(frozen=True)
class Workload:
    num_conversations: int
    num_turns: Distribution  # messages (user + assistant), as vLLM counts them
    common_prefix_num_tokens: Distribution
    prefix_num_tokens: Distribution
    num_tokens: Distribution
    output_num_tokens: Distribution
    num_clients: int = 1
    think_time_s: Distribution = Distribution("constant", {"value": 0.0})
    #: Tokens the chat template adds per message (role markers); 0 keeps vLLM's own counts.
    template_tokens_per_message: int = 0

    @classmethod
    def from_dict(cls, conf: dict[str, Any]) -> Workload:
        if not isinstance(conf, dict):
            raise WorkloadError("the workload file must hold a JSON object")
        for key in ("num_conversations", "prompt_input", "prompt_output"):
            if key not in conf:
                raise WorkloadError(f"missing field {key!r} (see vLLM benchmarks/multi_turn/generate_multi_turn.json)")
        _known_keys(conf, TOP_KEYS, "")
        pin, pout = conf["prompt_input"], conf["prompt_output"]
        if not isinstance(pin, dict) or not isinstance(pout, dict):
            raise WorkloadError("prompt_input and prompt_output must be JSON objects")
        _known_keys(pin, INPUT_KEYS, "prompt_input: ")
        _known_keys(pout, OUTPUT_KEYS, "prompt_output: ")
        for key in ("num_turns", "num_tokens"):
            if key not in pin:
                raise WorkloadError(f"missing prompt_input.{key}")
        if "num_tokens" not in pout:
            raise WorkloadError("missing prompt_output.num_tokens")
        n = int(conf["num_conversations"])
        clients = int(conf.get("num_clients", 1))
        if n < 1 or clients < 1:
            raise WorkloadError("num_conversations and num_clients must be at least 1")
        zero = {"distribution": "constant", "value": 0}
        return cls(
            num_conversations=n,
            num_turns=Distribution.parse(pin["num_turns"], "prompt_input.num_turns"),
            common_prefix_num_tokens=Distribution.parse(pin.get("common_prefix_num_tokens", zero),
                                                        "prompt_input.common_prefix_num_tokens"),
            prefix_num_tokens=Distribution.parse(pin.get("prefix_num_tokens", zero), "prompt_input.prefix_num_tokens"),
            num_tokens=Distribution.parse(pin["num_tokens"], "prompt_input.num_tokens"),
            output_num_tokens=Distribution.parse(pout["num_tokens"], "prompt_output.num_tokens"),
            num_clients=clients,
            think_time_s=Distribution.parse(conf.get("think_time_s", 0), "think_time_s"),
            template_tokens_per_message=int(conf.get("template_tokens_per_message", 0)),
        )

    def user_turns(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """User turns per conversation: vLLM's message count, at least 2, rounded up to even, halved."""
        msgs = np.maximum(self.num_turns.sample(rng, size), 2).astype(int)
        return (msgs + msgs % 2) // 2

    def mean_user_turns(self) -> float:
        return float(self.user_turns(np.random.default_rng(0), 100_000).mean())


@dataclass(frozen=True)
class Turns:
    """Sampled conversations, turn by turn (ragged arrays flattened; ``conv`` maps a row to its conversation)."""

    conv: np.ndarray  # conversation index of each turn
    turn: np.ndarray  # 0-based turn index
    prompt_tokens: np.ndarray  # whole prompt of the turn
    history_tokens: np.ndarray  # tokens decode holds from the turn before: its prompt and reply but the
    #                             reply's last token, whose KV is never computed (0 on the first turn)
    new_tokens: np.ndarray  # tokens the turn adds (its user message; the whole prompt on turn 0)
    output_tokens: np.ndarray
    think_s: np.ndarray  # pause before this turn (0 on the first turn)
    common_prefix_tokens: int = 0  # the shared prefix inside every first message


def sample(workload: Workload, conversations: int | None = None, seed: int = 0) -> Turns:
    """Sample conversations as vLLM's generator builds them (vectorized)."""
    rng = np.random.default_rng(seed)
    n = conversations or workload.num_conversations
    turns = workload.user_turns(rng, n)
    total = int(turns.sum())
    conv = np.repeat(np.arange(n), turns)
    starts = np.cumsum(turns) - turns
    turn = np.arange(total) - np.repeat(starts, turns)
    tpl = workload.template_tokens_per_message
    user = workload.num_tokens.sample(rng, total) + tpl
    out = np.maximum(workload.output_num_tokens.sample(rng, total), 1)
    common = float(workload.common_prefix_num_tokens.sample(rng, 1)[0])
    prefix = workload.prefix_num_tokens.sample(rng, n)
    first = turn == 0
    user = user + first * (common + prefix[conv])
    # prompt_t = sum of user_0..t + sum of out_0..t-1 (+ template tokens of each reply)
    reply = out + tpl
    cum_user = _segment_cumsum(user, starts, turns)
    cum_reply_before = _segment_cumsum(reply, starts, turns) - reply
    prompt = cum_user + cum_reply_before
    history = np.where(first, 0, prompt - user - 1)
    think = np.where(first, 0.0, workload.think_time_s.sample(rng, total, integer=False))
    return Turns(conv, turn, prompt.astype(np.int64), history.astype(np.int64), user.astype(np.int64),
                 out.astype(np.int64), think, int(common))


def _segment_cumsum(values: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    total = np.cumsum(values)
    offset = np.repeat(total[starts] - values[starts], lengths)
    return total - offset


def load(path: Path) -> Workload:
    try:
        conf = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise WorkloadError(f"{path}: no such workload file") from None
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"{path}: not JSON ({exc})") from None
    return Workload.from_dict(conf)
