"""Walking the engines' chat-completions SSE stream, for the translators that answer in another API's events.

Both ``/v1/responses`` and ``/v1/messages`` stream back a chat stream translated into their own events, and
both read it the same way: comments pass through, the first chunk starts the answer, vLLM's mid-stream error
chunk ends it with the client's error event, only choice 0 counts, its deltas carry reasoning, text and
tool-call pieces, the last choice chunk names the finish reason, a chunk with ``usage`` carries the counts, and
``[DONE]`` (or nothing, for an answer that never started) closes it. ``ChatStreamWalker`` does that walk once
and keeps what both need (usage, finish and vLLM's matched stop string, whether any tool was called); each
translator subclasses it with only its event shapes (the ``on_*`` hooks and ``error_event``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from router import sse as sse_lines
from router.apis import reasoning_of, usage_of


def chat_line(line: bytes) -> tuple[str, Any]:
    """Classify one line of a chat-completions SSE stream: ("chunk", dict), ("done", None), ("comment", line)
    or ("skip", None) (blank lines, ``event:``/``id:`` fields, unparsable data)."""
    if line.startswith(b":"):
        return "comment", line.rstrip(b"\r\n") + b"\n\n"
    payload = sse_lines.data_of(line)
    if payload is None:
        return "skip", None
    if payload == sse_lines.DONE:
        return "done", None
    try:
        chunk = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return "skip", None
    return ("chunk", chunk) if isinstance(chunk, dict) else ("skip", None)


def engine_error(chunk: Mapping[str, Any]) -> tuple[int, str] | None:
    """(status, message) of vLLM's mid-stream error chunk (``{"error": {...}}``), or None for any other chunk."""
    if "error" not in chunk:
        return None
    error = chunk["error"] if isinstance(chunk["error"], Mapping) else {}
    return int(error.get("code") or 500), str(error.get("message") or "error")


@dataclass(frozen=True)
class ToolCallDelta:
    """One piece of a streamed tool call: the first piece of a call names it, later ones add arguments."""

    index: int  # the chat tool-call index (which call this piece belongs to)
    id: str  # "" on pieces after the first
    name: str  # "" on pieces after the first
    arguments: str  # the arguments text this piece adds ("" when none)


class ChatStreamWalker:
    """Chat-completion chunks in (one SSE line at a time), the client's events out: the walk, not the events."""

    def __init__(self) -> None:
        self.started = False
        self.ended = False
        #: (prompt, completion, cached prompt) tokens of the last chunk that carried usage; None before one.
        self.usage: tuple[int, int, int] | None = None
        #: The choice's finish reason and vLLM's matched stop string (``stop_reason``), once a chunk names them.
        self.finish_reason: str | None = None
        self.stop_reason: Any = None
        self.any_tool_call = False

    # -- the client's events: each translator's own ----------------------------------------------

    def on_start(self, chunk: Mapping[str, Any]) -> list[bytes]:
        """The answer's opening events, from its first chunk ({} when the stream ends before any)."""
        raise NotImplementedError

    def on_reasoning(self, text: str) -> list[bytes]:
        raise NotImplementedError

    def on_text(self, text: str) -> list[bytes]:
        raise NotImplementedError

    def on_tool_call(self, call: ToolCallDelta) -> list[bytes]:
        raise NotImplementedError

    def on_end(self) -> list[bytes]:
        """The closing events, once, at ``[DONE]`` (not after an error)."""
        raise NotImplementedError

    def error_event(self, status: int, message: str) -> bytes:
        """The client's mid-stream error event, which ends its stream."""
        raise NotImplementedError

    # -- the walk --------------------------------------------------------------------------------

    def feed(self, line: bytes) -> bytes:
        """The client's SSE bytes for one line of the chat stream (b"" when nothing to send)."""
        kind, value = chat_line(line)
        if kind == "comment":
            return value
        if kind == "done":
            return b"".join(self._done())
        if kind == "chunk" and not self.ended:
            return b"".join(self._chunk(value))
        return b""

    def _start(self, chunk: Mapping[str, Any]) -> list[bytes]:
        self.started = True
        return self.on_start(chunk)

    def _chunk(self, chunk: Mapping[str, Any]) -> list[bytes]:
        error = engine_error(chunk)
        if error is not None:
            self.ended = True
            return [self.error_event(*error)]
        out = [] if self.started else self._start(chunk)
        if chunk.get("usage"):
            self.usage = usage_of(chunk)
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            reasoning = reasoning_of(delta)
            if reasoning:
                out += self.on_reasoning(reasoning)
            if delta.get("content"):
                out += self.on_text(delta["content"])
            for call in delta.get("tool_calls") or ():
                if isinstance(call, Mapping):
                    self.any_tool_call = True
                    fn = call.get("function") or {}
                    out += self.on_tool_call(ToolCallDelta(call.get("index", 0), str(call.get("id") or ""),
                                                           str(fn.get("name") or ""), fn.get("arguments") or ""))
            if choice.get("finish_reason"):
                self.finish_reason, self.stop_reason = choice["finish_reason"], choice.get("stop_reason")
        return out

    def _done(self) -> list[bytes]:
        if self.ended:
            return []
        self.ended = True
        out = [] if self.started else self._start({})
        return out + self.on_end()
