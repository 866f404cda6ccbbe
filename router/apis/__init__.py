"""Other APIs agents speak, served through the chat-completions P/D + reuse path (pure translation, no I/O).

``/v1/responses`` (OpenAI Responses) and ``/v1/messages`` (Anthropic Messages) are translated at the
router into a ``/v1/chat/completions`` request for the engines, and the engines' chat answer (a JSON
object or its SSE chunks) is translated back into the client's format. Why not the engines' own
endpoints: vLLM 0.32.0 returns ``kv_transfer_params`` on their non-streaming answers only (its Anthropic
stream converter and its Responses streaming drop them), and ``previous_response_id`` names a response
stored on the one engine that answered it, which a P/D pair cannot share. vLLM's own ``/v1/messages`` is a
translation to chat completions too; the chat path carries every leg's params, streaming and not, so the
turns of these APIs are content-addressed exactly like chat turns (``router.guard``).

Every request field is either translated or refused with a 400 that names it: nothing is dropped silently.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import orjson

from router.guard import RequestError


class Translation(Protocol):
    """One client request of another API, translated to chat completions, and its answer back."""

    route: str
    #: The chat-completions body to dispatch.
    chat_body: dict[str, Any]

    def unary(self, chat: Mapping[str, Any]) -> dict[str, Any]:
        """The client's answer object from the engines' chat completion (kv_transfer_params already removed)."""
        ...

    def stream_line(self, line: bytes) -> bytes:
        """The client's SSE bytes for one line of the engines' chat stream (b"" when nothing to send)."""
        ...

    def error_event(self, status: int, message: str) -> bytes:
        """A mid-stream error in the client's SSE format, ending the stream."""
        ...

    @property
    def keeps_reply(self) -> bool:
        """Whether the answer is kept for a later request to continue (``kept``)."""
        ...

    def kept(self, reply: Any) -> tuple[str, list[dict[str, Any]]] | None:
        """After the answer: the id to keep it under and the messages to keep (history + ``reply``), or None."""
        ...


def sse(event: str, data: Mapping[str, Any]) -> bytes:
    """One named SSE event (both APIs name every event)."""
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def refuse_unknown(body: Mapping[str, Any], known: set[str] | frozenset[str], api: str) -> None:
    """A 400 naming every field the translation does not carry (never a silent drop)."""
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        raise RequestError(f"{api}: unsupported field(s) {', '.join(repr(k) for k in unknown)} "
                           "(the turnkv router translates this API to chat completions; see docs/router.md)")


def compact_arguments(arguments: Any) -> str:
    """Tool-call arguments as a string (objects are serialised compactly)."""
    if isinstance(arguments, str):
        return arguments
    return orjson.dumps(arguments).decode()


def parse_arguments(arguments: Any) -> dict[str, Any]:
    """Tool-call arguments as an object (what Anthropic's ``tool_use.input`` carries); {} when not an object."""
    if isinstance(arguments, Mapping):
        return dict(arguments)
    try:
        value = orjson.loads(arguments or "{}")
    except (orjson.JSONDecodeError, TypeError):
        return {}
    return value if isinstance(value, dict) else {}


def reasoning_of(message: Mapping[str, Any]) -> str:
    """The reasoning text of a chat message or delta (vLLM 0.32 names it ``reasoning``; older ones
    ``reasoning_content``)."""
    return str(message.get("reasoning") or message.get("reasoning_content") or "")


def usage_of(chat: Mapping[str, Any]) -> tuple[int, int, int]:
    """(prompt, completion, cached prompt) tokens of a chat answer's usage."""
    usage = chat.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return (int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0),
            int(details.get("cached_tokens") or 0))


def first_choice(chat: Mapping[str, Any]) -> Mapping[str, Any]:
    choices = chat.get("choices") or [{}]
    return choices[0] if isinstance(choices[0], Mapping) else {}
