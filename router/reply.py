"""Decode's answer as the relay sees it (pure, no I/O): which lines go on to the client, with the engines'
``kv_transfer_params`` taken out, and the reply rebuilt as the client will send it back next turn (the text and
tool calls that, with the history, address the stored turn; see ``router.guard``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from router import guard, sse
from router.errors import engine_message
from router.outcomes import RequestKind


def redacted(chunk: dict[str, Any]) -> dict[str, Any]:
    """An in-stream error event as a client may see it: the engine's message only when it names nothing internal."""
    error = chunk.get("error")
    code = error.get("code") if isinstance(error, dict) else None
    message = engine_message(orjson.dumps(chunk)) or "the model server failed mid-stream; the reply is incomplete"
    return {"message": message, "type": "upstream_error", "code": code if isinstance(code, int) else 500}


class ReplyCollector:
    """Reads decode's SSE lines: forwards them, strips ``kv_transfer_params``, rebuilds the reply (text and
    tool calls, as a client assembles them to send back; reasoning is not part of a turn's address)."""

    def __init__(self, kind: RequestKind, parse: bool = True) -> None:
        self.kind = kind
        self.parse = parse  # False: nothing will be stored, only strip params and spot the first token
        self.content: list[str] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}  # by the deltas' index: id, type, name, arguments
        self.kv_transfer_params: dict[str, Any] | None = None
        self.has_content = False
        self.complete = False
        self.storable = True
        self.drop_separator = False  # the blank line after a chunk we removed is dropped too

    def feed(self, line: bytes) -> bytes | None:
        payload = sse.data_of(line)  # ``data:`` with or without its space, as the SSE spec allows
        if payload is None:
            if self.drop_separator and not line.strip():
                self.drop_separator = False
                return None  # the blank line that ended a chunk we removed
            return line
        if payload == b"[DONE]":
            self.complete = True
            return line
        if not self.parse and b'"kv_transfer_params"' not in payload and b'"error"' not in payload:
            self.has_content = self.has_content or b'"choices":[]' not in payload
            return line
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return line
        if not isinstance(chunk, dict):
            return line
        if "error" in chunk:  # an engine's in-stream error: redacted like every other engine error
            self.storable = False
            return b"data: " + orjson.dumps({"error": redacted(chunk)}) + b"\n"
        if "kv_transfer_params" in chunk:
            self.kv_transfer_params = chunk.pop("kv_transfer_params")
            if not chunk.get("choices") and not chunk.get("usage"):
                self.drop_separator = True
                return None  # the connector's params-only chunk: nothing left for the client
            line = b"data: " + orjson.dumps(chunk) + b"\n"
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                self.storable = False
                continue
            if self.kind == RequestKind.CHAT:
                delta = choice.get("delta") or {}
                for call in delta.get("tool_calls") or ():
                    self._tool_call_delta(call)
                text = delta.get("content")
            else:
                text = choice.get("text")
            if text:
                self.content.append(text)
                self.has_content = True
        return line

    def _tool_call_delta(self, call: Any) -> None:
        if not isinstance(call, Mapping) or not isinstance(call.get("index", 0), int):
            self.storable = False
            return
        self.has_content = True
        slot = self.tool_calls.setdefault(call.get("index", 0), {"id": "", "type": "", "name": "", "arguments": ""})
        fn = call.get("function") or {}
        for key, value in (("id", call.get("id")), ("type", call.get("type")), ("name", fn.get("name"))):
            if value:
                slot[key] = value
        slot["arguments"] += fn.get("arguments") or ""

    def value(self) -> dict[str, Any] | str:
        text = "".join(self.content)
        if self.kind != RequestKind.CHAT:
            return text
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c["id"], "type": c["type"] or "function", "function": {"name": c["name"],
                                                                               "arguments": c["arguments"]}}
                for _, c in sorted(self.tool_calls.items())]
        return guard.canonical_message(message)
