"""What the router does between its app starting and stopping: each step named, stopped in reverse.

``router.app.build_app`` assembles the pieces that need no event loop (pool, store, keys, limits, routes);
this module owns the ones that do. ``RouterRuntime.open`` settles the conversation-key secret and builds
the flow (its HTTP client, EMF writer and kept responses); ``start_background`` fills the pool once and
starts the loops that keep it and the tunables current; ``stop`` cancels the loops and closes what
``open`` opened. Like vllm-router's guards, whatever a step acquires is kept on the runtime so that
``stop`` releases exactly that, and the order of the steps is the order the app ran them in before they
had names.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from router import telemetry
from router.apis import stored
from router.config import RouterConfig
from router.engines import ROLES, EnginePool
from router.engines.evictions import evictions_loop
from router.engines.health import discovery_loop, health_loop
from router.flow import Flow
from router.state import ConversationStore
from router.state.memory import MemoryStore
from router.telemetry import Metrics

log = logging.getLogger("turnkv.router")

#: Reads the engines of each role (Cloud Map, or a test's stand-in): {role: [url, ...]}.
Discover = Callable[[], Awaitable[dict[str, Any]]]


def make_response_store(config: RouterConfig, store: ConversationStore) -> stored.BlobStore:
    """Kept /v1/responses answers: apart from conversation metadata, so long histories never push it out."""
    from router.state.valkey import ValkeyStore

    if isinstance(store, ValkeyStore):  # the same Valkey (and client), its own keys
        return ValkeyStore("", prefix=stored.VALKEY_PREFIX, client=store.client)
    return MemoryStore(int(config.max_conversations), max_bytes=int(config.responses_max_bytes))


class RouterRuntime:
    """The started router's resources: its HTTP client, EMF writer, kept responses, flow and background tasks."""

    def __init__(self, config: RouterConfig, pool: EnginePool, store: ConversationStore, metrics: Metrics, *,
                 forward_auth: bool, discover: Discover | None, ssm_source: Any) -> None:
        self.config, self.pool, self.store, self.metrics = config, pool, store, metrics
        self.forward_auth = forward_auth
        self.discover, self.ssm_source = discover, ssm_source
        self.tasks: list[asyncio.Task] = []
        self.session: aiohttp.ClientSession | None = None
        self.emf: telemetry.EmfWriter | None = None
        self.kept_store: stored.BlobStore | None = None
        self.flow: Flow | None = None

    # -- start ---------------------------------------------------------------------------------

    async def open(self) -> Flow:
        """The conversation-key secret, then the flow with its client, EMF writer and kept responses."""
        await self.share_key_secret()
        self.open_client()
        self.flow = self.build_flow()
        return self.flow

    async def start_background(self) -> None:
        """The first discovery and its loop, the health loop (with the stores' purge), the evictions loop, and the
        first SSM read of the tunables and its loop, in that order."""
        await self.start_discovery()
        self.start_health()
        self.start_evictions()
        await self.start_tunables_refresh()

    async def share_key_secret(self) -> None:
        """Replicas on one Valkey share one conversation-key secret; without one, a random secret."""
        config, store = self.config, self.store
        if not config.key_secret and hasattr(store, "shared_secret"):
            try:
                config.key_secret = await asyncio.wait_for(store.shared_secret(), 5)
            except Exception as exc:
                log.warning("could not read the shared key secret from the store (%s): using a random one; "
                            "set TURNKV_KEY_SECRET on every replica", exc)
        config.ensure_secret()

    def open_client(self) -> None:
        """The engines' HTTP client (no connection limit, no cookies, bodies passed as they come) and EMF writer."""
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                             cookie_jar=aiohttp.DummyCookieJar())
        self.emf = telemetry.EmfWriter()

    def build_flow(self) -> Flow:
        """The kept /v1/responses answers and the flow that serves requests over the client."""
        config = self.config
        assert self.session is not None and self.emf is not None
        self.kept_store = make_response_store(config, self.store)
        kept = stored.ResponseLog(self.kept_store, config.ensure_secret,
                                  lambda: float(config.responses_ttl), lambda: config.store_timeout_ms / 1000 * 2,
                                  tenant_bytes=lambda: int(config.tenant_max_response_bytes))
        return Flow(config, self.pool, self.store, self.metrics, self.session, forward_auth=self.forward_auth,
                    emf=self.emf, responses=kept)

    async def start_discovery(self) -> None:
        """Fill the pool from discovery once (a failure is retried by the loop), then keep it current."""
        if self.discover is None:
            return
        config, pool, emf = self.config, self.pool, self.emf
        assert emf is not None
        try:
            found = await self.discover()
            for role, engines in found.items():
                if engines:
                    pool.replace(role, engines)
        except Exception as exc:
            log.warning("first discovery failed (%s); retrying in the background", exc)

        def registered(found: dict) -> None:
            for record in telemetry.registered_engines_records(
                    namespace=telemetry.NAMESPACE, deployment=config.deployment,
                    counts={role: len(found.get(role) or ()) for role in ROLES}):
                emf.emit(record)

        self.tasks.append(asyncio.create_task(discovery_loop(pool, self.discover,
                                                             lambda: float(config.discovery_interval), registered)))

    def purge_stores(self) -> None:
        """The in-memory stores' expiry purge, with their byte bounds as the SSM re-read left them."""
        config, store, kept_store = self.config, self.store, self.kept_store
        if isinstance(store, MemoryStore):
            store.max_bytes = int(config.max_store_bytes)  # follows the SSM re-read
            store.purge_expired()
        if isinstance(kept_store, MemoryStore):
            kept_store.max_bytes = int(config.responses_max_bytes)
            kept_store.purge_expired()

    def start_health(self) -> None:
        """Engine health probes; each round also runs ``purge_stores``."""
        config = self.config
        assert self.session is not None
        self.tasks.append(asyncio.create_task(health_loop(self.pool, self.session,
                                                          lambda: float(config.health_interval), self.purge_stores)))

    def start_evictions(self) -> None:
        """The decode engines' eviction reports (router.engines.evictions)."""
        config, pool = self.config, self.pool
        assert self.session is not None
        self.tasks.append(asyncio.create_task(evictions_loop(lambda: pool.decode, self.session,
                                                             lambda: float(config.evictions_interval), time.time)))

    async def start_tunables_refresh(self) -> None:
        """Serve with the tunables in SSM from the first request, not the defaults (a failed read is logged and
        counted; the loop retries), then re-read them in the background."""
        if self.ssm_source is None:
            return
        from router.reload import refresh_loop, refresh_once

        metrics = self.metrics

        def on_result(result: str) -> None:
            metrics.params_reloads.labels(result).inc()

        await refresh_once(self.config, self.ssm_source, on_result)
        self.tasks.append(asyncio.create_task(refresh_loop(self.config, self.ssm_source, on_result)))

    # -- stop ----------------------------------------------------------------------------------

    async def stop(self) -> None:
        """Cancel the background tasks, then flush EMF and close the client, the legs client and the store."""
        await self.cancel_tasks()
        assert self.emf is not None and self.session is not None and self.flow is not None
        self.emf.flush()
        await self.session.close()
        self.flow.legs_client.close()
        await self.store.close()

    async def cancel_tasks(self) -> None:
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
