"""bench.hostile_load's pure parts: a refusal read by the limit it names, percentiles."""

from __future__ import annotations

from bench.hostile_load import _limit_of, percentile


def test_refusals_are_counted_by_the_limit_they_name():
    answer = b'HTTP/1.1 429 Too Many Requests\r\n\r\n{"error":{"message":"m","limit":"tenant_body_rate"}}'
    assert _limit_of(answer) == "429:tenant_body_rate"
    assert _limit_of(b"HTTP/1.1 400 Bad Request\r\n\r\n{}") == "400"


def test_percentile():
    assert percentile([], 0.9) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
