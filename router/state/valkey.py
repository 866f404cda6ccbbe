"""Conversation store in Valkey/Redis (ElastiCache Serverless in AWS), shared by router replicas.

- ``put`` is ``SET key value PX ttl``, the TTL taken from the entry's expiry, so the store forgets
  an entry before the decode engine frees its blocks;
- ``take`` is ``GETDEL``: atomic and single-use across replicas (two replicas racing for one
  conversation: one gets the entry, the other a miss, never both);
- the client has short socket timeouts and no retries: a store that is down or slow costs the
  request its reuse (the flow's ``store_timeout_ms``), never its answer.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable
from typing import Any

from router.state import Entry

KEY_PREFIX = "turnkv:conv:"
#: RBAC credentials (an ElastiCache user group's user): from the environment, never on a command line.
USERNAME_ENV = "TURNKV_STORE_USERNAME"
PASSWORD_ENV = "TURNKV_STORE_PASSWORD"
SECRET_KEY = "turnkv:key-secret"


class ValkeyStore:
    def __init__(self, url: str, *, timeout: float = 0.5, prefix: str = KEY_PREFIX,
                 clock: Callable[[], float] = time.time, client: Any = None) -> None:
        if client is None:
            import redis.asyncio as redis

            credentials = {key: value for key, value in (("username", os.environ.get(USERNAME_ENV)),
                                                         ("password", os.environ.get(PASSWORD_ENV))) if value}
            client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                          retry_on_timeout=False, retry=None, health_check_interval=30,
                                          max_connections=512, **credentials)
        self.client = client
        self.prefix = prefix
        self._clock = clock

    async def put(self, key: str, entry: Entry) -> None:
        ttl_ms = int((entry.expires_at - self._clock()) * 1000)
        if ttl_ms <= 0:
            return
        await self.client.set(self.prefix + key, entry.to_bytes(), px=ttl_ms)

    async def take(self, key: str) -> Entry | None:
        raw = await self.client.getdel(self.prefix + key)
        if raw is None:
            return None
        entry = Entry.from_bytes(raw)
        return entry if entry.expires_at > self._clock() else None

    async def shared_secret(self) -> bytes:
        """The conversation-key HMAC secret shared by every replica on this store (created once, SET NX)."""
        await self.client.set(SECRET_KEY, secrets.token_hex(32), nx=True)
        value = await self.client.get(SECRET_KEY)
        return value if isinstance(value, bytes) else str(value).encode()

    async def ping(self) -> bool:
        return bool(await self.client.ping())

    async def close(self) -> None:
        await self.client.aclose()
