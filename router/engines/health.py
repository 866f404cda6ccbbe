"""Active health checks and discovery refresh (the I/O around the pure pool)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import aiohttp

from router.engines import ROLES, Engine, EnginePool

log = logging.getLogger("turnkv.router")


async def probe(session: aiohttp.ClientSession, engine: Engine, timeout: float) -> bool:
    try:
        async with session.get(engine.url + "/health", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            return resp.status == 200
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False


async def probe_all(pool: EnginePool, session: aiohttp.ClientSession, timeout: float) -> None:
    engines = pool.all
    results = await asyncio.gather(*(probe(session, e, timeout) for e in engines))
    for engine, ok in zip(engines, results, strict=True):
        if ok:
            pool.report_success(engine, probe=True)
        else:
            pool.report_failure(engine)


async def health_loop(pool: EnginePool, session: aiohttp.ClientSession, interval: Callable[[], float],
                      after: Callable[[], Awaitable[None] | None] = lambda: None) -> None:
    while True:
        try:
            await probe_all(pool, session, max(1.0, interval()))
            result = after()
            if result is not None:
                await result
        except Exception:  # never let the loop die
            log.exception("health loop")
        await asyncio.sleep(interval())


async def discovery_loop(pool: EnginePool, discover: Callable[[], Awaitable[dict[str, list[Engine]]]],
                         interval: Callable[[], float],
                         observe: Callable[[dict[str, list[Engine]]], None] = lambda found: None) -> None:
    """``observe`` sees every answer as is (empty roles included): what Cloud Map holds, not what is kept."""
    while True:
        try:
            found = await discover()
            observe(found)
            for role in ROLES:
                before = {e.url for e in pool.by_role(role)}
                if not found.get(role):
                    # An empty answer is far more often a Cloud Map hiccup or a deploy in progress than every
                    # engine gone at once: keep serving with the last known engines (probes still eject them).
                    if before:
                        log.warning("discovery: no %s engines in the answer; keeping the %d known", role, len(before))
                    continue
                pool.replace(role, found[role])
                after = {e.url for e in pool.by_role(role)}
                if before != after:
                    log.info("discovery: %s engines now %s", role, sorted(after))
        except Exception as exc:  # keep the last known membership
            log.warning("discovery failed (%s); keeping the %d known engines", exc, len(pool.all))
        await asyncio.sleep(interval())
