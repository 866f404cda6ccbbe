"""Hostile tenants (issue 31): one API key must not exhaust the router, reach another's engine caches, make the
router eject healthy engines, or get engine internals through a stream. Over fake engines on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import errno

import orjson
import pytest

from router import sse
from router.app import FLOW, METRICS, POOL
from router.auth import ApiKeys, parse_keys
from tests.router.conftest import engines, router_over
from tests.router.test_flow_fake import MSGS, chat, next_turn

KEYS = '{"tenants": {"acme": "acme-key-123", "globex": "globex-key-456"}}'
ACME = {"Authorization": "Bearer acme-key-123"}
GLOBEX = {"Authorization": "Bearer globex-key-456"}


def two_tenants() -> ApiKeys:
    return ApiKeys(parse_keys(KEYS))


def refused(app, limit: str) -> float:
    return app[METRICS].registry.get_sample_value("turnkv_router_admission_refused_total", {"limit": limit}) or 0


async def test_bad_types_are_a_400_naming_the_field_and_consume_nothing_stored():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, _):
        first = await chat(s, conversation="types")
        turn2 = next_turn(MSGS, first["text"])
        for bad in ("abc", [1], {}, "1e400"):
            r = await chat(s, turn2, conversation="types", max_tokens=bad)
            assert r["status"] == 400 and "'max_tokens'" in r["error"]["error"]["message"], bad
        r = await chat(s, turn2, conversation="types", temperature="hot")
        assert r["status"] == 400 and "'temperature'" in r["error"]["error"]["message"]
        good = await chat(s, turn2, conversation="types")
        assert good["headers"]["X-TurnKV-Reuse-Outcome"] == "hit"  # the stored turn was still there


async def test_messages_per_request_are_capped_before_hashing():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d, tunables={"max_messages": 10}) as (s, app):
        r = await chat(s, [{"role": "user", "content": "x"}] * 11, conversation=None)
        assert r["status"] == 413 and r["error"]["error"]["limit"] == "max_messages"
        assert (await chat(s, [{"role": "user", "content": "x"}] * 10, conversation=None))["status"] == 200
        async with s.post("/v1/responses", json={"model": "tiny", "input": [{"role": "user", "content": "x"}] * 11}
                          ) as resp:
            assert resp.status == 413
        assert refused(app, "max_messages") == 2


async def _park_body(port: int, headers: dict[str, str], length: int, sent: bytes = b"{") -> tuple:
    """A request whose body stops short of its Content-Length: the slow (or parked) body of an attacker."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{head}"
                 f"Content-Length: {length}\r\n\r\n".encode() + sent)
    await writer.drain()
    return reader, writer


def _port(s) -> int:
    return s._base_url.port


async def test_a_body_that_does_not_arrive_in_time_is_a_408():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d, tunables={"body_read_timeout": 1}) as (s, app):
        reader, writer = await _park_body(_port(s), {}, 1000)
        status = await asyncio.wait_for(reader.readline(), 5)
        assert status.startswith(b"HTTP/1.1 408")
        writer.close()
        assert refused(app, "body_read_timeout") == 1


async def test_buffered_body_bytes_are_bounded_per_tenant_and_released():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d, keys=two_tenants(), tunables={"tenant_max_body_buffer_bytes": 100_000}) as (s, _):
        _, writer = await _park_body(_port(s), ACME, 99_000)
        await asyncio.sleep(0.2)
        r = await chat(s, conversation=None, headers=ACME)
        assert r["status"] == 429 and r["error"]["error"]["limit"] == "tenant_max_body_buffer_bytes"
        assert r["headers"]["Retry-After"] == "1"
        assert (await chat(s, conversation=None, headers=GLOBEX))["status"] == 200  # the other tenant is served
        writer.close()
        await asyncio.sleep(0.3)
        assert (await chat(s, conversation=None, headers=ACME))["status"] == 200  # its budget came back


async def test_request_rate_is_limited_per_tenant():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d, keys=two_tenants(), tunables={"tenant_request_rate": 0.1}) as (s, _):
        statuses = [(await chat(s, conversation=None, headers=ACME)) for _ in range(12)]
        last = statuses[-1]
        assert last["status"] == 429 and last["error"]["error"]["limit"] == "tenant_request_rate"
        assert last["headers"]["Retry-After"] == "10"
        assert (await chat(s, conversation=None, headers=GLOBEX))["status"] == 200


async def test_an_untyped_image_part_is_remote_media_never_reused():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, _):
        msgs = [{"role": "user", "content": [{"type": "text", "text": "what is this? " * 50},
                                             {"image_url": {"url": "https://example.com/cat.png"}}]}]
        first = await chat(s, msgs, conversation="untyped")
        second = await chat(s, next_turn(msgs, first["text"]), conversation="untyped")
        assert second["headers"]["X-TurnKV-Reuse-Outcome"] == "none"


async def test_media_uuid_and_cache_salt_are_keyed_per_tenant():
    p, d = engines(1, "prefill"), engines(1, "decode")
    msgs = [{"role": "user", "content": [{"type": "text", "text": "look"},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="},
                                          "uuid": "shared-image"}]}]
    async with router_over(p, d, keys=two_tenants()) as (s, _):
        seen = []
        for headers in (ACME, GLOBEX, ACME):
            assert (await chat(s, msgs, conversation=None, headers=headers, cache_salt="salt"))["status"] == 200
            body = d[0].seen_bodies[-1]
            seen.append((body["messages"][0]["content"][1]["uuid"], body["cache_salt"]))
        (uuid_a, salt_a), (uuid_g, salt_g), again = seen
        assert uuid_a != "shared-image" and salt_a != "salt"
        assert uuid_a != uuid_g and salt_a != salt_g  # another tenant names another cache entry
        assert again == seen[0]  # one tenant's keys are stable (its own cache still works)
        await chat(s, MSGS, conversation=None, headers=ACME)
        assert d[0].seen_bodies[-1]["cache_salt"]  # a salt even when the client sent none


async def test_the_routers_own_shortage_of_descriptors_is_a_503_and_ejects_nothing(monkeypatch):
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, app):
        loop = asyncio.get_running_loop()
        real = loop.create_connection
        engine_ports = {p[0].port, d[0].port}

        async def out_of_fds(factory, host=None, port=None, *a, **kw):
            if port in engine_ports:
                raise OSError(errno.EMFILE, "Too many open files")
            return await real(factory, host, port, *a, **kw)

        monkeypatch.setattr(loop, "create_connection", out_of_fds)
        r = await chat(s, conversation=None)
        assert r["status"] == 503 and r["headers"]["Retry-After"] == "1"
        assert all(e.healthy for e in app[POOL].all)
        monkeypatch.setattr(loop, "create_connection", real)
        assert (await chat(s, conversation=None))["status"] == 200


async def test_a_params_chunk_without_the_space_after_data_is_still_stripped():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, _):
        d[0].fault = {"sse_nospace": True}
        first = await chat(s, conversation="nospace", stream=True)
        assert b"kv_transfer_params" not in first["raw"] and b"remote_" not in first["raw"]
        second = await chat(s, next_turn(MSGS, first["text"]), conversation="nospace", stream=True)
        assert second["headers"]["X-TurnKV-Reuse-Outcome"] == "hit"


async def test_an_engines_mid_stream_error_is_redacted():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, _):
        d[0].fault = {"midstream_error": True}
        r = await chat(s, conversation=None, stream=True, max_tokens=4)
        assert b"remote_host" not in r["raw"] and b"127.0.0.1" not in r["raw"]
        errors = [e for e in r["events"] if "error" in e]
        assert errors and errors[0]["error"]["type"] == "upstream_error"


async def test_a_line_without_an_end_is_not_buffered_without_limit(monkeypatch):
    monkeypatch.setattr(sse, "MAX_LINE", 64 * 1024)
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d, tunables={"decode_migrations": 0}) as (s, _):
        d[0].fault = {"endless_line": 256 * 1024}
        r = await asyncio.wait_for(chat(s, conversation=None, stream=True, max_tokens=4), 10)
        assert b"incomplete" in r["raw"]  # the stream ended with an error event, not after the engine gave up


async def test_the_lease_route_is_rate_limited_before_it_parses():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d, tunables={"tenant_lease_rate": 0.01}) as (s, app):
        statuses = []
        for _ in range(3):
            async with s.post("/v1/conversations/lease", data=b"not json") as resp:
                statuses.append(resp.status)
        assert statuses == [400, 429, 429]
        assert refused(app, "tenant_lease_rate") == 2


async def test_kept_responses_are_bounded_per_tenant():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d, keys=two_tenants(), tunables={"tenant_max_response_bytes": 4096}) as (s, app):
        async def respond(headers, text, previous=None):
            body = {"model": "tiny", "input": text, "max_output_tokens": 4}
            if previous:
                body["previous_response_id"] = previous
            async with s.post("/v1/responses", json=body, headers=headers) as resp:
                return resp.status, orjson.loads(await resp.read())

        status, big = await respond(ACME, "word " * 2000)  # its history alone is over the tenant's bytes
        assert status == 200
        status, _ = await respond(ACME, "more", big["id"])
        assert status == 400  # not kept: previous_response_id is not found
        status, small = await respond(GLOBEX, "short question")
        assert (await respond(GLOBEX, "more", small["id"]))[0] == 200
        assert app[FLOW].responses.held.used("acme") == 0


def test_default_tenant_limits_are_a_small_share_of_the_routers():
    from turnkv import params

    assert params.BY_NAME["tenant_max_inflight"].default * 16 <= params.BY_NAME["max_inflight"].default


@pytest.mark.parametrize("ceiling", ["tenant_request_rate", "tenant_body_rate", "tenant_max_conversations",
                                     "tenant_max_retained_tokens"])
def test_shared_budgets_have_no_per_tenant_ceiling_by_default(ceiling):
    """Rate, bytes and retention are max-min fair shares of the router's (issue 38): a tenant alone is never held to
    a fixed slice of an idle router; a ceiling is the operator's choice."""
    from turnkv import params

    assert params.BY_NAME[ceiling].default == params.BY_NAME[ceiling].maximum


async def test_body_bytes_per_second_are_limited_per_tenant():
    """A message flood costs parsing in proportion to its bytes: bytes per second bound one tenant's CPU."""
    p, d = engines(1, "prefill"), engines(1, "decode")
    tunables = {"tenant_body_rate": 4096, "max_body_bytes": 4096}
    async with router_over(p, d, keys=two_tenants(), tunables=tunables) as (s, app):
        msgs = [{"role": "user", "content": "y" * 3000}]
        first = await chat(s, msgs, conversation=None, headers=ACME)
        second = await chat(s, msgs, conversation=None, headers=ACME)
        third = await chat(s, msgs, conversation=None, headers=ACME)
        assert first["status"] == 200 and 429 in (second["status"], third["status"])
        assert refused(app, "tenant_body_rate") >= 1
        assert (await chat(s, msgs, conversation=None, headers=GLOBEX))["status"] == 200


async def test_a_message_flood_is_refused_unparsed_and_messages_per_second_are_limited():
    p, d = engines(1, "prefill"), engines(1, "decode")
    tunables = {"max_messages": 100, "tenant_message_rate": 100}
    async with router_over(p, d, keys=two_tenants(), tunables=tunables) as (s, app):
        flood = await chat(s, [{"role": "user", "content": "x"}] * 5000, conversation=None, headers=ACME)
        assert flood["status"] == 413 and "16 x max_messages" in flood["error"]["error"]["message"]
        statuses = [(await chat(s, [{"role": "user", "content": "x"}] * 100, conversation=None,
                                headers=ACME))["status"] for _ in range(3)]
        assert statuses[:2] == [200, 200] and statuses[2] == 429  # burst: 2 x max_messages
        assert refused(app, "tenant_message_rate") == 1
        assert (await chat(s, conversation=None, headers=GLOBEX))["status"] == 200


async def _ends_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    """Whether the router ends the connection (EOF or reset) within ``seconds``."""
    try:
        async with asyncio.timeout(seconds):
            while await reader.read(65536):
                pass
    except TimeoutError:
        return False
    except OSError:
        pass
    return True


async def test_a_refused_large_body_is_not_read_the_connection_closes_at_once():
    """A refusal of a body left mostly unread must not make the loop read and drop it (aiohttp's lingering close
    read up to 10 s of a refused 8 MiB flood: ~3 ms of the loop each, more than a served turn)."""
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d, keys=two_tenants()) as (s, app):
        bad = {"Authorization": "Bearer not-a-key"}
        reader, writer = await _park_body(_port(s), bad, 8 * 1024 * 1024, b"{" + b" " * 65536)

        async def trickle() -> None:  # the client keeps sending its body, slowly
            with contextlib.suppress(OSError):
                for _ in range(200):
                    writer.write(b" " * 65536)
                    await writer.drain()
                    await asyncio.sleep(0.05)

        sending = asyncio.create_task(trickle())
        try:
            assert await _ends_within(reader, 2.0)
        finally:
            sending.cancel()
            writer.close()
        assert app[METRICS].registry.get_sample_value(
            "turnkv_router_requests_total", {"route": "/v1/chat/completions", "status": "401"}) == 1


async def test_a_small_refused_body_still_gets_its_answer():
    p, d = engines(1, "prefill"), engines(1, "decode")
    body, bad = b"{" + b" " * 200_000 + b"}", {"Authorization": "Bearer not-a-key"}
    async with router_over(p, d, keys=two_tenants()) as (s, _), \
            s.post("/v1/chat/completions", data=body, headers=bad) as resp:
        assert resp.status == 401


async def test_a_flood_is_refused_as_it_arrives_not_once_whole():
    """The 16 x max_messages bound is counted as the body arrives: a flood whose rest never comes (or comes slowly)
    is refused at once, not after body_read_timeout."""
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d, keys=two_tenants(), tunables={"max_messages": 10}) as (s, app):
        head = b'{"model": "tiny", "messages": [' + b'{"role": "user", "content": "x"},' * 200
        reader, writer = await _park_body(_port(s), ACME, len(head) * 10, head)
        try:
            status = await asyncio.wait_for(reader.readline(), 3)
        finally:
            writer.close()
        assert status.startswith(b"HTTP/1.1 413")
        assert refused(app, "max_messages") == 1


async def test_a_tenant_over_its_loop_share_is_refused_while_another_waits():
    """Per-tenant fairness on the router's one event loop: a tenant whose requests took more than
    tenant_loop_share of it (here: thousands of messages hashed a request) gets 429 naming the limit, with
    Retry-After, before its body is read; the other tenant is still served."""
    p, d = engines(1, "prefill"), engines(1, "decode")
    tunables = {"tenant_loop_share": 0.01, "tenant_message_rate": 1e7}
    async with router_over(p, d, keys=two_tenants(), tunables=tunables) as (s, app):
        assert (await chat(s, conversation=None, headers=GLOBEX))["status"] == 200
        heavy = [{"role": "user", "content": f"m{i}"} for i in range(4000)]
        answers = []
        for _ in range(30):
            answers.append(await chat(s, heavy, conversation=None, headers=ACME))
            if answers[-1]["status"] != 200:
                break
        last = answers[-1]
        assert last["status"] == 429 and last["error"]["error"]["limit"] == "tenant_loop_share", last["status"]
        assert int(last["headers"]["Retry-After"]) >= 1
        assert refused(app, "tenant_loop_share") == 1
        assert (await chat(s, conversation=None, headers=GLOBEX))["status"] == 200


async def test_a_tenant_alone_may_use_the_whole_loop():
    p, d = engines(1, "prefill"), engines(1, "decode")
    tunables = {"tenant_loop_share": 0.01, "tenant_message_rate": 1e7}
    async with router_over(p, d, keys=two_tenants(), tunables=tunables) as (s, app):
        heavy = [{"role": "user", "content": f"m{i}"} for i in range(4000)]
        for _ in range(10):
            assert (await chat(s, heavy, conversation=None, headers=ACME))["status"] == 200
        assert refused(app, "tenant_loop_share") == 0


async def test_a_lone_tenant_is_not_limited_and_under_contention_the_heaviest_is_cut_first():
    """Rates are max-min fair shares of router_request_rate: a key alone goes past it (an idle router serves it
    all); with two keys asking more than it in all, the heavy one is cut to the fair level and the light one never."""
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d, keys=two_tenants(), tunables={"router_request_rate": 20}) as (s, _):
        alone = [await chat(s, conversation=None, headers=ACME) for _ in range(60)]
        assert all(r["status"] == 200 for r in alone)  # 60 in well under 3 s: past 20/s, and alone
        heavy, light = [], []
        for i in range(120):
            heavy.append(await chat(s, conversation=None, headers=ACME))
            if i % 10 == 0:
                light.append(await chat(s, conversation=None, headers=GLOBEX))
        assert all(r["status"] == 200 for r in light)
        cut = [r for r in heavy if r["status"] == 429]
        assert cut and "fair share" in cut[0]["error"]["error"]["message"]
        assert cut[0]["error"]["error"]["limit"] == "tenant_request_rate"
