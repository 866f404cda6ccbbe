"""Pure reuse-safety logic: conversation keys, history digests and the replayable parameters.

The prefill engine pulls KV by position and never compares tokens, so the router may attach a
stored ``kv_transfer_params`` only when the new request provably extends the exact sequence the
decode engine holds. This module decides that from the request bodies alone; no I/O.

- The *conversation key* is an HMAC over the tenant, the conversation id and every request setting
  that changes how a prompt is rendered (model, tools, template settings, ``cache_salt``): a
  different model or tool list is a different conversation, and no client-chosen id can reach
  another tenant's entry.
- The *history digest* covers the canonical messages the decode engine saw plus the reply it
  generated. The next turn must start with exactly those messages; any edit, truncation or
  reordering is a miss, never wrong KV.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from turnkv import wire

#: Settings that change how a chat prompt renders (part of the conversation key).
CHAT_RENDER_FIELDS = (
    "model", "tools", "tool_choice", "chat_template", "chat_template_kwargs", "add_generation_prompt",
    "continue_final_message", "documents", "cache_salt", "mm_processor_kwargs", "reasoning_effort",
    "add_special_tokens", "truncate_prompt_tokens",
)
COMPLETION_RENDER_FIELDS = ("model", "cache_salt", "add_special_tokens", "truncate_prompt_tokens")

#: Message fields that reach the chat template. Everything else (client metadata) is ignored.
MESSAGE_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "reasoning")

#: ``kv_transfer_params`` keys a decode engine returns in bi-directional mode and prefill may be sent:
#: upstream's, then turnkv's (``turnkv.wire``: token proof, boot, wall-clock expiry, model, signature).
REPLAY_KEYS = (
    "do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_request_id",
    "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size", "remote_num_tokens",
    "remote_blocks_expiry_time", "transfer_mode", *wire.OFFER_KEYS,
)
REQUIRED_REPLAY_KEYS = ("remote_block_ids", "remote_engine_id", "remote_host", "remote_port", "remote_num_tokens")

#: What prefill is sent on a turn without reuse (upstream pull protocol, step 1).
FRESH_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}


class RequestError(ValueError):
    """A client request the router refuses (HTTP 400)."""


def _canonical(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def _digest(*parts: bytes) -> str:
    h = hashlib.blake2b(digest_size=20)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def canonical_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a chat message the template sees; text content parts are flattened."""
    out: dict[str, Any] = {}
    for field in MESSAGE_FIELDS:
        value = message.get(field)
        if value is None or value == [] or (field != "content" and value == ""):
            continue
        if field == "content" and isinstance(value, list) and all(
            isinstance(p, Mapping) and p.get("type") == "text" for p in value
        ):
            value = "".join(str(p.get("text", "")) for p in value)
        out[field] = value
    out.setdefault("content", "")
    return out


#: Content-part URL fields whose bytes the router never sees unless inlined as a ``data:`` URL.
_MEDIA_URL_PARTS = {"image_url": "image_url", "video_url": "video_url", "audio_url": "audio_url",
                    "image_pil": None, "image_embeds": None}


def has_remote_media(message: Mapping[str, Any]) -> bool:
    """Whether a message has media whose bytes the router cannot digest (a URL the engine fetches): new bytes
    behind the same URL must never reuse the old KV, so such a conversation is not reused at all."""
    content = message.get("content")
    if not isinstance(content, list):
        return False
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") in (None, "text"):
            continue
        kind = part.get("type")
        if kind not in _MEDIA_URL_PARTS:
            if kind == "input_audio":  # base64 audio inline: its bytes are in the digest
                continue
            return True  # an unknown part: not provably digested
        field = _MEDIA_URL_PARTS[kind]
        value = part.get(field) if field else None
        url = value.get("url") if isinstance(value, Mapping) else value
        if not isinstance(url, str) or not url.startswith("data:"):
            return True
    return False


def history_digest(messages: Sequence[Mapping[str, Any]]) -> str:
    return _digest(*(_canonical(canonical_message(m)) for m in messages))


def text_digest(text: str) -> str:
    return _digest(text.encode())


@dataclass(frozen=True)
class Turn:
    """What the router needs to know about one request to decide and record reuse."""

    kind: str  # "chat" or "completion"
    render_digest: str  # settings that change rendering
    messages: tuple[Mapping[str, Any], ...] = ()
    prompt: str | None = None

    def continues(self, history: History) -> bool:
        """True when this request's prompt extends ``history`` exactly."""
        if history.kind != self.kind or history.render_digest != self.render_digest:
            return False
        if self.kind == "chat":
            n = history.length
            return len(self.messages) > n and history_digest(self.messages[:n]) == history.digest
        assert self.prompt is not None
        return len(self.prompt) > history.length and text_digest(self.prompt[: history.length]) == history.digest

    def extended_by(self, reply: Mapping[str, Any] | str) -> History:
        """The history the decode engine holds after answering this request with ``reply``."""
        if self.kind == "chat":
            assert isinstance(reply, Mapping)
            messages = (*self.messages, reply)
            return History(self.kind, self.render_digest, history_digest(messages), len(messages))
        assert self.prompt is not None and isinstance(reply, str)
        text = self.prompt + reply
        return History(self.kind, self.render_digest, text_digest(text), len(text))


@dataclass(frozen=True)
class History:
    kind: str
    render_digest: str
    digest: str
    length: int  # messages (chat) or characters (completion)


def render_digest(kind: str, body: Mapping[str, Any]) -> str:
    """Digest of the settings that change how a prompt renders (model, tools, template, cache_salt, ...)."""
    fields = CHAT_RENDER_FIELDS if kind == "chat" else COMPLETION_RENDER_FIELDS
    return _digest(*(_canonical(body.get(f)) for f in fields))


def render_only(kind: str, body: Mapping[str, Any]) -> Turn:
    """The rendering settings of a request without its prompt (to address a stored conversation)."""
    return Turn(kind, render_digest(kind, body))


def parse_turn(kind: str, body: Mapping[str, Any]) -> Turn | None:
    """Validate the fields the router relies on; return None when the request cannot be reused.

    Raises RequestError for a malformed request (the engines would refuse it anyway, but a clear
    400 from the router is cheaper and never reaches an engine).
    """
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("'messages' must be a non-empty list of chat messages")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
                raise RequestError(f"messages[{i}] must be an object with a string 'role'")
        render = render_digest("chat", body)
        if (body.get("n") or 1) != 1 or any(has_remote_media(m) for m in messages):
            return None
        return Turn("chat", render, messages=tuple(messages))
    prompt = body.get("prompt")
    if prompt is None or (isinstance(prompt, (str, list)) and len(prompt) == 0):
        raise RequestError("'prompt' is required")
    if not isinstance(prompt, (str, list)):
        raise RequestError("'prompt' must be a string or a list")
    render = render_digest("completion", body)
    if not isinstance(prompt, str) or (body.get("n") or 1) != 1 or body.get("echo"):
        return None
    return Turn("completion", render, prompt=prompt)


def conversation_key(secret: bytes, tenant: str, conversation_id: str, turn: Turn) -> str:
    """HMAC(tenant, rendering settings, conversation id): unforgeable and tenant-isolated."""
    msg = _digest(tenant.encode(), turn.kind.encode(), turn.render_digest.encode(), conversation_id.encode())
    return hmac.new(secret, msg.encode(), hashlib.sha256).hexdigest()


def replayable(params: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Allowlisted copy of decode's returned params, or None when they cannot be replayed."""
    if not isinstance(params, Mapping) or not params.get("do_remote_decode"):
        return None
    if any(params.get(k) in (None, "", []) for k in REQUIRED_REPLAY_KEYS):
        return None
    return {k: params[k] for k in REPLAY_KEYS if k in params}


def reply_message(choice: Mapping[str, Any]) -> dict[str, Any]:
    """The assistant message a client sends back next turn, from a non-streaming choice."""
    message = choice.get("message") or {}
    return canonical_message({"role": message.get("role") or "assistant", **message})


def normalize_host(host: str) -> str:
    host = host.strip().strip("[]").lower()
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def reuse_outcome(entry_params: Mapping[str, Any] | None, history: History | None, expires_at: float, turn: Turn,
                  now: float, known_hosts: set[str]) -> str:
    """Whether a taken entry may be replayed for ``turn``: "hit", or why not ("expired", "mismatch",
    "refused": the stored params name an address that is no engine of this router)."""
    if entry_params is None or history is None:
        return "miss"
    if expires_at <= now:
        return "expired"
    if not turn.continues(history):
        return "mismatch"
    if normalize_host(str(entry_params.get("remote_host") or "")) not in known_hosts:
        return "refused"
    if any(entry_params.get(k) in (None, "", []) for k in REQUIRED_REPLAY_KEYS):
        return "refused"
    return "hit"


def entry_expiry(now: float, lifetime: float, params: Mapping[str, Any], margin: float) -> float:
    """When a stored entry stops being replayable: the earlier of the router's own ``now + lifetime`` and
    decode's wall-clock expiry (``turnkv_expires_at``) minus ``margin``.

    Decode's clock is the authority: ``now`` is when the router stores the entry, which for a slow reader
    of a long stream is long after decode finished and started its TTL. vLLM's own
    ``remote_blocks_expiry_time`` is decode's ``perf_counter`` (no other host can compare it) and is ignored.
    """
    expiry = now + lifetime
    engine_expiry = params.get(wire.EXPIRES_AT)
    if isinstance(engine_expiry, (int, float)) and not isinstance(engine_expiry, bool):
        expiry = min(expiry, float(engine_expiry) - margin)
    return expiry
