"""The Valkey/Redis store against a real redis-server on 127.0.0.1 (started and stopped here)."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest

from router.app import FLOW, METRICS
from router.guard import History
from router.state import Entry
from router.state.valkey import ValkeyStore
from tests.router.conftest import engines, free_port, router_over
from tests.router.test_flow_fake import MSGS, chat, next_turn

pytestmark = pytest.mark.redis

H = History("chat", "r", "d", 3)


class Redis:
    def __init__(self, tmp_path) -> None:
        self.port = free_port()
        self.dir = tmp_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                                      "--save", "", "--appendonly", "no", "--dir", str(self.dir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True,
                              text=True).stdout.strip() == "PONG":
                return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


@pytest.fixture
def redis_server(tmp_path):
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed (make tools)")
    server = Redis(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def test_put_take_single_use_and_ttl(redis_server):
    store = ValkeyStore(redis_server.url)
    try:
        e = Entry({"remote_engine_id": "d"}, H, time.time() + 30, "decode-0")
        await store.put("k", e)
        ttl = await store.client.pttl("turnkv:conv:k")
        assert 28_000 < ttl <= 30_000  # the TTL follows the entry's expiry
        assert await store.take("k") == e
        assert await store.take("k") is None
        await store.put("gone", Entry({}, H, time.time() - 1))  # already expired: not stored
        assert await store.client.exists("turnkv:conv:gone") == 0
        secret = await store.shared_secret()
        other = ValkeyStore(redis_server.url)
        assert await other.shared_secret() == secret and len(secret) == 64
        await other.close()
    finally:
        await store.close()


async def test_kept_responses_live_in_their_own_keys_with_their_ttl(redis_server):
    from router.config import RouterConfig
    from router.lifecycle import make_response_store

    store = ValkeyStore(redis_server.url)
    try:
        kept = make_response_store(RouterConfig(prefill=["http://p:1"], decode=["http://d:1"]), store)
        await kept.put_blob("r1", b'[{"role": "user"}]', time.time() + 60)
        assert await kept.get_blob("r1") == b'[{"role": "user"}]'
        assert 58_000 < await store.client.pttl("turnkv:resp:r1") <= 60_000
        assert await store.get("r1") is None  # not a conversation entry
        await kept.put_blob("old", b"x", time.time() - 1)
        assert await kept.get_blob("old") is None
    finally:
        await store.close()


async def test_swap_is_compare_and_set_across_replicas(redis_server):
    a, b = ValkeyStore(redis_server.url), ValkeyStore(redis_server.url)
    try:
        old = Entry({"x": 1}, H, time.time() + 30)
        newer = Entry({"x": 2}, H, time.time() + 60)
        await a.put("k", old)
        assert await b.get("k") == old and await a.get("k") == old  # get does not take
        await b.put("k", newer)  # a concurrent turn on another replica
        assert await a.swap("k", old, Entry({"x": 3}, H, time.time() + 90)) is False
        assert await a.get("k") == newer
        assert await a.swap("k", newer, None) is True and await b.get("k") is None
    finally:
        await a.close()
        await b.close()


async def test_two_replicas_share_conversations_and_one_take_wins(redis_server):
    import asyncio

    a, b = ValkeyStore(redis_server.url), ValkeyStore(redis_server.url)
    try:
        await a.put("k", Entry({"x": 1}, H, time.time() + 30))
        got = await asyncio.gather(a.take("k"), b.take("k"))
        assert sum(x is not None for x in got) == 1
    finally:
        await a.close()
        await b.close()


async def test_store_outage_costs_reuse_not_answers(redis_server):
    p, d = engines(1, "prefill"), engines(1, "decode")
    store = ValkeyStore(redis_server.url, timeout=0.2)
    async with router_over(p, d, store=store) as (s, app):
        first = await chat(s, conversation="o")
        second = await chat(s, next_turn(MSGS, first["text"]), conversation="o")
        assert second["headers"]["X-TurnKV-Reuse-Outcome"] == "hit"
        redis_server.stop()  # the store dies mid-test
        t0 = time.perf_counter()
        third = await chat(s, next_turn(next_turn(MSGS, first["text"]), second["text"]), conversation="o")
        assert third["status"] == 200 and third["headers"]["X-TurnKV-Reuse-Outcome"] == "store_error"
        assert time.perf_counter() - t0 < 1.0
        reg = app[METRICS].registry
        assert reg.get_sample_value("turnkv_router_store_errors_total", {"op": "take"}) >= 1
        assert reg.get_sample_value("turnkv_router_store_errors_total", {"op": "put"}) >= 1
        redis_server.start()  # back: reuse resumes without a restart
        fourth = await chat(s, conversation="o2")
        fifth = await chat(s, next_turn(MSGS, fourth["text"]), conversation="o2")
        assert fifth["headers"]["X-TurnKV-Reuse-Outcome"] == "hit"
        assert app[FLOW].store is store


async def test_kept_responses_in_valkey_are_bounded_per_tenant(redis_server):
    """Issue 31: kept /v1/responses histories had no size bound in Valkey; each tenant now keeps at most
    tenant_max_response_bytes of them."""
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d, store=ValkeyStore(redis_server.url),
                           tunables={"tenant_max_response_bytes": 4096}) as (s, app):
        async def respond(text, previous=None):
            body = {"model": "tiny", "input": text, "max_output_tokens": 4,
                    **({"previous_response_id": previous} if previous else {})}
            async with s.post("/v1/responses", json=body) as resp:
                return resp.status, await resp.json()

        status, big = await respond("word " * 2000)
        assert status == 200 and (await respond("more", big["id"]))[0] == 400  # over the bound: not kept
        status, small = await respond("short")
        assert (await respond("more", small["id"]))[0] == 200
        keys = [k async for k in app[FLOW].responses.store.client.scan_iter("turnkv:resp:*")]
        assert len(keys) == 2  # the small one and its continuation, never the big one
