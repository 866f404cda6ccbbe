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
from turnkv import lifetime, router_env

KEY_PREFIX = "turnkv:conv:"
#: RBAC credentials (an ElastiCache user group's user): from the environment, never on a command line.
USERNAME_ENV = router_env.STORE_USERNAME
PASSWORD_ENV = router_env.STORE_PASSWORD
SECRET_KEY = "turnkv:key-secret"
#: Compare-and-set of one entry (KEYS[1]; ARGV: expected value, new value or "" to delete, TTL in ms).
SWAP_SCRIPT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] == '' then redis.call('DEL', KEYS[1]) else redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) end
return 1
"""


class ValkeyStore:
    does_io = True

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
        ttl_ms = lifetime.store_ttl_ms(entry.expires_at, self._clock())
        if ttl_ms <= 0:
            return
        await self.client.set(self.prefix + key, entry.to_bytes(), px=ttl_ms)

    async def get(self, key: str) -> Entry | None:
        raw = await self.client.get(self.prefix + key)
        if raw is None:
            return None
        entry = Entry.from_bytes(raw)
        return entry if entry.expires_at > self._clock() else None

    async def swap(self, key: str, old: Entry, new: Entry | None) -> bool:
        ttl_ms = 0 if new is None else lifetime.store_ttl_ms(new.expires_at, self._clock())
        if new is not None and ttl_ms <= 0:
            new = None
        done = await self.client.eval(SWAP_SCRIPT, 1, self.prefix + key, old.to_bytes(),
                                      b"" if new is None else new.to_bytes(), max(ttl_ms, 1))
        return bool(done)

    async def take(self, key: str) -> Entry | None:
        raw = await self.client.getdel(self.prefix + key)
        if raw is None:
            return None
        entry = Entry.from_bytes(raw)
        return entry if entry.expires_at > self._clock() else None

    async def put_blob(self, key: str, raw: bytes, expires_at: float) -> None:
        """Opaque bytes until ``expires_at`` (kept responses, ``router.apis.stored``)."""
        ttl_ms = lifetime.store_ttl_ms(expires_at, self._clock())
        if ttl_ms > 0:
            await self.client.set(self.prefix + key, raw, px=ttl_ms)

    async def get_blob(self, key: str) -> bytes | None:
        raw = await self.client.get(self.prefix + key)
        return None if raw is None else bytes(raw)

    async def shared_secret(self) -> bytes:
        """The conversation-key HMAC secret shared by every replica on this store (created once, SET NX)."""
        await self.client.set(SECRET_KEY, secrets.token_hex(32), nx=True)
        value = await self.client.get(SECRET_KEY)
        return value if isinstance(value, bytes) else str(value).encode()

    async def ping(self) -> bool:
        return bool(await self.client.ping())

    async def close(self) -> None:
        await self.client.aclose()
