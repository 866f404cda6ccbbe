"""Engine choice policies: small pluggable units, as in the Rust vllm-router (pure, no I/O).

A policy gets the healthy candidates of one role and returns one. ``LeastLoad`` is the default:
load = outstanding requests + outstanding prompt tokens / ``tokens_per_request``, divided by the
engine's slow-start weight; ties go round-robin. Decode affinity keeps a conversation on the
engine that holds its blocks unless that engine is ``affinity_slack`` requests busier than the best.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from turnkv import params

if TYPE_CHECKING:
    from router.engines import Engine


class ChoicePolicy(Protocol):
    def choose(self, candidates: Sequence[Engine], *, now: float, preferred: Engine | None,
               tunables: Mapping[str, float], tokens: int) -> Engine: ...


def load(engine: Engine, now: float, tunables: Mapping[str, float]) -> float:
    per_request = float(params.value(tunables, "tokens_per_request")) or 1.0
    busy = engine.outstanding + engine.outstanding_tokens / per_request
    return (busy + 1.0) / engine.weight(now, float(params.value(tunables, "slow_start")))


class LeastLoad:
    """Least outstanding requests and tokens, slow-start aware, with decode affinity."""

    def __init__(self) -> None:
        # One tie counter per role (as RoundRobin): a shared one steps twice per request (prefill, then
        # decode), so with an even number of idle engines every decode leg went to the same engine.
        self._ticks: dict[str, itertools.count[int]] = {}

    def choose(self, candidates: Sequence[Engine], *, now: float, preferred: Engine | None = None,
               tunables: Mapping[str, float] | None = None, tokens: int = 0) -> Engine:
        tunables = tunables or {}
        tick = self._ticks.setdefault(candidates[0].role, itertools.count())
        scores = [load(e, now, tunables) for e in candidates]
        best = min(scores)
        slack = float(params.value(tunables, "affinity_slack"))
        if preferred is not None and preferred in candidates and load(preferred, now, tunables) - best <= slack:
            return preferred
        ties = [e for e, s in zip(candidates, scores, strict=True) if s - best < 1e-9]
        return ties[next(tick) % len(ties)]


class RoundRobin:
    """Every healthy engine of a role in turn, ignoring load and affinity (for comparison and tests)."""

    def __init__(self) -> None:
        # One turn counter per role: a shared one would step twice per request (prefill, then decode) and,
        # with an even number of engines, send every decode leg to the same engine.
        self._ticks: dict[str, itertools.count[int]] = {}

    def choose(self, candidates: Sequence[Engine], *, now: float, preferred: Engine | None = None,
               tunables: Mapping[str, float] | None = None, tokens: int = 0) -> Engine:
        tick = self._ticks.setdefault(candidates[0].role, itertools.count())
        return candidates[next(tick) % len(candidates)]


POLICIES = {"least_load": LeastLoad, "round_robin": RoundRobin}
