"""What a request must be before the router does any work for it (pure, no I/O): field types, the message count,
and the engine cache keys a client may name rewritten per tenant.

Runs before the conversation store is touched, so a refused request consumes nothing stored:
- sampling and length fields have the types the router (and vLLM) read them as; otherwise 400 naming the field;
- at most ``max_messages`` messages (each is hashed on the event loop); otherwise 413 naming the limit;
- at most ``max_choices`` sequences (n x prompts, ``router.choices``: what the request holds of the decode pool);
  otherwise 400 naming the limit;
- media URLs naming a loopback, private, link-local or reserved address in any form a resolver reads
  (``169.254.169.254``, ``2852039166``, ``0xa9fea9fe``, ``127.1``, ``[::ffff:127.0.0.1]``: ``turnkv.media``) are
  refused (400): the engines would fetch them from inside the VPC; DNS names are resolved next (``router.media``);
- a content part's ``uuid`` (vLLM's media cache key) becomes HMAC(tenant, uuid), and ``cache_salt`` becomes
  HMAC(tenant, client salt): no tenant can name another's cached media or share its prefix cache (timing).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator, Mapping
from typing import Any

from router.choices import Plan
from router.guard import RequestError, keyed_digest
from turnkv.media import MediaURLError, media_host

#: Fields read as integers (``None`` means unset); a bool is not one.
INT_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens", "n", "best_of", "truncate_prompt_tokens", "seed",
              "top_k", "top_logprobs")  # ``logprobs``: a bool in chat, an int in completions (the engine checks)
#: Integer fields where a negative value means something to vLLM (-1: off / no limit; any seed).
SIGNED_INT_FIELDS = ("seed", "top_k", "truncate_prompt_tokens")
#: Fields read as finite numbers.
NUMBER_FIELDS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
BOOL_FIELDS = ("stream", "echo", "add_generation_prompt", "continue_final_message", "add_special_tokens",
               "use_beam_search", "return_token_ids")
STRING_FIELDS = ("model", "cache_salt")


class LimitError(Exception):
    """A request over one of the router's limits: its HTTP status, the limit's name and, for 429, when to retry."""

    def __init__(self, status: int, limit: str, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.limit, self.retry_after = status, limit, retry_after


def check_types(body: Mapping[str, Any]) -> None:
    """RequestError (400) naming the first field whose type the engines or the router cannot read."""
    for name in INT_FIELDS:
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise RequestError(f"'{name}' must be an integer")
        if isinstance(value, int) and name not in SIGNED_INT_FIELDS and value < 0:
            raise RequestError(f"'{name}' must not be negative")
    for name in NUMBER_FIELDS:
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            raise RequestError(f"'{name}' must be a finite number")
    for name in BOOL_FIELDS:
        value = body.get(name)
        if value is not None and not isinstance(value, bool):
            raise RequestError(f"'{name}' must be true or false")
    for name in STRING_FIELDS:
        value = body.get(name)
        if value is not None and not isinstance(value, str):
            raise RequestError(f"'{name}' must be a string")
    options = body.get("stream_options")  # a leg's own field (router.encoded): an object of flags, as vLLM reads it
    if options is not None and (not isinstance(options, dict)
                                or any(v is not None and not isinstance(v, bool) for v in options.values())):
        raise RequestError("'stream_options' must be an object of true/false values")


def check_choices(plan: Plan, max_choices: int) -> None:
    """LimitError (400) when a request asks for more than ``max_choices`` sequences (n x prompts)."""
    if plan.choices > max_choices:
        how = f"'n' is {plan.n}" if plan.prompts == 1 else f"'n' {plan.n} x {plan.prompts} prompts"
        raise LimitError(400, "max_choices", f"this request asks for {plan.choices} choices ({how}); max_choices is "
                                             f"{max_choices}")


def check_messages(body: Mapping[str, Any], max_messages: int) -> None:
    """LimitError (413) when a request carries more than ``max_messages`` messages (chat and Anthropic
    ``messages``, Responses ``input`` items)."""
    for name in ("messages", "input"):
        items = body.get(name)
        if isinstance(items, list) and len(items) > max_messages:
            raise LimitError(413, "max_messages", f"'{name}' has {len(items)} items; max_messages is {max_messages}")


def isolate(body: dict[str, Any], secret: bytes, tenant: str) -> None:
    """Rewrite, in place, the engine cache keys a client names: content-part ``uuid`` and ``cache_salt``."""
    body["cache_salt"] = keyed_digest(secret, b"turnkv-cache-salt-v1", tenant, str(body.get("cache_salt") or ""))
    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, dict) and part.get("uuid") is not None:
                part["uuid"] = keyed_digest(secret, b"turnkv-media-uuid-v1", tenant, str(part["uuid"]))


def check_media_urls(body: Mapping[str, Any], allowed: Collection[str] = ()) -> set[str]:
    """RequestError (400) for a media URL the engines must not fetch by its text alone (``turnkv.media``: an
    internal address in any form, a scheme other than http(s), credentials, a host off the ``allowed`` list);
    the DNS names left to resolve and check (``router.media``) before any engine sees the request."""
    names: set[str] = set()
    for i, name, url in media_urls(body):
        try:
            host, ip = media_host(url, allowed)
        except MediaURLError as exc:
            raise RequestError(f"messages[{i}]: '{name}' is refused: {exc}; media must be on the internet or "
                               "inline (data: URL)") from None
        if ip is None:
            names.add(host)
    return names


#: URL fields of content parts an engine fetches.
MEDIA_URL_FIELDS = ("image_url", "video_url", "audio_url")


def media_urls(body: Mapping[str, Any]) -> Iterator[tuple[int, str, str]]:
    """(message index, field, URL) of every media URL an engine would fetch (typed or untyped parts)."""
    messages = body.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        content = message.get("content") if isinstance(message, Mapping) else None
        for part in content if isinstance(content, list) else ():
            if not isinstance(part, Mapping):
                continue
            for name in MEDIA_URL_FIELDS:
                value = part.get(name)
                url = value.get("url") if isinstance(value, Mapping) else value
                if isinstance(url, str) and url[:5].lower() != "data:":
                    yield i, name, url
