"""Kept responses: what ``previous_response_id`` continues (I/O around a blob store).

A ``/v1/responses`` answer with ``store`` true (the API's default) is kept as the chat messages it continues
plus the assistant message decode generated, under HMAC(tenant, response id), for ``responses_ttl``. A later
request naming it as ``previous_response_id`` gets those messages in front of its own input, so it renders the
same prompt as a client that resent the whole conversation, and finds the previous turn's KV by content
(``router.guard``): the id is a way to say the history, never a key to KV. Another tenant's id is not found.

As the OpenAI API does, the previous response's ``instructions`` are not carried over: a request sends its own.
Kept histories live in a store of their own (``responses_max_bytes`` in memory; ``turnkv:resp:`` keys in
Valkey), so they never push conversation metadata out; each tenant keeps at most ``tenant_max_response_bytes``
of them (counted per router process until they expire), so no tenant fills the store or Valkey.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import orjson

from router.guard import RequestError, keyed_digest
from router.limits import ExpiringBytes

log = logging.getLogger("turnkv.router")
VALKEY_PREFIX = "turnkv:resp:"


class BlobStore(Protocol):
    async def put_blob(self, key: str, raw: bytes, expires_at: float) -> None: ...

    async def get_blob(self, key: str) -> bytes | None: ...


class StoreUnavailable(RuntimeError):
    """The kept responses could not be read: the request cannot be served (503), its history is unknown."""


class ResponseLog:
    def __init__(self, store: BlobStore, secret: Callable[[], bytes], ttl: Callable[[], float],
                 timeout: Callable[[], float], clock: Callable[[], float] = time.time,
                 tenant_bytes: Callable[[], int] = lambda: 1 << 62) -> None:
        self.store, self._secret, self._ttl, self._timeout, self._clock = store, secret, ttl, timeout, clock
        #: Bytes each tenant keeps (``tenant_max_response_bytes``): memory and Valkey alike, per router process.
        self._tenant_bytes = tenant_bytes
        self.held = ExpiringBytes(clock)

    def _key(self, tenant: str, response_id: str) -> str:
        return keyed_digest(self._secret(), b"turnkv-response-v1", tenant, response_id)

    async def load(self, tenant: str, response_id: Any) -> list[dict[str, Any]]:
        """The messages ``response_id`` continues, its reply included; a 400 naming the id when it is unknown."""
        if not isinstance(response_id, str) or not response_id or len(response_id) > 256:
            raise RequestError("'previous_response_id' must be a response id (a non-empty string)")
        try:
            raw = await asyncio.wait_for(self.store.get_blob(self._key(tenant, response_id)), self._timeout())
        except Exception as exc:
            # the detail names the store (a Valkey address, its error): logged here, never sent to the client
            log.warning("kept responses unavailable: %r", exc)
            raise StoreUnavailable("the kept responses are unavailable; retry shortly") from exc
        if raw is None:
            raise RequestError(f"previous response with id {response_id!r} not found (responses are kept "
                               f"{int(self._ttl())} s when sent with store: true; or send the whole conversation "
                               "as 'input')")
        return orjson.loads(raw)

    async def save(self, tenant: str, response_id: str, messages: list[dict[str, Any]]) -> bool:
        """Keep ``messages`` under ``response_id``; False (logged) when the store failed: the answer stands."""
        ttl = float(self._ttl())
        if ttl <= 0 or not response_id:
            return False
        raw = orjson.dumps(messages)
        if not self.held.try_hold(tenant, len(raw), self._clock() + ttl, int(self._tenant_bytes())):
            log.info("response %s not kept: over tenant_max_response_bytes", response_id)
            return False
        try:
            await asyncio.wait_for(self.store.put_blob(self._key(tenant, response_id), raw,
                                                       self._clock() + ttl), self._timeout())
            return True
        except Exception as exc:
            log.warning("could not keep response %s (%s)", response_id, exc or type(exc).__name__)
            return False
