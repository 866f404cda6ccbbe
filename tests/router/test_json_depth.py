"""JSON nested deeper than the router can serialise (router.encoded; issue #51): orjson parses 1,024 levels but
serialises 254, so past 254 any tenant made the router answer 500 (TypeError: Recursion limit reached) on every route
that takes a body. Refused 400 naming the limit, before an engine or the store is reached."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from router.encoded import MAX_DEPTH
from tests.router.conftest import engines, router_over
from tests.router.test_flow_fake import MSGS

NEST = "__nest__"


def nest(levels: int) -> bytes:
    """JSON text of ``levels`` objects and arrays within one another (written out: no serialiser takes 1,000)."""
    opens = "".join('{"k":' if i % 2 == 0 else "[" for i in range(levels))
    closes = "".join("}" if i % 2 == 0 else "]" for i in reversed(range(levels)))
    return f'{opens}"x"{closes}'.encode()


def level(value: Any, at: int = 0) -> int | None:
    """How many objects and arrays hold the placeholder ``NEST`` in ``value`` (None: it is not there)."""
    if value == NEST:
        return at
    inner = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return next((found for v in inner if (found := level(v, at + 1)) is not None), None)


ROUTES = {
    "chat": ("/v1/chat/completions", {"model": "tiny", "messages": MSGS, "max_tokens": 4,
                                      "response_format": {"type": "json_schema",
                                                          "json_schema": {"name": "s", "schema": NEST}}}),
    "completion": ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 4,
                                       "response_format": {"type": "json_schema",
                                                           "json_schema": {"name": "s", "schema": NEST}}}),
    "responses": ("/v1/responses", {"model": "tiny", "input": "hi", "metadata": {"k": NEST}}),
    "messages": ("/v1/messages", {"model": "tiny", "max_tokens": 4, "chat_template_kwargs": {"k": NEST},
                                  "messages": [{"role": "user", "content": "hi"}]}),
    "lease": ("/v1/conversations/lease", {"model": "tiny", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                                                             "function": {"name": "f", "arguments": NEST}}]}]}),
}


def deep_body(route: str, levels: int) -> tuple[str, bytes]:
    """``route``'s path and a body nesting ``levels`` deep in all (the body is level 1), in a field the route takes."""
    path, body = ROUTES[route]
    around = level(body)  # the levels around the nested value
    assert around is not None
    raw = orjson.dumps(body).replace(orjson.dumps(NEST), nest(levels - around))
    assert b"__nest__" not in raw and raw.count(b"[") + raw.count(b"{") >= levels - around
    return path, raw


@pytest.mark.parametrize("route", ["chat", "completion", "responses", "messages", "lease"])
async def test_json_nested_deeper_than_the_router_serialises_is_refused_400_naming_the_limit(route):
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, _):
        for levels in (MAX_DEPTH + 1, 300, 1000):
            path, body = deep_body(route, levels)
            async with s.post(path, data=body, headers={"Content-Type": "application/json"}) as resp:
                text = await resp.text()
                assert resp.status == 400, (levels, resp.status, text)
                assert f"more than {MAX_DEPTH} levels" in text
        assert p[0].stats["requests"] == d[0].stats["requests"] == 0
        path, body = deep_body(route, MAX_DEPTH)
        async with s.post(path, data=body, headers={"Content-Type": "application/json"}) as resp:
            assert resp.status in (200, 404), (resp.status, await resp.text())  # lease: 404, no such conversation
