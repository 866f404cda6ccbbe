"""The conversation store authenticates as an RBAC user (ElastiCache user group) with credentials from the
environment, as the router's task receives them (ECS secrets), against a real redis-server with ACLs on."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest

from router.state import Entry
from router.state.valkey import PASSWORD_ENV, USERNAME_ENV, ValkeyStore
from tests.conftest import free_port
from tests.router.test_valkey import H


@pytest.fixture
def acl_server(tmp_path):
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed (make tools)")
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path), "--user", "default", "off",
                             "--user", "turnkv-router", "on", ">router-secret-123", "~*", "+@all"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            out = subprocess.run(["redis-cli", "-p", str(port), "--user", "turnkv-router", "--pass",
                                  "router-secret-123", "--no-auth-warning", "ping"], capture_output=True, text=True)
            if out.stdout.strip() == "PONG":
                break
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"  # TLS (rediss://) on ElastiCache; the credentials are the same
    finally:
        proc.kill()
        proc.wait(5)


async def test_store_needs_and_uses_the_rbac_user(acl_server, monkeypatch):
    monkeypatch.delenv(USERNAME_ENV, raising=False)
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    import redis.exceptions

    anonymous = ValkeyStore(acl_server)
    with pytest.raises(redis.exceptions.AuthenticationError):  # the default user is off: no access without them
        await anonymous.ping()
    await anonymous.close()
    monkeypatch.setenv(USERNAME_ENV, "turnkv-router")
    monkeypatch.setenv(PASSWORD_ENV, "router-secret-123")
    store = ValkeyStore(acl_server)
    try:
        assert await store.ping() is True
        entry = Entry({"remote_engine_id": "d"}, H, time.time() + 30, "decode-0")
        await store.put("k", entry)
        assert await store.take("k") == entry
    finally:
        await store.close()
