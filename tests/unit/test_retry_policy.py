"""The retry and failover policy (router.retry), case by case."""

from __future__ import annotations

import pytest

from router.retry import Failure, RetryDecision, decide


@pytest.mark.parametrize(("failure", "budget", "replaying", "expected"), [
    # a 4xx is the request's fault: another engine would answer the same
    (Failure("prefill", retryable=False, connect=False), 2, True, RetryDecision(retry=False)),
    # out of budget for this leg
    (Failure("decode", retryable=True, connect=True), 0, False, RetryDecision(retry=False)),
    # no engine to avoid next time: retrying could pick the same one
    (Failure("prefill", retryable=True, connect=True, engine_known=False), 2, False, RetryDecision(retry=False)),
    # prefill never reached: it read nothing, the offer may be replayed on another prefill engine
    (Failure("prefill", retryable=True, connect=True), 1, True, RetryDecision(retry=True, drop_reuse=False)),
    # prefill reached and failed (5xx, timeout): the READ may have started, never read those blocks twice
    (Failure("prefill", retryable=True, connect=False), 1, True, RetryDecision(retry=True, drop_reuse=True)),
    # decode failed: it may be the engine holding the previous turn's blocks
    (Failure("decode", retryable=True, connect=True), 1, True, RetryDecision(retry=True, drop_reuse=True)),
    # nothing replayed: nothing to drop
    (Failure("decode", retryable=True, connect=False), 1, False, RetryDecision(retry=True, drop_reuse=False)),
])
def test_decide(failure, budget, replaying, expected):
    assert decide(failure, budget, replaying) == expected


def test_an_unknown_leg_is_a_programming_error():
    with pytest.raises(ValueError, match="unknown leg"):
        decide(Failure("router", retryable=True, connect=True), 1, False)
