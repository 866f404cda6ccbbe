"""OpenAI Responses (``POST /v1/responses``) over the chat-completions P/D path (pure).

The input items become chat messages the way vLLM 0.32's own Responses endpoint builds them
(``vllm.entrypoints.openai.responses.utils.construct_input_messages``): ``instructions`` is a system
message, a ``function_call`` joins the assistant message before it, ``function_call_output`` is a
``role: tool`` message, reasoning is the assistant message's ``reasoning``. So the output items of one
answer, sent back as input (what ``input += response.output`` does), rebuild exactly the assistant
message decode generated, and the next turn finds its KV by content.

``store`` (true unless sent false, as in the OpenAI API) keeps the answer's conversation for ``responses_ttl``
(``router.apis.stored``), so ``previous_response_id`` continues it: its messages go in front of this request's
input (the previous ``instructions`` are not carried over, as in the OpenAI API), and the turn is found by
content like any other. ``conversation`` objects, ``background`` and stored prompts need state the router does
not keep: refused (400 naming the field); so is anything else it cannot translate.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

from router.apis import (
    compact_arguments,
    first_choice,
    reasoning_of,
    refuse_unknown,
    sse,
    usage_of,
)
from router.apis.chat_stream import ChatStreamWalker, ToolCallDelta
from router.guard import RequestError

API = "/v1/responses"
#: Fields translated or accepted (``metadata``, ``user``, ``safety_identifier`` are echoed, not used).
KNOWN = frozenset({
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "tools",
    "tool_choice", "parallel_tool_calls", "text", "reasoning", "metadata", "user", "safety_identifier", "store",
    "previous_response_id",
    "prompt_cache_key", "truncation", "include", "service_tier", "stream_options",
    # vLLM extras of its Responses request, passed to chat completions as they are
    "top_k", "min_p", "seed", "stop", "stop_token_ids", "repetition_penalty", "ignore_eos", "cache_salt",
    "chat_template", "chat_template_kwargs", "priority", "structured_outputs", "mm_processor_kwargs",
    "session_id", "conversation_id",
})
PASSED = ("model", "temperature", "top_p", "parallel_tool_calls", "prompt_cache_key", "top_k", "min_p", "seed",
          "stop", "stop_token_ids", "repetition_penalty", "ignore_eos", "cache_salt", "chat_template",
          "chat_template_kwargs", "priority", "structured_outputs", "mm_processor_kwargs", "session_id",
          "conversation_id")
#: Fields whose meaning needs state the router does not keep.
STATEFUL = {
    "conversation": "the router stores no conversations: send the whole conversation as 'input'",
    "background": "background responses are not served",
    "prompt": "stored prompt templates are not served",
    "max_tool_calls": "not enforced by the engines",
    "top_logprobs": "logprobs are not translated",
}


def _text_parts(content: Any, where: str) -> str | list[dict[str, Any]]:
    """Message content: a string when all parts are text (as chat clients send it), else chat parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of content parts")
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": str(part.get("text") or "")})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        elif kind == "refusal":
            parts.append({"type": "text", "text": str(part.get("refusal") or "")})
        else:
            raise RequestError(f"{where}.content[{i}]: content part type {kind!r} is not supported")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _tool_output(output: Any, where: str) -> str:
    if isinstance(output, str):
        return output
    text = _text_parts(output, where)
    if not isinstance(text, str):
        raise RequestError(f"{where}.output: only text tool outputs are supported")
    return text


def input_messages(body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], bool]:
    """Chat messages from ``instructions`` and ``input``; and whether the last one is a partial assistant
    message to continue (vLLM's rule: status ``in_progress``/``incomplete``)."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions:
        if not isinstance(instructions, str):
            raise RequestError("'instructions' must be a string")
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}], False
    if not isinstance(items, list) or not items:
        raise RequestError("'input' must be a string or a non-empty list of input items")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise RequestError(f"{where} must be an object")
        kind = item.get("type") or ("message" if "role" in item else None)
        prev = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise RequestError(f"{where}.role {role!r} is not supported")
            content = _text_parts(item.get("content"), where)
            if role == "assistant" and prev is not None and prev.get("content") is None:
                prev["content"] = content  # after its reasoning: one assistant message
            else:
                messages.append({"role": role, "content": content})
        elif kind == "function_call":
            call = {"id": str(item.get("call_id") or ""), "type": "function",
                    "function": {"name": str(item.get("name") or ""),
                                 "arguments": compact_arguments(item.get("arguments") or "")}}
            if prev is not None:
                prev.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": str(item.get("call_id") or ""),
                             "content": _tool_output(item.get("output"), where)})
        elif kind == "reasoning":
            if item.get("encrypted_content"):
                raise RequestError(f"{where}: encrypted reasoning content is not supported")
            parts = item.get("content") or item.get("summary") or []
            text = "".join(str(p.get("text") or "") for p in parts if isinstance(p, Mapping))
            if prev is not None and prev.get("reasoning") is None and prev.get("content") is None:
                prev["reasoning"] = text
            else:
                messages.append({"role": "assistant", "content": None, "reasoning": text})
        else:
            raise RequestError(f"{where}: input item type {kind!r} is not supported")
    last = items[-1]
    partial = (isinstance(last, Mapping) and last.get("role") == "assistant"
               and last.get("status") in ("in_progress", "incomplete"))
    return messages, partial


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, Mapping) else None
            raise RequestError(f"tools[{i}]: tool type {kind!r} is not supported (function tools only)")
        fn = {"name": tool.get("name"), "parameters": tool.get("parameters") or {"type": "object"}}
        for extra in ("description", "strict"):
            if tool.get(extra) is not None:
                fn[extra] = tool[extra]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, Mapping) and choice.get("type") == "function" and choice.get("name"):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise RequestError(f"'tool_choice' {choice!r} is not supported (auto, none, required or a function)")


def _text_format(text: Any) -> dict[str, Any] | None:
    if not isinstance(text, Mapping):
        raise RequestError("'text' must be an object")
    unknown = set(text) - {"format", "verbosity"}
    if unknown or text.get("verbosity") not in (None, "medium"):
        raise RequestError(f"'text': only 'format' is supported (got {sorted(text)})")
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {"name": fmt.get("name") or "response", "schema": fmt.get("schema") or {}}
        if fmt.get("strict") is not None:
            schema["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": schema}
    raise RequestError(f"'text.format' type {kind!r} is not supported")


class ResponsesTranslation:
    """One ``/v1/responses`` request as chat completions, and its answer as a Response object or events."""

    route = API

    def __init__(self, body: Any, prior: list[dict[str, Any]] | None = None) -> None:
        """``prior``: the messages ``previous_response_id`` continues (``router.apis.stored``), reply included."""
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        if body.get("previous_response_id") and prior is None:
            raise RequestError("'previous_response_id' needs the router's kept responses (responses_ttl > 0)")
        for name, why in STATEFUL.items():
            if body.get(name) not in (None, False, ""):
                raise RequestError(f"'{name}' is not supported: {why}")
        refuse_unknown({k: v for k, v in body.items() if k not in STATEFUL}, KNOWN, API)
        self.store = body.get("store") is not False
        self.response_id = ""
        if body.get("truncation") not in (None, "disabled"):
            raise RequestError("'truncation' must be 'disabled' (the engines do not truncate conversations)")
        _check_include(body.get("include"))
        if body.get("service_tier") not in (None, "auto", "default"):
            raise RequestError(f"'service_tier' {body['service_tier']!r} is not supported")
        if not body.get("model"):
            raise RequestError("'model' is required")
        self.request = body
        messages, partial = input_messages(body)
        own = 1 if body.get("instructions") else 0  # the instructions message is this request's, never kept
        messages[own:own] = prior or []
        self.history = messages[own:]
        chat: dict[str, Any] = {k: body[k] for k in PASSED if body.get(k) is not None}
        chat["messages"] = messages
        if partial:
            chat["continue_final_message"], chat["add_generation_prompt"] = True, False
        if body.get("max_output_tokens") is not None:
            chat["max_tokens"] = body["max_output_tokens"]
        if body.get("tools"):
            chat["tools"] = _tools(body["tools"])
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = _tool_choice(body["tool_choice"])
        if body.get("text") is not None:
            fmt = _text_format(body["text"])
            if fmt is not None:
                chat["response_format"] = fmt
        reasoning = body.get("reasoning")
        if isinstance(reasoning, Mapping):
            if set(reasoning) - {"effort", "summary"}:
                raise RequestError("'reasoning': only 'effort' is supported")
            if reasoning.get("effort"):
                chat["reasoning_effort"] = reasoning["effort"]
        elif reasoning is not None:
            raise RequestError("'reasoning' must be an object")
        if body.get("stream"):
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True}  # the usage of response.completed
        self.chat_body = chat
        self.created = int(time.time())
        self._stream: _ResponsesStream | None = None

    # -- answers -------------------------------------------------------------------------------

    def envelope(self, response_id: str, model: str, status: str, output: list[dict[str, Any]],
                 usage: dict[str, Any] | None, incomplete: str | None = None) -> dict[str, Any]:
        """A Response object (the fields the openai SDK's ``Response`` declares)."""
        body = self.request
        return {
            "id": response_id, "object": "response", "created_at": self.created, "status": status,
            "background": False, "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "max_tool_calls": None, "model": model or body.get("model"), "output": output,
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": {"effort": (body.get("reasoning") or {}).get("effort"), "summary": None},
            "service_tier": body.get("service_tier") or "auto", "store": self.store,
            "temperature": body.get("temperature"), "text": body.get("text") or {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "top_logprobs": None, "top_p": body.get("top_p"), "truncation": "disabled", "usage": usage,
            "user": body.get("user"), "metadata": body.get("metadata") or {},
        }

    def unary(self, chat: Mapping[str, Any]) -> dict[str, Any]:
        choice = first_choice(chat)
        message = choice.get("message") or {}
        suffix = _suffix(chat.get("id"))
        done = "incomplete" if choice.get("finish_reason") == "length" else "completed"
        output: list[dict[str, Any]] = []
        reasoning = reasoning_of(message)
        if reasoning:
            output.append(_reasoning_item(f"rs_{suffix}", reasoning, "completed"))
        calls = message.get("tool_calls") or []
        text = message.get("content") or ""
        if text or not calls:
            output.append(_message_item(f"msg_{suffix}", text, done))
        for call in calls:
            fn = call.get("function") or {}
            output.append(_call_item(str(call.get("id") or ""), str(fn.get("name") or ""),
                                     str(fn.get("arguments") or ""), "completed"))
        self.response_id = f"resp_{suffix}"
        return self.envelope(self.response_id, str(chat.get("model") or ""), done, output, _usage(chat),
                             "max_output_tokens" if done == "incomplete" else None)

    @property
    def keeps_reply(self) -> bool:
        return self.store

    def kept(self, reply: Any) -> tuple[str, list[dict[str, Any]]] | None:
        """The response id and the messages to keep under it (history + decode's reply), or None."""
        if self._stream is not None:
            self.response_id = self._stream.response_id
        if not self.store or not self.response_id or not isinstance(reply, dict):
            return None
        return self.response_id, [*self.history, reply]

    def stream_line(self, line: bytes) -> bytes:
        if self._stream is None:
            self._stream = _ResponsesStream(self)
        return self._stream.feed(line)

    def error_event(self, status: int, message: str) -> bytes:
        seq = self._stream.next_seq() if self._stream is not None else 0
        return sse("error", {"type": "error", "code": str(status), "message": message, "param": None,
                             "sequence_number": seq,
                             "error": {"message": message, "type": "upstream_error", "code": status}})


def _suffix(chat_id: Any) -> str:
    text = str(chat_id or "")
    return text.removeprefix("chatcmpl-") or uuid.uuid4().hex


def _usage(chat: Mapping[str, Any]) -> dict[str, Any] | None:
    return _usage_object(usage_of(chat)) if chat.get("usage") else None


def _usage_object(counts: tuple[int, int, int] | None) -> dict[str, Any] | None:
    """A Response's usage from (prompt, completion, cached prompt) tokens; None when the engines sent none."""
    if counts is None:
        return None
    prompt, completion, cached = counts
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [_text_part(text)]}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


#: ``include`` values accepted, as vLLM's own Responses endpoint does: agents that keep no server state
#: (Codex CLI, the Agents SDK with ``store=False``) ask for encrypted reasoning to send back next turn; the
#: router holds no key to encrypt it, so reasoning comes back as plain text in the item's content, which
#: ``input_messages`` reads as the assistant's reasoning (and the turn is still found by content).
INCLUDE_ACCEPTED = frozenset({"reasoning.encrypted_content"})


def _check_include(include: Any) -> None:
    if include is None:
        return
    if not isinstance(include, list) or not all(isinstance(v, str) for v in include):
        raise RequestError("'include' must be a list of strings")
    refused = [v for v in include if v not in INCLUDE_ACCEPTED]
    if refused:
        why = ("logprobs are not translated" if refused[0] == "message.output_text.logprobs"
               else "hosted tools and stored files are not served")
        raise RequestError(f"'include' {refused[0]!r} is not supported: {why}")


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": f"fc_{call_id}", "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


class _ResponsesStream(ChatStreamWalker):
    """Chat-completion chunks in, Responses streaming events out (``response.created`` ...
    ``response.completed``), in the order the OpenAI API sends them."""

    def __init__(self, owner: ResponsesTranslation) -> None:
        super().__init__()
        self.owner = owner
        self.seq = 0
        self.response_id = ""
        self.suffix = ""
        self.model = ""
        self.output: list[dict[str, Any]] = []  # finished items
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its open item

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq - 1

    def error_event(self, status: int, message: str) -> bytes:
        return self.owner.error_event(status, message)

    def _event(self, kind: str, **data: Any) -> bytes:
        return sse(kind, {"type": kind, "sequence_number": self.next_seq(), **data})

    def _envelope(self, status: str) -> dict[str, Any]:
        incomplete = "max_output_tokens" if status == "incomplete" else None
        return self.owner.envelope(self.response_id, self.model, status, list(self.output),
                                   _usage_object(self.usage), incomplete)

    def on_start(self, chunk: Mapping[str, Any]) -> list[bytes]:
        self.suffix = _suffix(chunk.get("id"))
        self.response_id, self.model = f"resp_{self.suffix}", str(chunk.get("model") or "")
        return [self._event("response.created", response=self._envelope("in_progress")),
                self._event("response.in_progress", response=self._envelope("in_progress"))]

    def _open_item(self, item: dict[str, Any]) -> list[bytes]:
        out = self._close_item()
        self.open = item
        index = len(self.output)
        public = {k: v for k, v in item.items() if not k.startswith("_")}
        out.append(self._event("response.output_item.added", output_index=index,
                               item={**public, "status": "in_progress"}))
        if item["type"] == "message":
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                   content_index=0, part=_text_part("")))
        elif item["type"] == "reasoning":
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                   content_index=0, part={"type": "reasoning_text", "text": ""}))
        return out

    def _close_item(self, status: str = "completed") -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.output)
        out = []
        if item["type"] == "message":
            text = item.pop("_text")
            item["content"] = [_text_part(text)]
            out.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=text, logprobs=[]))
            out.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=_text_part(text)))
        elif item["type"] == "reasoning":
            text = item.pop("_text")
            item["content"] = [{"type": "reasoning_text", "text": text}]
            out.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=text))
            out.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part={"type": "reasoning_text", "text": text}))
        else:
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   name=item["name"], arguments=item["arguments"]))
        item["status"] = status
        self.output.append(item)
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        return out

    def on_reasoning(self, text: str) -> list[bytes]:
        return self._text("reasoning", text)

    def on_text(self, text: str) -> list[bytes]:
        return self._text("message", text)

    def _text(self, kind: str, delta: str) -> list[bytes]:
        out: list[bytes] = []
        if self.open is None or self.open["type"] != kind:
            out += self._open_text(kind)
        assert self.open is not None
        self.open["_text"] += delta
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        out.append(self._event(name, item_id=self.open["id"], output_index=len(self.output), content_index=0,
                               delta=delta, **extra))
        return out

    def _open_text(self, kind: str) -> list[bytes]:
        if kind == "message":
            item = {**_message_item(f"msg_{self.suffix}", "", "in_progress"), "content": [], "_text": ""}
        else:
            item = {**_reasoning_item(f"rs_{self.suffix}", "", "in_progress"), "content": [], "_text": ""}
        return self._open_item(item)

    def on_tool_call(self, call: ToolCallDelta) -> list[bytes]:
        out: list[bytes] = []
        item = self.calls.get(call.index)
        if item is None or (call.id and item is not self.open):
            item = _call_item(call.id, call.name, "", "in_progress")
            self.calls[call.index] = item
            out += self._open_item(item)
        if call.name and not item["name"]:
            item["name"] = call.name
        if call.arguments:
            item["arguments"] += call.arguments
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=len(self.output), delta=call.arguments))
        return out

    def on_end(self) -> list[bytes]:
        out: list[bytes] = []
        status = "incomplete" if self.finish_reason == "length" else "completed"
        if self.open is None and not self.output:  # an empty answer is still one (empty) message
            out += self._open_text("message")
        out += self._close_item("incomplete" if status == "incomplete" and self.open
                                and self.open["type"] == "message" else "completed")
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        out.append(self._event(kind, response=self._envelope(status)))
        return out
