"""Anthropic Messages (``POST /v1/messages``) over the chat-completions P/D path (pure).

Messages become chat messages the way vLLM 0.32's own ``/v1/messages`` builds them
(``vllm.entrypoints.anthropic.serving``): ``system`` is the first message (Claude Code's per-request
``x-anthropic-billing-header`` block dropped, as vLLM does: it would change every prompt), ``tool_use``
blocks are the assistant message's ``tool_calls`` (``input`` serialised as the arguments), each
``tool_result`` block a ``role: tool`` message, ``thinking`` the assistant message's ``reasoning``. The
answer's content blocks, sent back as the assistant message (what a client appends to its history),
rebuild exactly the assistant message decode generated (tool arguments are compared as JSON,
``router.guard``), so the next turn finds its KV by content.
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Mapping
from typing import Any

import orjson

from router.apis import (
    first_choice,
    parse_arguments,
    reasoning_of,
    refuse_unknown,
    sse,
    usage_of,
)
from router.apis.chat_stream import ChatStreamWalker, ToolCallDelta
from router.guard import RequestError

API = "/v1/messages"
KNOWN = frozenset({
    "model", "messages", "max_tokens", "system", "stop_sequences", "temperature", "top_p", "top_k", "stream",
    "tools", "tool_choice", "metadata", "thinking", "service_tier", "output_config",
    # vLLM extras of its Messages request, passed to chat completions as they are
    "cache_salt", "chat_template_kwargs", "vllm_xargs", "conversation_id",
    # and vLLM's chat extras a translation can carry (engines with --trust-request-chat-template)
    "chat_template", "seed",
})
PASSED = ("model", "temperature", "top_p", "top_k", "cache_salt", "chat_template_kwargs", "vllm_xargs",
          "conversation_id", "chat_template", "seed")
BILLING_HEADER = "x-anthropic-billing-header"
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _image_url(source: Any, where: str) -> str:
    if isinstance(source, Mapping):
        if source.get("type") == "base64" and source.get("data"):
            return f"data:{source.get('media_type') or 'image/png'};base64,{source['data']}"
        if source.get("type") == "url" and source.get("url"):
            return str(source["url"])
    raise RequestError(f"{where}.source: only base64 and url image sources are supported")


def _tool_result_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of blocks")
    texts = []
    for i, block in enumerate(content):
        if not isinstance(block, Mapping) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, Mapping) else None
            raise RequestError(f"{where}.content[{i}]: tool_result block type {kind!r} is not supported (text only)")
        texts.append(str(block.get("text") or ""))
    return "\n".join(texts)


def _system(system: Any) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    if not isinstance(system, list):
        raise RequestError("'system' must be a string or a list of text blocks")
    parts = []
    for i, block in enumerate(system):
        if not isinstance(block, Mapping) or block.get("type") != "text":
            raise RequestError(f"system[{i}]: only text blocks are supported")
        text = str(block.get("text") or "")
        if text and not text.startswith(BILLING_HEADER):
            parts.append(text)
    return "".join(parts)


def _message(message: Any, i: int, out: list[dict[str, Any]]) -> None:
    where = f"messages[{i}]"
    if not isinstance(message, Mapping) or message.get("role") not in ("user", "assistant"):
        raise RequestError(f"{where} must be an object with role 'user' or 'assistant'")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        out.append({"role": role, "content": content})
        return
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of content blocks")
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text":
            if block.get("text"):
                parts.append({"type": "text", "text": str(block["text"])})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"), at)}})
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": str(block.get("id") or ""), "type": "function",
                          "function": {"name": str(block.get("name") or ""),
                                       "arguments": orjson.dumps(block.get("input") or {}).decode()}})
        elif kind == "tool_result" and role == "user":
            out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id") or ""),
                        "content": _tool_result_text(block.get("content"), at)})
        elif kind == "thinking" and role == "assistant":
            reasoning.append(str(block.get("thinking") or ""))
        elif kind == "redacted_thinking" and role == "assistant":
            continue  # opaque: accepted when a client echoes it back, as vLLM does
        else:
            raise RequestError(f"{at}: content block type {kind!r} is not supported in a {role} message")
    msg: dict[str, Any] = {"role": role}
    if reasoning:
        msg["reasoning"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    if parts:
        only_text = len(parts) == 1 and parts[0]["type"] == "text"
        msg["content"] = parts[0]["text"] if only_text else parts
    elif role == "user":
        return  # tool results only: their tool messages are the turn
    out.append(msg)


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type") not in (None, "custom") or not tool.get("name"):
            kind = tool.get("type") if isinstance(tool, Mapping) else None
            raise RequestError(f"tools[{i}]: tool type {kind!r} is not supported (client tools with a name and "
                               "input_schema only)")
        fn = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
        if tool.get("description"):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any, chat: dict[str, Any]) -> None:
    if not isinstance(choice, Mapping):
        raise RequestError("'tool_choice' must be an object")
    kind = choice.get("type")
    if kind == "auto":
        chat["tool_choice"] = "auto"
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "none":
        chat["tool_choice"] = "none"
    elif kind == "tool" and choice.get("name"):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise RequestError(f"'tool_choice' {dict(choice)!r} is not supported")
    if choice.get("disable_parallel_tool_use") is not None:
        chat["parallel_tool_calls"] = not choice["disable_parallel_tool_use"]


EFFORTS = ("low", "medium", "high", "xhigh", "max")


def _reasoning(body: Mapping[str, Any], chat: dict[str, Any]) -> None:
    """``output_config`` and ``thinking`` as vLLM's own endpoint maps them: ``effort`` is the chat
    ``reasoning_effort``, a JSON ``format`` the ``response_format``; thinking ``enabled`` a
    ``thinking_token_budget`` (engines need a reasoning config for it), ``disabled`` reasoning effort ``none``
    (vLLM probes the template and may pick ``low`` instead; the router does not), ``adaptive`` nothing."""
    config = body.get("output_config")
    if config is not None:
        if not isinstance(config, Mapping) or set(config) - {"effort", "format"}:
            raise RequestError("'output_config': only 'effort' and 'format' are supported")
        effort = config.get("effort")
        if effort is not None:
            if effort not in EFFORTS:
                raise RequestError(f"'output_config.effort' must be one of {', '.join(EFFORTS)}")
            chat["reasoning_effort"] = effort
        fmt = config.get("format")
        if fmt is not None:
            if not isinstance(fmt, Mapping) or fmt.get("type", "json_schema") != "json_schema" or not isinstance(
                    fmt.get("schema"), Mapping):
                raise RequestError("'output_config.format' must be {\"type\": \"json_schema\", \"schema\": {...}}")
            chat["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "json_schema", "schema": fmt["schema"]}}
    thinking = body.get("thinking")
    if thinking is None:
        return
    kind = thinking.get("type") if isinstance(thinking, Mapping) else None
    if kind == "disabled":
        chat["reasoning_effort"] = "none"
    elif kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1024:
            raise RequestError("'thinking.budget_tokens' must be an integer of at least 1024")
        if budget >= body["max_tokens"]:
            raise RequestError("'thinking.budget_tokens' must be less than 'max_tokens'")
        chat["thinking_token_budget"] = budget
    elif kind != "adaptive":
        raise RequestError(f"'thinking' type {kind!r} is not supported (enabled, disabled or adaptive)")


def _stop(choice: Mapping[str, Any], stops: list[str], tools: bool) -> tuple[str | None, str | None]:
    """Anthropic's stop_reason and stop_sequence from a chat choice (vLLM puts a matched stop string in
    ``stop_reason``)."""
    finish = choice.get("finish_reason")
    if finish is None:
        return None, None
    matched = choice.get("stop_reason")
    if finish == "stop" and isinstance(matched, str) and matched in stops:
        return "stop_sequence", matched
    if tools and finish != "length":
        return "tool_use", None
    return STOP_REASONS.get(finish, "end_turn"), None


class MessagesTranslation:
    """One ``/v1/messages`` request as chat completions, and its answer as a Message object or events."""

    route = API
    keeps_reply = False  # the Messages API has no server-side state: every request carries the conversation

    def kept(self, reply: Any) -> None:
        return None

    def __init__(self, body: Any) -> None:
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        refuse_unknown(body, KNOWN, API)
        if not body.get("model"):
            raise RequestError("'model' is required")
        max_tokens = body.get("max_tokens")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0:
            raise RequestError("'max_tokens' must be a positive integer")
        if body.get("service_tier") not in (None, "auto", "standard_only"):
            raise RequestError(f"'service_tier' {body['service_tier']!r} is not supported")
        metadata = body.get("metadata")
        if metadata is not None and (not isinstance(metadata, Mapping) or set(metadata) - {"user_id"}):
            raise RequestError("'metadata': only 'user_id' is supported")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("'messages' must be a non-empty list")
        chat_messages: list[dict[str, Any]] = []
        system = _system(body.get("system"))
        if system:
            chat_messages.append({"role": "system", "content": system})
        for i, message in enumerate(messages):
            _message(message, i, chat_messages)
        stops = body.get("stop_sequences") or []
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise RequestError("'stop_sequences' must be a list of strings")
        chat: dict[str, Any] = {k: body[k] for k in PASSED if body.get(k) is not None}
        chat["messages"] = chat_messages
        chat["max_tokens"] = max_tokens
        if stops:
            chat["stop"] = stops
        if body.get("tools"):
            chat["tools"] = _tools(body["tools"])
        if body.get("tool_choice") is not None:
            _tool_choice(body["tool_choice"], chat)
        if body.get("stream"):
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True}  # output_tokens of message_delta
        _reasoning(body, chat)
        if messages[-1].get("role") == "assistant":  # a prefilled answer: continue it (Anthropic's semantics)
            chat["continue_final_message"], chat["add_generation_prompt"] = True, False
        self.stops = stops
        self.model = str(body["model"])
        self.chat_body = chat
        self._stream: _MessagesStream | None = None

    def unary(self, chat: Mapping[str, Any]) -> dict[str, Any]:
        choice = first_choice(chat)
        message = choice.get("message") or {}
        content: list[dict[str, Any]] = []
        reasoning = reasoning_of(message)
        if reasoning:
            content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
        text = message.get("content") or ""
        calls = message.get("tool_calls") or []
        if text or not calls:
            content.append({"type": "text", "text": text})
        for call in calls:
            fn = call.get("function") or {}
            content.append({"type": "tool_use", "id": str(call.get("id") or ""), "name": str(fn.get("name") or ""),
                            "input": parse_arguments(fn.get("arguments"))})
        stop_reason, stop_sequence = _stop(choice, self.stops, bool(calls))
        prompt, completion, cached = usage_of(chat)
        return {"id": _message_id(chat.get("id")), "type": "message", "role": "assistant",
                "model": str(chat.get("model") or self.model), "content": content, "stop_reason": stop_reason,
                "stop_sequence": stop_sequence, "usage": _usage(prompt, completion, cached)}

    def stream_line(self, line: bytes) -> bytes:
        if self._stream is None:
            self._stream = _MessagesStream(self)
        return self._stream.feed(line)

    @staticmethod
    def error_shape(status: int, message: str) -> bytes:
        """Anthropic's error body (the anthropic SDK reads ``error.type`` and ``error.message``)."""
        return orjson.dumps({"type": "error", "error": {"type": _error_type(status, "api_error"), "message": message}})

    def error_event(self, status: int, message: str) -> bytes:
        return sse("error", {"type": "error", "error": {"type": _error_type(status, "api_error"), "message": message}})


def _error_type(status: int, kind: str) -> str:
    """Anthropic's error types by status."""
    return {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
            413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
            529: "overloaded_error"}.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")


def _message_id(chat_id: Any) -> str:
    text = str(chat_id or "").removeprefix("chatcmpl-")
    if not text:
        text = base64.b32encode(uuid.uuid4().bytes).decode().rstrip("=").lower()
    return f"msg_{text}"


def _usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    """Anthropic's usage: ``input_tokens`` are the prompt tokens not read from the cache (its total input is
    input + cache read + cache creation), ``cache_read_input_tokens`` the ones that were (``router.usage``)."""
    return {"input_tokens": max(0, prompt - cached), "output_tokens": completion, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0}


class _MessagesStream(ChatStreamWalker):
    """Chat-completion chunks in, Anthropic streaming events out: ``message_start``, a
    ``content_block_start`` / ``_delta`` / ``_stop`` run per block (thinking, text, each tool_use),
    ``message_delta`` (stop reason, usage) and ``message_stop``."""

    def __init__(self, owner: MessagesTranslation) -> None:
        super().__init__()
        self.owner = owner
        self.index = -1  # the open block's index
        self.open: str | None = None  # "thinking" | "text" | "tool_use"
        self.calls: dict[int, int] = {}  # chat tool-call index -> block index

    def error_event(self, status: int, message: str) -> bytes:
        return self.owner.error_event(status, message)

    def on_start(self, chunk: Mapping[str, Any]) -> list[bytes]:
        message = {"id": _message_id(chunk.get("id")), "type": "message", "role": "assistant",
                   "model": str(chunk.get("model") or self.owner.model), "content": [], "stop_reason": None,
                   "stop_sequence": None, "usage": _usage(0, 0, 0)}
        return [sse("message_start", {"type": "message_start", "message": message})]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            out.append(sse("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                   "delta": {"type": "signature_delta", "signature": ""}}))
        self.open = None
        out.append(sse("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        return out

    def _open(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.open = kind
        out.append(sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                               "content_block": block}))
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def on_reasoning(self, text: str) -> list[bytes]:
        out = [] if self.open == "thinking" else self._open("thinking", {"type": "thinking", "thinking": "",
                                                                          "signature": ""})
        out.append(self._delta({"type": "thinking_delta", "thinking": text}))
        return out

    def on_text(self, text: str) -> list[bytes]:
        out = [] if self.open == "text" else self._open("text", {"type": "text", "text": ""})
        out.append(self._delta({"type": "text_delta", "text": text}))
        return out

    def on_tool_call(self, call: ToolCallDelta) -> list[bytes]:
        out: list[bytes] = []
        if call.index not in self.calls:
            out += self._open("tool_use", {"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
            self.calls[call.index] = self.index
        if call.arguments and self.calls[call.index] == self.index:
            out.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
        return out

    def on_end(self) -> list[bytes]:
        out: list[bytes] = []
        if self.index < 0:  # an empty answer is still one (empty) text block
            out += self._open("text", {"type": "text", "text": ""})
        out += self._close()
        stop_reason, stop_sequence = _stop({"finish_reason": self.finish_reason or "stop",
                                            "stop_reason": self.stop_reason}, self.owner.stops, self.any_tool_call)
        prompt, completion, cached = self.usage or (0, 0, 0)
        out.append(sse("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                         "usage": _usage(prompt, completion, cached)}))
        out.append(sse("message_stop", {"type": "message_stop"}))
        return out
