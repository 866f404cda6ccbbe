"""router.apis.chat_stream: the one walk over the engines' chat stream that both API translators share (their
event shapes are tested in test_apis.py)."""

from __future__ import annotations

import orjson

from router.apis.chat_stream import ChatStreamWalker, ToolCallDelta


class Recorder(ChatStreamWalker):
    """Every hook call as a line of text, so the walk itself can be read."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[object] = []

    def _say(self, *what: object) -> list[bytes]:
        self.calls.append(what)
        return [repr(what).encode()]

    def on_start(self, chunk):
        return self._say("start", chunk.get("id"))

    def on_reasoning(self, text):
        return self._say("reasoning", text)

    def on_text(self, text):
        return self._say("text", text)

    def on_tool_call(self, call):
        return self._say("tool", call)

    def on_end(self):
        return self._say("end", self.finish_reason, self.stop_reason, self.usage, self.any_tool_call)

    def error_event(self, status, message):
        return repr(("error", status, message)).encode()


def data(chunk) -> bytes:
    return b"data: " + orjson.dumps(chunk) + b"\n"


def choice(delta, finish=None, index=0, **extra):
    return {"id": "c1", "choices": [{"index": index, "delta": delta, "finish_reason": finish, **extra}]}


def test_the_walk_reads_choice_zero_and_keeps_finish_usage_and_tool_calls():
    w = Recorder()
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 4}}
    assert w.feed(b": keepalive\r\n") == b": keepalive\n\n"
    for line in (data(choice({"reasoning_content": "hm"})), data(choice({"content": "other"}, index=1)),
                 data(choice({"content": "hi"})), b"event: x\n", b"data: {not json\n",
                 data(choice({"tool_calls": [{"index": 1, "id": "t", "function": {"name": "f", "arguments": "{"}},
                                             "not a call"]})),
                 data(choice({}, "stop", stop_reason="END")), data({"id": "c1", "choices": [], "usage": usage})):
        w.feed(line)
    assert w.feed(b"data: [DONE]\n") != b""
    assert w.feed(b"data: [DONE]\n") == b""  # closed once
    assert w.calls == [("start", "c1"), ("reasoning", "hm"), ("text", "hi"), ("tool", ToolCallDelta(1, "t", "f", "{")),
                       ("end", "stop", "END", (5, 2, 4), True)]


def test_an_engine_error_ends_the_stream_with_the_clients_error_event():
    w = Recorder()
    assert w.feed(data({"error": {"code": 503, "message": "busy"}})) == repr(("error", 503, "busy")).encode()
    assert w.feed(data(choice({"content": "late"}))) == b"" and w.feed(b"data: [DONE]\n") == b""
    assert w.calls == []


def test_a_stream_that_ends_before_any_chunk_still_starts_and_ends():
    w = Recorder()
    w.feed(b"data: [DONE]\n")
    assert w.calls == [("start", None), ("end", None, None, None, False)]
