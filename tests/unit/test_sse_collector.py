import orjson

from router.reply import ReplyCollector


def sse(obj) -> list[bytes]:
    return [b"data: " + orjson.dumps(obj) + b"\n", b"\n"]


def chunk(content=None, **delta):
    d = dict(delta)
    if content is not None:
        d["content"] = content
    return {"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": d}]}


PARAMS = {"do_remote_decode": True, "remote_block_ids": [[1]], "remote_engine_id": "d", "remote_host": "h",
          "remote_port": 1, "remote_num_tokens": 9}


def feed_all(collector, lines):
    return [out for line in lines if (out := collector.feed(line)) is not None]


def test_strips_params_chunk_and_rebuilds_reply():
    lines = [*sse(chunk("", role="assistant")), *sse(chunk(" a")), *sse(chunk(" b")),
             *sse({"id": "x", "choices": [], "kv_transfer_params": PARAMS}), b"data: [DONE]\n", b"\n"]
    c = ReplyCollector("chat")
    forwarded = feed_all(c, lines)
    assert not any(b"kv_transfer_params" in line for line in forwarded)
    assert forwarded.count(b"\n") == 4  # the removed chunk's separator is gone too
    assert c.complete and c.storable and c.has_content
    assert c.kv_transfer_params == PARAMS
    assert c.value() == {"role": "assistant", "content": " a b"}


def test_params_on_a_usage_chunk_are_removed_but_the_chunk_kept():
    c = ReplyCollector("chat")
    out = feed_all(c, sse({"choices": [], "usage": {"prompt_tokens": 3}, "kv_transfer_params": PARAMS}))
    assert len(out) == 2 and b"usage" in out[0] and b"kv_transfer_params" not in out[0]
    assert c.kv_transfer_params == PARAMS


def test_streamed_tool_calls_are_rebuilt_as_the_client_sends_them_back():
    c = ReplyCollector("chat")
    lines = [*sse(chunk(role="assistant", tool_calls=[{"index": 0, "id": "call-1", "type": "function",
                                                       "function": {"name": "get", "arguments": ""}}])),
             *sse(chunk(tool_calls=[{"index": 0, "function": {"arguments": '{"q": '}}])),
             *sse(chunk(tool_calls=[{"index": 1, "id": "call-2", "function": {"name": "put", "arguments": "{}"}}])),
             *sse(chunk(tool_calls=[{"index": 0, "function": {"arguments": '1}'}}])), b"data: [DONE]\n"]
    feed_all(c, lines)
    assert c.storable and c.has_content
    # canonical: the arguments as the template sees them (JSON, spelled compactly)
    assert c.value() == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "get", "arguments": '{"q":1}'}},
        {"id": "call-2", "type": "function", "function": {"name": "put", "arguments": "{}"}}]}


def test_malformed_tool_call_deltas_make_the_turn_unstorable():
    c = ReplyCollector("chat")
    feed_all(c, sse(chunk(tool_calls=[{"index": "zero", "function": {"name": "f"}}])))
    assert not c.storable


def test_completion_text_and_reasoning():
    c = ReplyCollector("completion")
    feed_all(c, sse({"choices": [{"index": 0, "text": "x y"}]}))
    assert c.value() == "x y"
    r = ReplyCollector("chat")
    feed_all(r, sse(chunk(reasoning_content="think")) + sse(chunk("ok")))
    # reasoning is no part of a turn's address (clients drop it; the token proof bounds the pull)
    assert r.value() == {"role": "assistant", "content": "ok"}
