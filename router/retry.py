"""The retry and failover policy: a pure function of one leg's failure and what is left of the budget.

The flow (``router.flow``) asks it after every failed attempt; nothing here does I/O, so every case is a table
row in ``tests/unit/test_retry_policy.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

LEGS = ("prefill", "decode")


@dataclass(frozen=True)
class Failure:
    """What the flow knows of a failed leg."""

    leg: str  # "prefill" or "decode"
    retryable: bool  # another engine may succeed: 5xx, connection refused, timeout (never a 4xx)
    connect: bool  # the engine was never reached, so it did no work (and read no KV)
    engine_known: bool = True  # the failure names an engine to avoid on the next attempt


@dataclass(frozen=True)
class RetryDecision:
    retry: bool
    #: Drop the replayed offer and recompute: a prefill that was reached may have started the pull (its blocks
    #: must not be read twice), and a failed decode may have been the engine that held them.
    drop_reuse: bool = False


def decide(failure: Failure, budget_left: int, replaying: bool) -> RetryDecision:
    """Whether to try again on another engine (``budget_left`` retries remain for this leg), and whether the
    next attempt must go without the previous turn's KV."""
    if failure.leg not in LEGS:
        raise ValueError(f"unknown leg {failure.leg!r}")
    if not failure.retryable or not failure.engine_known or budget_left <= 0:
        return RetryDecision(retry=False)
    return RetryDecision(retry=True, drop_reuse=replaying and (failure.leg == "decode" or not failure.connect))
