"""Prefill choice that knows the cache: a request's shared prefix goes to the prefill engine likely to hold it
(pure, no I/O; one job, like vllm-router's pluggable policies).

Prefill engines run vLLM prefix caching, which hashes the prompt's token blocks from the start: a block is found
only when every token before it matches. Agent traffic opens every conversation of a tenant with the same long
system prompt and tool schemas. Identical render settings (model, template and its kwargs, tools, the tenant's
``cache_salt``: ``router.guard.CHAT_RENDER_FIELDS``) and identical leading system/developer messages render to
identical leading tokens, so the digest of those (``guard.SharedPrefix``, read off the history digest the router
computes anyway) names what the prefix cache holds, up to the block boundary. Load alone would spread such
conversations over every prefill engine, each computing (and caching) the same prefix.

- ``key``: the tenant-scoped prefix key (one hash of the tenant and the prefix digest), or "" when the request
  has no shared prefix worth routing for (raw prompts, a prefix under ``prefill_affinity_min_bytes``).
- ``home``: rendezvous (highest random weight) hashing of the key over the candidates: every router replica
  agrees without talking, and an engine that joins or leaves moves only the keys it wins or held.
- ``choose``: the home engine unless its load (``policy.load``: requests + prompt tokens / ``tokens_per_request``,
  slow-start aware) exceeds the least loaded candidate's by more than ``prefill_affinity_slack``; then the base
  policy's choice. Slack 0: off.

What it does not know: the engines' actual cache contents (no KV events). It routes by where the key was sent,
which is where vLLM would have cached it unless evicted since (or the engine restarted).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from router.engines.policy import load
from turnkv import params

if TYPE_CHECKING:
    from collections.abc import Mapping

    from router.engines import Engine
    from router.guard import Turn

#: Why a prefill engine was chosen (``turnkv_router_prefill_choices_total{reason}``): affinity: the prefix's home;
#: load: the request had a prefix key but its home was over the slack; no_key: no prefix key (none, too short, or
#: affinity off): the base policy alone.
REASONS = ("affinity", "load", "no_key")


def key(tenant: str, turn: Turn | None, min_bytes: int) -> str:
    """The tenant-scoped prefix key of a request, or "" when it has none worth routing for. Tenants never share a
    key (their engine caches are kept apart by ``cache_salt`` anyway, so a shared key would buy nothing)."""
    prefix = turn.prefix if turn is not None else None
    if prefix is None or prefix.size < max(1, min_bytes):
        return ""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"turnkv-prefill-prefix-v1\0{tenant}\0{prefix.digest}".encode())
    return h.hexdigest()


def home(prefix_key: str, candidates: Sequence[Engine]) -> Engine:
    """The candidate with the highest random weight for ``prefix_key`` (rendezvous hashing by engine name)."""
    best, best_score = candidates[0], b""
    for engine in candidates:
        score = hashlib.blake2b(f"{prefix_key}\0{engine.name}".encode(), digest_size=8).digest()
        if score > best_score:
            best, best_score = engine, score
    return best


def choose(prefix_key: str, candidates: Sequence[Engine], *, now: float, tunables: Mapping[str, float],
           fallback: Callable[[], Engine]) -> tuple[Engine, str]:
    """The prefill engine for a request and why (one of ``REASONS``); ``fallback`` is the base policy's choice."""
    slack = float(params.value(tunables, "prefill_affinity_slack"))
    if not prefix_key or slack <= 0:
        return fallback(), "no_key"
    preferred = home(prefix_key, candidates)
    best = min(load(e, now, tunables) for e in candidates)
    if load(preferred, now, tunables) - best <= slack:
        return preferred, "affinity"
    return fallback(), "load"
