"""Reuse in the usage fields clients read (issue #47 item 2, ``router.usage``): ``prompt_tokens_details.cached_tokens``
is the prompt tokens prefill did not compute, unary and streamed, Anthropic's ``cache_read_input_tokens`` from it,
and the router's outcome under ``usage.turnkv`` even where a stream's headers left before the decision."""

from __future__ import annotations

import orjson

from router import usage
from router.dispatch import Dispatch
from router.outcomes import RequestKind, ReuseOutcome
from tests.router.conftest import engines, router_over
from tests.router.test_flow_fake import MSGS, chat, next_turn


def _dispatch(prefill: str = "prefill-0", reused: int = 900, cached: int = 100) -> Dispatch:
    d = Dispatch(RequestKind.CHAT, "/v1/chat/completions", {}, "r", None, None)
    d.prefill_engine, d.reused_tokens, d.prefill_cached_tokens, d.outcome = prefill, reused, cached, ReuseOutcome.HIT
    return d


def test_cached_tokens_are_the_pulled_and_prefix_cached_tokens_never_more_than_the_prompt():
    out = usage.with_reuse({"prompt_tokens": 1200, "completion_tokens": 4,
                            "prompt_tokens_details": {"cached_tokens": 1200, "audio_tokens": 0}}, _dispatch())
    assert out["prompt_tokens_details"] == {"cached_tokens": 1000, "audio_tokens": 0}
    assert out["turnkv"] == {"reuse_outcome": "hit", "reused_tokens": 900, "prefill_cached_tokens": 100}
    assert usage.with_reuse({"prompt_tokens": 500}, _dispatch())["prompt_tokens_details"] == {"cached_tokens": 500}


def test_decode_alone_keeps_its_own_count():
    d = _dispatch(prefill="", reused=0, cached=0)
    out = usage.with_reuse({"prompt_tokens": 50, "prompt_tokens_details": {"cached_tokens": 32}}, d)
    assert out["prompt_tokens_details"] == {"cached_tokens": 32}


def test_only_a_usage_line_is_rewritten():
    d = _dispatch()
    line = b'data: {"choices":[],"usage":{"prompt_tokens":2000,"completion_tokens":3}}\n'
    event = orjson.loads(usage.rewrite_line(line, d)[6:])
    assert event["usage"]["prompt_tokens_details"] == {"cached_tokens": 1000} and event["choices"] == []
    for other in (b'data: {"choices":[{"delta":{"content":"usage"}}]}\n', b"data: [DONE]\n", b": keepalive\n",
                  b'data: {"usage":{bad json\n', b': a comment naming "usage":{"prompt_tokens":1}\n'):
        assert usage.rewrite_line(other, d) == other


async def test_the_second_turn_reports_its_reuse_in_usage_unary_and_streamed():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, _):
        for stream in (False, True):
            conv = f"usage-{stream}"
            first = await chat(s, conversation=conv, stream=stream)
            extra = {"stream_options": {"include_usage": True}} if stream else {}
            second = await chat(s, next_turn(MSGS, first["text"]), conversation=conv, stream=stream, **extra)
            headers = second["headers"]
            assert headers["X-TurnKV-Reuse-Outcome"] == "hit"
            body = second["events"][-1] if stream else orjson.loads(second["raw"])
            reported = body["usage"]
            reused, cached = int(headers["X-TurnKV-Reused-Tokens"]), int(headers["X-TurnKV-Prefill-Cached-Tokens"])
            assert reported["prompt_tokens_details"]["cached_tokens"] == reused + cached > 0
            assert reported["turnkv"] == {"reuse_outcome": "hit", "reused_tokens": reused,
                                          "prefill_cached_tokens": cached}


async def test_anthropic_messages_count_the_read_tokens_apart_from_input_tokens():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, _):
        body = {"model": "tiny", "max_tokens": 4, "messages": MSGS, "metadata": {"user_id": "u-usage"}}
        async with s.post("/v1/messages", json=body) as resp:
            first = orjson.loads(await resp.read())
        text = "".join(b.get("text", "") for b in first["content"])
        body["messages"] = [*MSGS, {"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
        async with s.post("/v1/messages", json=body) as resp:
            second, headers = orjson.loads(await resp.read()), resp.headers
        assert headers["X-TurnKV-Reuse-Outcome"] == "hit", headers["X-TurnKV-Reuse-Outcome"]
        read = second["usage"]["cache_read_input_tokens"]
        assert read == int(headers["X-TurnKV-Reused-Tokens"]) + int(headers["X-TurnKV-Prefill-Cached-Tokens"]) > 0
        # Anthropic's total input is input + cache read: turn 1 read nothing, turn 2's prompt holds turn 1's
        assert first["usage"]["cache_read_input_tokens"] == 0
        assert second["usage"]["input_tokens"] + read > first["usage"]["input_tokens"] > read - 50
