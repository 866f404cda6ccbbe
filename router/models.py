"""``GET /v1/models``: the served model names, from a decode engine's list, redacted and cached.

vLLM's list carries more than names: ``root`` is the model's local path on the engine (``/opt/turnkv/models/...``),
``parent`` a LoRA's base, ``permission`` engine ids. Clients get the served names (and each model's context
length); the list is read from a decode engine at most once per ``CACHE_SECONDS`` whoever asks (one read in
flight at a time), so the route costs the engines nothing per call. The caller charges the request to its tenant's
budgets (router.app).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

#: How long one read of the engines' list answers (s); a failed read leaves the last good list in use, and the
#: next read waits ``RETRY_SECONDS`` (a down fleet is not asked once per call).
CACHE_SECONDS = 30.0
RETRY_SECONDS = 2.0
#: The fields a client sees of each model.
KEPT_FIELDS = ("id", "object", "created", "owned_by", "max_model_len")


def redact(answer: Any) -> dict[str, Any] | None:
    """The OpenAI list shape with each model's served name and harmless facts only (pure); None when ``answer``
    is not a model list."""
    data = answer.get("data") if isinstance(answer, Mapping) else None
    if not isinstance(data, list):
        return None
    models = []
    for card in data:
        if isinstance(card, Mapping) and isinstance(card.get("id"), str):
            kept = {k: card[k] for k in KEPT_FIELDS if k in card and isinstance(card[k], (str, int))}
            kept["object"] = "model"
            models.append(kept)
    return {"object": "list", "data": models}


class ModelList:
    """The redacted list, re-read when older than ``ttl``: concurrent callers share one read."""

    def __init__(self, ttl: float = CACHE_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl, self._clock = ttl, clock
        self._list: dict[str, Any] | None = None
        self._until = 0.0
        self._reading: asyncio.Future[dict[str, Any] | None] | None = None

    async def get(self, read: Callable[[], Awaitable[Any]]) -> dict[str, Any] | None:
        """The list (``read()``: one engine's raw answer, raising on failure); None when no read ever succeeded."""
        if self._clock() < self._until:
            return self._list
        if self._reading is None:
            self._reading = asyncio.ensure_future(self._refresh(read))
        reading = self._reading
        return await asyncio.shield(reading)

    async def _refresh(self, read: Callable[[], Awaitable[Any]]) -> dict[str, Any] | None:
        try:
            fresh = redact(await read())
            if fresh is not None:
                self._list, self._until = fresh, self._clock() + self._ttl
            return self._list
        except Exception:
            self._until = self._clock() + RETRY_SECONDS
            return self._list  # the last good list (or None): the caller answers 503 without one
        finally:
            self._reading = None
