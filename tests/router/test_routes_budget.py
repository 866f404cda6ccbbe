"""Every tenant route under the tenant's budgets (issue 38): ``/v1/models`` from a cached, redacted list; the
lease route and the 501 routes charged like completions; a store failure answered with a fixed message."""

from __future__ import annotations

from collections import Counter

import orjson

from router.app import FLOW, METRICS
from router.auth import ApiKeys, parse_keys
from router.state.memory import MemoryStore
from tests.router.conftest import engines, router_over
from tests.router.test_flow_fake import MSGS, chat

KEYS = ApiKeys(parse_keys('{"tenants": {"acme": "acme-key-123", "globex": "globex-key-456"}}'))
ACME = {"Authorization": "Bearer acme-key-123"}
GLOBEX = {"Authorization": "Bearer globex-key-456"}
VALKEY_ERROR = "Error 111 connecting to turnkv-valkey.x1y2z3.use1.cache.amazonaws.com:6379 (10.0.5.17). Refused."


async def test_models_is_limited_like_any_route_and_served_from_a_redacted_cache():
    """The issue's probe: with tenant_request_rate=1, 300 calls in a row answered 200, each a GET to decode
    returning its body (model paths) unchanged."""
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d, keys=KEYS, tunables={"tenant_request_rate": 1}) as (s, _):
        statuses: Counter = Counter()
        for _ in range(300):
            async with s.get("/v1/models", headers=ACME) as r:
                statuses[r.status] += 1
                if r.status == 200:
                    listed = await r.json()
        print(f"300 x GET /v1/models, tenant_request_rate=1: {dict(statuses)}; decode listed "
              f"{d[0].stats.get('models', 0)} time(s)")
        assert statuses[200] <= 11 and statuses[429] >= 289  # the burst (10), then 1/s
        assert d[0].stats["models"] == 1  # one read of decode's list, cached
        assert listed == {"object": "list", "data": [{"id": "tiny", "object": "model", "created": 1_700_000_000,
                                                      "owned_by": "vllm", "max_model_len": 4096}]}
        async with s.get("/v1/models", headers=GLOBEX) as r:  # another tenant's budget is its own
            assert r.status == 200 and b"/opt/turnkv" not in await r.read()
        async with s.get("/v1/models") as r:
            assert r.status == 401


async def test_the_not_served_routes_and_the_lease_route_are_charged_to_the_tenant():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d, keys=KEYS, tunables={"tenant_request_rate": 1, "tenant_lease_rate": 1000}) as (
            s, app):
        codes = Counter()
        for _ in range(15):
            async with s.get("/v1/responses/resp_1", headers=ACME) as r:
                codes[r.status] += 1
        assert codes[501] <= 11 and codes[429] >= 4
        async with s.get("/v1/responses/resp_1") as r:
            assert r.status == 401
        async with s.post("/v1/conversations/lease", json={"model": "tiny", "messages": MSGS}, headers=ACME) as r:
            assert r.status == 429 and (await r.json())["error"]["limit"] == "tenant_request_rate"
        assert (await chat(s, conversation=None, headers=GLOBEX))["status"] == 200
        assert app[METRICS].registry.get_sample_value("turnkv_router_admission_refused_total",
                                                      {"limit": "tenant_request_rate"}) >= 5


class BrokenStore(MemoryStore):
    """A Valkey store whose server went away: every call raises what redis-py raises, naming the server."""

    does_io = True

    async def get(self, key):
        raise ConnectionError(VALKEY_ERROR)

    async def take(self, key):
        raise ConnectionError(VALKEY_ERROR)

    async def put(self, key, entry):
        raise ConnectionError(VALKEY_ERROR)

    async def swap(self, key, old, new):
        raise ConnectionError(VALKEY_ERROR)

    async def get_blob(self, key):
        raise ConnectionError(VALKEY_ERROR)

    async def put_blob(self, key, raw, expires_at):
        raise ConnectionError(VALKEY_ERROR)


async def test_a_store_error_returns_a_fixed_message_never_the_stores_address():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, app):
        flow = app[FLOW]
        flow.store = BrokenStore(100)
        flow.responses.store = flow.store
        answers = []
        async with s.post("/v1/responses", json={"model": "tiny", "input": "hi", "previous_response_id": "r1"}) as r:
            answers.append((r.status, await r.read()))
        messages = [*MSGS, {"role": "assistant", "content": "w1 w2"}]
        async with s.post("/v1/conversations/lease", json={"model": "tiny", "messages": messages}) as r:
            answers.append((r.status, await r.read()))
        turn = await chat(s, conversation="c")  # a completion never fails for the store: served without reuse
        assert turn["status"] == 200
        for status, raw in answers:
            assert status == 503, (status, raw)
            message = orjson.loads(raw)["error"]["message"]
            assert "unavailable" in message and "6379" not in message and "10.0.5.17" not in message, message
            assert b"amazonaws" not in raw and b"Error 111" not in raw


async def test_the_model_list_is_read_once_per_period_and_a_failed_read_keeps_the_last():
    from router.models import ModelList

    now, reads = [0.0], []

    async def read():
        reads.append(now[0])
        if len(reads) == 2:
            raise ConnectionError("decode down")
        return {"data": [{"id": "m", "root": "/secret/path", "permission": [{"id": "x"}]}]}

    models = ModelList(ttl=30, clock=lambda: now[0])
    first = await models.get(read)
    assert first == {"object": "list", "data": [{"id": "m", "object": "model"}]}
    assert await models.get(read) == first and len(reads) == 1
    now[0] = 31
    assert await models.get(read) == first and len(reads) == 2  # a failed refresh: the last good list
    assert await models.get(read) == first and len(reads) == 2  # and no read again for RETRY_SECONDS
    now[0] = 34
    assert await models.get(read) == first and len(reads) == 3
    assert await ModelList().get(read) == first
    assert await ModelList().get(lambda: _raise()) is None


async def _raise():
    raise ConnectionError("no engine")
