"""The router in-process over fake engines (bench.fake_engine) on loopback: no vLLM, seconds per test."""

from __future__ import annotations

import ipaddress
import re
import socket
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web

from bench.fake_engine import FAKE_SECRET, FakeEngine, start
from router.app import FLOW, build_app
from router.config import RouterConfig
from router.media import MediaChecker
from tests.conftest import free_port

#: Names the fake DNS answers (no test reaches a real resolver); ``*.nip.io`` answers as nip.io does.
FAKE_DNS = {"example.com": ["93.184.215.14", "2606:2800:21f:cb07:6820:80da:af6b:8b2c"],
            "images.example.com": ["93.184.215.15"], "cdn.example.net": ["151.101.1.1"],
            "mixed.example.com": ["93.184.215.16", "10.0.3.7"], "aaaa-internal.example.com": ["fd00:ec2::254"]}
_NIP = re.compile(r"(?:.*?[.-])?((?:\d{1,3}[.-]){3}\d{1,3})\.nip\.io\.?")


async def fake_dns(host: str) -> list[str]:
    """A resolver that behaves like DNS for the names above and nip.io's (``169.254.169.254.nip.io``,
    ``app-10-0-0-1.nip.io``): every other name does not resolve (``socket.gaierror``, as getaddrinfo raises)."""
    host = host.lower().rstrip(".")
    if host in FAKE_DNS:
        return list(FAKE_DNS[host])
    m = _NIP.fullmatch(host)
    if m:
        return [str(ipaddress.IPv4Address(m.group(1).replace("-", ".")))]
    raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")


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
    app[FLOW].media = MediaChecker(fake_dns)  # media hosts: the fake DNS, never the network
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
