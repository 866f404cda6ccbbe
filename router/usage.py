"""Reuse in the usage fields clients already read (pure, no I/O).

OpenAI reports prompt caching in ``usage.prompt_tokens_details.cached_tokens`` (chat and completions; the Responses
API's ``input_tokens_details.cached_tokens`` and Anthropic's ``cache_read_input_tokens`` are translated from it by
``router.apis``), and cost trackers and SDK users read it there. In P/D, decode's own count says nothing about that
(every prompt token reached it over the connector), so the router writes the prompt tokens prefill did not compute:
the ones it pulled from decode plus its own prefix-cache hits. A request decode served alone keeps decode's count.

The usage also carries the router's outcome under ``turnkv`` (a documented extension: ``reuse_outcome``,
``reused_tokens``, ``prefill_cached_tokens``), the same values as the ``X-TurnKV-*`` headers, so a stream whose
headers left before the decision (keep-alive while queued) still tells the client, in its usage chunk
(``stream_options.include_usage``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from router import sse
from router.dispatch import Dispatch

#: The usage object's extension key.
EXTENSION = "turnkv"
_MARKS = (b'"usage":{', b'"usage": {')


def with_reuse(usage: Mapping[str, Any], d: Dispatch) -> dict[str, Any]:
    """``usage`` with the tokens prefill did not compute as ``cached_tokens`` and the outcome as the extension."""
    out = dict(usage)
    if d.prefill_engine:
        prompt = int(out.get("prompt_tokens") or 0)
        details = out.get("prompt_tokens_details")
        details = dict(details) if isinstance(details, Mapping) else {}
        details["cached_tokens"] = min(prompt, d.reused_tokens + d.prefill_cached_tokens)
        out["prompt_tokens_details"] = details
    out[EXTENSION] = {"reuse_outcome": str(d.outcome), "reused_tokens": d.reused_tokens,
                      "prefill_cached_tokens": d.prefill_cached_tokens}
    return out


def rewrite_line(line: bytes, d: Dispatch) -> bytes:
    """An SSE ``data:`` line of decode's stream with its usage (if it has one) rewritten; any other line as is."""
    if not any(mark in line for mark in _MARKS) or (payload := sse.data_of(line)) is None:
        return line
    try:
        chunk = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return line
    if not isinstance(chunk, dict) or not isinstance(chunk.get("usage"), Mapping):
        return line
    chunk["usage"] = with_reuse(chunk["usage"], d)
    return b"data: " + orjson.dumps(chunk) + b"\n"
