"""The router in-process over fake engines (bench.fake_engine) on loopback: no vLLM, seconds per test."""

from __future__ import annotations

from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web

from bench.fake_engine import FAKE_SECRET, FakeEngine, start
from router.app import build_app
from router.config import RouterConfig
from tests.conftest import free_port


@asynccontextmanager
async def router_over(prefill: list[FakeEngine], decode: list[FakeEngine], *, identity: bool = False, store=None,
                      keys=None, **overrides):
    runners = await start(prefill + decode)
    tunables = {"health_interval": 60, "conversation_ttl": 45, "decoder_kv_blocks_ttl": 60,
                **overrides.pop("tunables", {})}

    def url(e: FakeEngine) -> str:
        base = f"http://127.0.0.1:{e.port}"
        return base + (f"?engine_id={e.engine_id}&side_channel_port={e.side_channel_port}" if identity else "")

    config = RouterConfig(prefill=[url(e) for e in prefill], decode=[url(e) for e in decode], tunables=tunables,
                          key_secret=b"test-secret", **{"emf": False, "offer_secret": FAKE_SECRET, **overrides})
    app = build_app(config, store=store, keys=keys)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    session = aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}")
    try:
        yield session, app
    finally:
        await session.close()
        await runner.cleanup()
        for r in runners:
            await r.cleanup()


def engines(n: int, role: str, **kw) -> list[FakeEngine]:
    return [FakeEngine(free_port(), role=role, engine_id=f"{role}-{i}", **kw) for i in range(n)]


@pytest.fixture
def make_engines():
    return engines
