"""Pure reuse-safety logic: content addresses of turns, history digests and the replayable parameters.

The prefill engine pulls KV by position and never compares tokens, so the router may attach a
stored ``kv_transfer_params`` only when the new request provably extends the exact sequence the
decode engine holds. This module decides that from the request bodies alone; no I/O.

- A chat turn is found by its **content**: the *history digest* chains the canonical messages decode
  saw plus the reply it generated, seeded with every request setting that changes how a prompt is
  rendered (model, tools, template settings, ``cache_salt``). A stored turn is keyed by an HMAC of
  the tenant and that digest; the next request looks up the digest of its messages up to and
  including its last assistant message. No client field is needed; an edited, truncated or
  reordered history (or another model, tool list, template or tenant) is a different address.
  One pass over the messages gives both the lookup digest and, extended by the reply, the store key.
- Raw-prompt completions have no message boundaries to address: there a client's session hint
  (``router.hints``) names the slot and the text digest decides whether the prompt extends it.
- Decode's token proof (``connector.token_proof``) then limits every pull to the tokens proven equal,
  so a template that renders past turns differently costs reuse, never correctness.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from router.outcomes import RequestKind, ReuseOutcome
from turnkv import lifetime as turnkv_lifetime
from turnkv import wire

#: Settings that change how a chat prompt renders (part of the conversation key). ``tool_choice`` is not one:
#: the engines render the same prompt for every choice (a forced call is a structured-output constraint on
#: decoding), and agents commonly force a call on one turn and not the next; with vLLM's
#: ``--exclude-tools-when-tool-choice-none`` the tools leave the prompt and decode's token proof cuts the pull.
CHAT_RENDER_FIELDS = (
    "model", "tools", "chat_template", "chat_template_kwargs", "add_generation_prompt",
    "continue_final_message", "documents", "cache_salt", "mm_processor_kwargs", "reasoning_effort",
    "add_special_tokens", "truncate_prompt_tokens", "media_io_kwargs", "truncation_side",
)
COMPLETION_RENDER_FIELDS = ("model", "cache_salt", "add_special_tokens", "truncate_prompt_tokens", "truncation_side")

#: Message fields that reach the chat template and address a turn. Everything else (client metadata) is
#: ignored, and so is reasoning (``reasoning_content`` / ``reasoning``): clients commonly drop it when they
#: send a reply back and templates commonly drop it from past turns; decode's token proof then limits the
#: pull to the tokens that really match.
MESSAGE_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id")
#: ``kv_transfer_params`` keys a decode engine returns in bi-directional mode and prefill may be sent:
#: upstream's, then turnkv's (``turnkv.wire``: token proof, boot, wall-clock expiry, model, signature).
REPLAY_KEYS = (*wire.UPSTREAM_OFFER_KEYS, *wire.OFFER_KEYS)
REQUIRED_REPLAY_KEYS = (wire.REMOTE_BLOCK_IDS, wire.REMOTE_ENGINE_ID, wire.REMOTE_HOST, wire.REMOTE_PORT,
                        wire.REMOTE_NUM_TOKENS)

#: What prefill is sent on a turn without reuse (upstream pull protocol, step 1).
FRESH_PREFILL_PARAMS: dict[str, Any] = {
    wire.DO_REMOTE_DECODE: True, wire.DO_REMOTE_PREFILL: False, wire.REMOTE_ENGINE_ID: None,
    wire.REMOTE_BLOCK_IDS: None, wire.REMOTE_HOST: None, wire.REMOTE_PORT: None,
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


def _arguments(arguments: Any) -> Any:
    """Tool-call arguments as the template sees them: vLLM parses a JSON string into an object before
    rendering, so two spellings of one object (spacing, escapes: an engine's ``'{"a": 1}'`` and an Anthropic
    client's ``input`` serialised again) are one address; key order is kept (templates render it)."""
    if isinstance(arguments, Mapping):
        return orjson.dumps(arguments).decode()
    if not arguments:
        return ""
    if isinstance(arguments, str) and arguments.lstrip().startswith("{"):
        try:
            value = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return arguments
        if isinstance(value, dict):
            return orjson.dumps(value).decode()
    return arguments


def _tool_call(call: Any) -> Any:
    """The part of a tool call a template renders (OpenAI shape); streaming's ``index`` and extras dropped."""
    if not isinstance(call, Mapping):
        return call
    fn = call.get("function")
    out: dict[str, Any] = {"type": call.get("type") or "function"}
    if call.get("id"):
        out["id"] = call["id"]
    if isinstance(fn, Mapping):
        out["function"] = {"name": fn.get("name") or "", "arguments": _arguments(fn.get("arguments"))}
    return out


def canonical_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a chat message the template sees; text content parts are flattened as vLLM joins them
    (with ``"\\n"``: ``["a", "b"]`` and ``"ab"`` render differently, so they are different addresses)."""
    out: dict[str, Any] = {}
    for name in MESSAGE_FIELDS:
        value = message.get(name)
        if value is None or value == [] or (name != "content" and value == ""):
            continue
        if name == "content" and isinstance(value, list) and all(
            isinstance(p, Mapping) and p.get("type") == "text" for p in value
        ):
            value = "\n".join(str(p.get("text", "")) for p in value)
        elif name == "tool_calls" and isinstance(value, list):
            value = [_tool_call(c) for c in value]
        out[name] = value
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
        if not isinstance(part, Mapping):
            continue
        kind = part.get("type")
        if kind == "text" or (kind is None and set(part) <= {"text"}):
            continue
        if kind is None:  # vLLM infers an untyped part's kind from its keys and fetches its URL: not digested
            return True
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


def _running(kind: RequestKind, render: str) -> Any:
    """A running digest of a history: seeded with the render settings, then fed message by message."""
    h = hashlib.blake2b(digest_size=20)
    h.update(f"turnkv-history-v2\0{kind}\0{render}\0".encode())
    return h


def _feed(h: Any, message: Mapping[str, Any]) -> int:
    """Feed one message to a running digest; its canonical size in bytes."""
    part = _canonical(canonical_message(message))
    h.update(len(part).to_bytes(8, "little"))
    h.update(part)
    return len(part)


def history_digest(messages: Sequence[Mapping[str, Any]], render: str = "") -> str:
    """Digest of ``messages`` (what ``chat_turn`` computes in its one pass)."""
    h = _running(RequestKind.CHAT, render)
    for m in messages:
        _feed(h, m)
    return h.hexdigest()


def text_digest(text: str) -> str:
    return _digest(text.encode())


@dataclass(frozen=True)
class History:
    """A sequence decode holds (or a request's prefix): its digest and length (messages or characters). Read back
    from the store (``router.state.Entry``), ``kind`` is the plain string, equal to its member."""

    kind: RequestKind
    render_digest: str
    digest: str
    length: int


#: Roles of the messages that open a conversation with the same text for every conversation of an agent (its system
#: prompt): the shared prefix a prefill engine's prefix cache holds (``router.engines.prefix``).
LEADING_ROLES = ("system", "developer")


@dataclass(frozen=True)
class SharedPrefix:
    """The part of a chat prompt that conversations share: the render settings and the leading system/developer
    messages. Equal digests mean equal leading tokens once rendered (same template, tools and text)."""

    digest: str  # the history digest (seeded with the render settings) after the leading messages
    size: int  # bytes: the tools' JSON + the leading messages' canonical JSON
    messages: int  # how many leading messages


@dataclass(frozen=True)
class Turn:
    """What the router needs to know about one request to decide and record reuse."""

    kind: RequestKind
    render_digest: str  # settings that change rendering
    messages: tuple[Mapping[str, Any], ...] = ()
    prompt: str | None = None
    #: Chat: the prefix up to and including the last assistant message (None: nothing to look up).
    lookup: History | None = None
    #: Chat: the running digest after all the messages (a hashlib object: extended by the reply, never mutated).
    chain: Any = field(default=None, compare=False, repr=False)
    #: Chat: the shared prefix (prefill affinity, ``router.engines.prefix``); None for raw prompts.
    prefix: SharedPrefix | None = field(default=None, compare=False)

    def continues(self, history: History) -> bool:
        """True when this request's prompt extends ``history`` exactly."""
        if history.kind != self.kind or history.render_digest != self.render_digest:
            return False
        if self.kind == RequestKind.CHAT:
            # the digest covers every message up to the reply: equal digests, equal histories (the token
            # proof still checks every pulled token)
            return self.lookup is not None and self.lookup == history
        assert self.prompt is not None
        return len(self.prompt) > history.length and text_digest(self.prompt[: history.length]) == history.digest

    def extended_by(self, reply: Mapping[str, Any] | str) -> History:
        """The history the decode engine holds after answering this request with ``reply``."""
        if self.kind == RequestKind.CHAT:
            assert isinstance(reply, Mapping)
            h = self.chain.copy()
            _feed(h, reply)
            return History(self.kind, self.render_digest, h.hexdigest(), len(self.messages) + 1)
        assert self.prompt is not None and isinstance(reply, str)
        text = self.prompt + reply
        return History(self.kind, self.render_digest, text_digest(text), len(text))


def chat_turn(render: str, messages: Sequence[Mapping[str, Any]], render_size: int = 0) -> Turn:
    """One pass over the messages: the lookup prefix (up to the last assistant message), the full chain, and the
    shared prefix (the chain after the leading system/developer messages: one digest read, no extra pass);
    ``render_size``: bytes of the render settings that become prompt tokens (the tools)."""
    h = _running(RequestKind.CHAT, render)
    lookup = prefix = None
    size = render_size
    for i, m in enumerate(messages):
        if prefix is None and m.get("role") not in LEADING_ROLES:
            prefix = SharedPrefix(h.hexdigest(), size, i)
        fed = _feed(h, m)
        if prefix is None:
            size += fed
        if m.get("role") == "assistant":
            lookup = History(RequestKind.CHAT, render, h.hexdigest(), i + 1)
    if prefix is None:  # only leading messages
        prefix = SharedPrefix(h.hexdigest(), size, len(messages))
    return Turn(RequestKind.CHAT, render, messages=tuple(messages), lookup=lookup, chain=h, prefix=prefix)


_TOOLS_AT = CHAT_RENDER_FIELDS.index("tools")


def _render_parts(kind: RequestKind, body: Mapping[str, Any]) -> list[bytes]:
    fields = CHAT_RENDER_FIELDS if kind == RequestKind.CHAT else COMPLETION_RENDER_FIELDS
    return [_canonical(body.get(f)) for f in fields]


def render_digest(kind: RequestKind, body: Mapping[str, Any]) -> str:
    """Digest of the settings that change how a prompt renders (model, tools, template, cache_salt, ...)."""
    return _digest(*_render_parts(kind, body))


def render_only(kind: RequestKind, body: Mapping[str, Any]) -> Turn:
    """The rendering settings of a request without its prompt (to address a stored conversation)."""
    return Turn(kind, render_digest(kind, body))


def parse_turn(kind: RequestKind, body: Mapping[str, Any]) -> Turn | None:
    """Validate the fields the router relies on; return None when the request cannot be reused.

    Raises RequestError for a malformed request (the engines would refuse it anyway, but a clear
    400 from the router is cheaper and never reaches an engine).
    """
    if kind == RequestKind.CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("'messages' must be a non-empty list of chat messages")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
                raise RequestError(f"messages[{i}] must be an object with a string 'role'")
        parts = _render_parts(RequestKind.CHAT, body)
        render = _digest(*parts)
        if (body.get("n") or 1) != 1 or any(has_remote_media(m) for m in messages):
            return None
        return chat_turn(render, messages, len(parts[_TOOLS_AT]) if body.get("tools") else 0)
    prompt = body.get("prompt")
    if prompt is None or (isinstance(prompt, (str, list)) and len(prompt) == 0):
        raise RequestError("'prompt' is required")
    if not isinstance(prompt, (str, list)):
        raise RequestError("'prompt' must be a string or a list")
    render = render_digest(RequestKind.COMPLETION, body)
    if not isinstance(prompt, str) or (body.get("n") or 1) != 1 or body.get("echo"):
        return None
    return Turn(RequestKind.COMPLETION, render, prompt=prompt)


def content_key(secret: bytes, tenant: str, history: History) -> str:
    """HMAC(tenant, rendering settings, history digest and length): where a chat turn is stored and found.
    Unforgeable and tenant-isolated: a client can only reach it by sending the very same history."""
    return keyed_digest(secret, b"turnkv-content-v1", tenant, history.kind, history.render_digest, history.digest,
                        str(history.length))


def keyed_digest(secret: bytes, label: bytes, *parts: str) -> str:
    """HMAC-SHA256 under ``label`` over length-prefixed parts (no two part lists collide): store keys a client can
    only reach by sending the very same parts, never another tenant's."""
    mac = hmac.new(secret, label, hashlib.sha256)
    for text in parts:
        part = text.encode()
        mac.update(len(part).to_bytes(4, "little"))
        mac.update(part)
    return mac.hexdigest()


def hint_key(secret: bytes, tenant: str, hint: str, turn: Turn) -> str:
    """HMAC(tenant, rendering settings, session hint): the one slot of a raw-prompt completion session
    (the text digest, not the hint, decides whether its KV is replayed)."""
    msg = _digest(tenant.encode(), turn.kind.encode(), turn.render_digest.encode(), hint.encode())
    return hmac.new(secret, msg.encode(), hashlib.sha256).hexdigest()


def replayable(params: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Allowlisted copy of decode's returned params, or None when they cannot be replayed."""
    if not isinstance(params, Mapping) or not wire.KVParams(params).do_remote_decode:
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
                  now: float, known_hosts: set[str]) -> ReuseOutcome:
    """Whether a taken entry may be replayed for ``turn``: HIT, or why not (MISS, EXPIRED, MISMATCH,
    REFUSED: the stored params name an address that is no engine of this router)."""
    if entry_params is None or history is None:
        return ReuseOutcome.MISS
    if expires_at <= now:
        return ReuseOutcome.EXPIRED
    if not turn.continues(history):
        return ReuseOutcome.MISMATCH
    if normalize_host(str(wire.KVParams(entry_params).host or "")) not in known_hosts:
        return ReuseOutcome.REFUSED
    if any(entry_params.get(k) in (None, "", []) for k in REQUIRED_REPLAY_KEYS):
        return ReuseOutcome.REFUSED
    return ReuseOutcome.HIT


def entry_expiry(now: float, lifetime: float, params: Mapping[str, Any], margin: float) -> float:
    """When a stored entry stops being replayable: the earlier of the router's own ``now + lifetime`` and
    decode's wall-clock expiry (``turnkv_expires_at``) minus ``margin``.

    Decode's clock is the authority: ``now`` is when the router stores the entry, which for a slow reader
    of a long stream is long after decode finished and started its TTL. vLLM's own
    ``remote_blocks_expiry_time`` is decode's ``perf_counter`` (no other host can compare it) and is ignored.
    """
    return turnkv_lifetime.entry_expiry(now, lifetime, wire.KVParams(params).expires_at, margin)
