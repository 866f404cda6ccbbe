"""Session ids that clients already send, read as *hints* (pure, no I/O).

Agents and benchmarks tag their requests with a session id, each in its own place: aiperf's
``X-Correlation-ID``, vLLM's multi-turn benchmark ``X-Session-ID`` / body ``session_id``, OpenHands'
``x-litellm-session-id``, the OpenAI SDK's ``prompt_cache_key``, turnkv's own ``conversation_id``.
The router never keys KV by them (turns are found by their content, ``router.guard``): a hint only
steers a conversation to the same decode engine and labels metrics and logs. A forged or reused hint
can therefore never attach another conversation's KV, and never crosses tenants.

A source is ``header:NAME`` (case-insensitive) or ``body:FIELD``; the first one present wins.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: The default hint sources, in priority order (``--session-hint`` / ``session_hints`` replace them).
DEFAULT_SOURCES: tuple[str, ...] = (
    "body:conversation_id", "header:X-Conversation-Id", "header:X-Session-ID", "header:X-Correlation-ID",
    "body:session_id", "body:prompt_cache_key", "header:x-litellm-session-id",
)
#: Body fields that are turnkv's own and never reach the engines.
OWN_BODY_FIELDS = ("conversation_id",)
MAX_LENGTH = 256


@dataclass(frozen=True)
class Source:
    where: str  # "header" or "body"
    name: str

    @property
    def label(self) -> str:
        """Prometheus label value: the source, never the id (bounded cardinality)."""
        return f"{self.where}:{self.name.lower()}"


def parse_sources(specs: Sequence[str]) -> tuple[Source, ...]:
    """``header:NAME`` / ``body:FIELD`` specs; a ValueError names a bad one."""
    out = []
    for spec in specs:
        where, sep, name = str(spec).partition(":")
        where, name = where.strip().lower(), name.strip()
        if not sep or where not in ("header", "body") or not name:
            raise ValueError(f"session hint {spec!r}: expected header:NAME or body:FIELD")
        out.append(Source(where, name))
    return tuple(out)


@dataclass(frozen=True)
class Hint:
    source: Source
    value: str


def find(sources: Sequence[Source], headers: Mapping[str, str], body: Mapping[str, Any]) -> Hint | None:
    """The first hint present. Body values that are not non-empty strings (or numbers) are ignored, not
    refused: the fields belong to other APIs; an over-long turnkv ``conversation_id`` is refused."""
    for source in sources:
        raw = headers.get(source.name) if source.where == "header" else body.get(source.name)
        own = source.where == "body" and source.name in OWN_BODY_FIELDS
        if raw is None or raw == "":
            continue
        if own and (not isinstance(raw, str) or len(raw) > MAX_LENGTH):
            raise ValueError(f"'{source.name}' must be a non-empty string of at most {MAX_LENGTH} characters")
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            raw = str(raw)
        if not isinstance(raw, str) or len(raw) > MAX_LENGTH:
            continue
        return Hint(source, raw)
    return None


def rendezvous(tenant: str, hint: str, names: Sequence[str]) -> str:
    """The engine a hint maps to (highest random weight): stable while the pool is, and only the
    hints of an engine that leaves move."""
    best, best_score = "", b""
    for name in names:
        score = hashlib.blake2b(f"{tenant}\0{hint}\0{name}".encode(), digest_size=8).digest()
        if score > best_score:
            best, best_score = name, score
    return best
