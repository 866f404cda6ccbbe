"""Trust and limits over fake engines that return what vLLM + turnkv's connector return (bench.fake_engine):
engine-authoritative expiry, router-owned request ids, min_tokens, error redaction, the push leak, leases,
retention and admission limits, ops routes, media, render fields."""

from __future__ import annotations

import asyncio
import time

import orjson

from bench.fake_engine import FAKE_SECRET
from router.app import FLOW, METRICS, POOL
from router.auth import ApiKeys, parse_keys
from router.guard import History
from router.state import Entry
from router.state.memory import MemoryStore
from tests.router.conftest import engines, router_over
from tests.router.test_flow_fake import MSGS, chat, next_turn
from turnkv import wire


def words(text: str) -> list[str]:
    """A fake decode's reply without its first word (``rid-<the engines' request id>``, which differs per
    dispatch by design): ``kv-<digest of the KV it decoded from>`` and the generated words."""
    return text.split()[1:]


async def test_slow_reader_entry_expires_with_decode_not_with_the_router():
    """A client reading a long stream slowly makes the router store the entry long after decode finished and
    started its TTL. The entry must die with decode's blocks, not live the router's lifetime past them."""
    store = MemoryStore(100)
    # upstream-like prefill: reads whatever it is given (no wall-clock or signature check of its own)
    p = engines(1, "prefill", verify_offers=False)
    d = engines(1, "decode", expiry_ttl=7.0)
    async with router_over(p, d, store=store, tunables={"expiry_margin": 5}) as (s, _):
        d[0].fault = {"token_delay": 0.5}  # decode's blocks are retained from the start; the stream takes ~2 s
        first = await chat(s, conversation="slow", stream=True)
        d[0].fault = {}
        assert first["status"] == 200
        await asyncio.sleep(7.5 - 2.0)  # decode has freed the blocks now
        second = await chat(s, next_turn(MSGS, first["text"]), conversation="slow")
        assert second["status"] == 200
        assert p[0].stats["stale_reads"] == 0, "prefill read blocks decode had already freed"
        assert second["headers"]["X-TurnKV-Reuse-Outcome"] in ("miss", "expired")


async def test_prefill_refuses_an_offer_past_its_wall_clock_expiry_whatever_the_router_believes():
    store = MemoryStore(100)
    # prefill's skew margin is 10 s: it refuses the offer 2 s after decode made it
    p, d = engines(1, "prefill", expiry_skew=10.0), engines(1, "decode", expiry_ttl=12.0)
    async with router_over(p, d, store=store) as (s, _):
        first = await chat(s, conversation="late")
        [key] = store.conversation_keys()
        entry = store.peek(key)
        # decode's own 12 s, not the router's lifetime (the signed instant is rounded to the millisecond)
        assert entry.params[wire.EXPIRES_AT] <= time.time() + 12.0 + 0.001
        # the router believes the entry lives on (a TTL lowered in SSM and picked up late, a queued prefill)
        await store.put(key, Entry(entry.params, entry.history, time.time() + 60, entry.decode_engine,
                                   entry.stored_at))
        await asyncio.sleep(2.2)
        second = await chat(s, next_turn(MSGS, first["text"]), conversation="late")
        assert second["status"] == 200 and second["headers"]["X-TurnKV-Reused-Tokens"] == "0"
        assert p[0].refused_offers == {"expired": 1} and p[0].stats["stale_reads"] == 0


async def test_decode_params_carry_a_monotonic_expiry_and_a_signed_wall_clock_one():
    """What real vLLM returns (perf_counter, not Unix time) plus what turnkv's connector adds."""
    store = MemoryStore(100)
    p, d = engines(1, "prefill"), engines(1, "decode", expiry_ttl=30.0)
    async with router_over(p, d, store=store) as (s, _):
        await chat(s, conversation="shape")
        [key] = store.conversation_keys()
        params = store.peek(key).params
        assert params["remote_blocks_expiry_time"] < 1e9  # not a Unix timestamp
        assert abs(params[wire.EXPIRES_AT] - (time.time() + 30)) < 2
        assert wire.check_offer(b"fake-offer-secret", params, "fake-model-fingerprint", time.time(), 0) == "ok"


async def test_concurrent_push_requests_with_one_client_request_id_get_their_own_answers():
    p = engines(1, "prefill", mode="push", bidirectional=False)
    d = engines(2, "decode", mode="push", bidirectional=False)
    prompts = [[{"role": "user", "content": f"question {i} " * 50}] for i in range(2)]
    async with router_over(p, d, mode="push", identity=True, policy="round_robin") as (s, _):
        alone = [words((await chat(s, m, conversation=None, headers={"X-TurnKV-Reuse": "off"}))["text"])
                 for m in prompts]
        assert alone[0] != alone[1]
        p[0].fault = {"delay": 0.3}  # both decode legs register before either prefill finishes
        same = {"X-Request-Id": "gateway-constant-id"}
        both = await asyncio.gather(*(chat(s, m, conversation=None, headers=same) for m in prompts))
        assert [r["status"] for r in both] == [200, 200]
        assert [words(r["text"]) for r in both] == alone
        assert all({k.lower(): v for k, v in r["headers"].items()}["x-request-id"] == "gateway-constant-id"
                   for r in both)
        assert "gateway-constant-id" not in p[0].seen_request_ids + d[0].seen_request_ids + d[1].seen_request_ids


async def test_non_ascii_request_id_is_a_clean_400():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, _):
        host, port = s._base_url.host, s._base_url.port
        reader, writer = await asyncio.open_connection(host, port)
        body = orjson.dumps({"model": "tiny", "messages": MSGS, "max_tokens": 2})
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"X-Request-Id: caf\xc3\xa9-\xff\xfe\r\nContent-Length: " + str(len(body)).encode() +
                     b"\r\nConnection: close\r\n\r\n" + body)
        await writer.drain()
        raw = await reader.read()
        writer.close()
        assert raw.startswith(b"HTTP/1.1 400"), raw[:200]
        assert b"X-Request-Id" in raw and p[0].stats["requests"] == 0


async def test_min_tokens_above_one_is_served():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, _):
        for stream in (False, True):
            r = await chat(s, conversation=None, stream=stream, min_tokens=5, max_tokens=8)
            assert r["status"] == 200, r.get("error")
        assert "min_tokens" not in orjson.dumps(p[0].seen_params).decode()


async def test_engine_errors_on_a_hit_never_reach_the_client_verbatim():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, _):
        first = await chat(s, conversation="leak")
        p[0].fault = {"status": 400, "echo": True}  # an engine error that echoes the replayed params
        second = await chat(s, next_turn(MSGS, first["text"]), conversation="leak")
        assert second["status"] == 400
        text = second["raw"].decode()
        for secret in ("remote_", "decode-0", "127.0.0.1", str(d[0].side_channel_port), str(p[0].port),
                       "block", wire.SIGNATURE):
            assert secret not in text, text
        assert second["error"]["error"]["message"].startswith("the model server refused the request (HTTP 400)")
        p[0].fault = {"status": 400}  # a plain validation message names nothing internal: passed on
        third = await chat(s, conversation=None)
        assert third["error"]["error"]["message"] == "injected fault"
        d[0].fault = {"die_after_first": True}
        p[0].fault = {}
        cut = await chat(s, conversation=None, stream=True)
        assert "127.0.0.1" not in cut["raw"].decode() and "decode-0" not in cut["raw"].decode()


async def test_push_prefill_failing_after_decode_opened_closes_the_decode_stream():
    p = engines(1, "prefill", mode="push", bidirectional=False)
    d = engines(1, "decode", mode="push", bidirectional=False, push_wait=0.1)
    async with router_over(p, d, mode="push", identity=True) as (s, app):
        d[0].fault = {"token_delay": 0.3}
        p[0].fault = {"delay": 0.5, "status": 400}  # decode gives up waiting at 0.1 s and starts streaming
        for stream in (True, False):
            r = await chat(s, conversation=None, stream=stream, max_tokens=20)
            assert r["status"] == 400
        await asyncio.sleep(0.5)
        pool = app[FLOW].pool
        assert [e.outstanding for e in pool.all] == [0, 0] and [e.outstanding_tokens for e in pool.all] == [0, 0]
        assert d[0].stats["running"] == 0 and d[0].stats["aborted"] >= 1


async def _lease(s, messages, ttl=60):
    """Renew the turn that ``messages`` (ending with its reply) address."""
    async with s.post("/v1/conversations/lease", json={"model": "tiny", "messages": messages,
                                                       "ttl": ttl}) as resp:
        return resp.status, await resp.json()


async def test_lease_renews_with_decode_and_survives_engine_failures_and_concurrent_turns():
    store = MemoryStore(100)
    p, d = engines(1, "prefill"), engines(1, "decode", expiry_ttl=20.0)
    async with router_over(p, d, store=store) as (s, _):
        first = await chat(s, conversation="L")
        so_far = [*MSGS, {"role": "assistant", "content": first["text"]}]
        [key] = store.conversation_keys()
        before = store.peek(key).params[wire.EXPIRES_AT]
        status, body = await _lease(s, so_far, ttl=200)
        assert status == 200 and body["expires_in"] > 150
        renewed = store.peek(key).params
        assert renewed[wire.EXPIRES_AT] > before + 100  # decode's new expiry, re-signed by decode
        # an engine that fails (5xx) leaves the entry: the old lease still stands
        d[0].fault = {"lease_status": 503}
        status, _ = await _lease(s, so_far)
        assert status == 502 and store.peek(key) is not None
        # a concurrent turn wins over a renewal in flight
        d[0].fault = {"lease_delay": 0.5}
        renewal = asyncio.create_task(_lease(s, so_far))
        await asyncio.sleep(0.1)
        turn2 = await chat(s, next_turn(MSGS, first["text"]), conversation="L")
        assert turn2["headers"]["X-TurnKV-Reuse-Outcome"] == "hit"
        [newer_key] = store.conversation_keys()  # the new turn, at its own content address
        newer = store.peek(newer_key)
        status, _ = await renewal
        # decode no longer holds the old blocks (410) or the entry moved on (409): the old turn is not put back,
        # the newer turn stays
        assert status in (409, 410) and store.peek(key) is None and store.peek(newer_key) == newer
        # an engine that no longer holds the blocks: the entry is dropped (410), not kept to be read
        d[0].fault = {"lease_status": 404}
        status, _ = await _lease(s, [*next_turn(MSGS, first["text"]), {"role": "assistant", "content": turn2["text"]}])
        assert status == 410 and store.peek(newer_key) is None


async def test_lease_ttl_and_renewal_rate_are_bounded_per_tenant():
    p, d = engines(1, "prefill"), engines(1, "decode")
    # burst 2: the refused ttl counts too (the rate is checked before the body is parsed)
    async with router_over(p, d, tunables={"lease_max_ttl": 100, "tenant_lease_rate": 0.2}) as (s, _):
        first = await chat(s, conversation="R")
        so_far = [*MSGS, {"role": "assistant", "content": first["text"]}]
        status, body = await _lease(s, so_far, ttl=3600)
        assert status == 400 and "(0, 100]" in body["error"]["message"]
        statuses = [(await _lease(s, so_far, ttl=50))[0] for _ in range(3)]
        assert statuses[0] == 200 and 429 in statuses


async def test_tenant_retention_limits_stop_pinning_decode_memory():
    keys = ApiKeys(parse_keys('{"tenants": {"acme": "acme-key-123", "globex": "globex-key-456"}}'))
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d, keys=keys, tunables={"tenant_max_conversations": 2}) as (s, app):
        acme = {"Authorization": "Bearer acme-key-123"}
        for i in range(3):
            await chat(s, conversation=f"a{i}", headers=acme)
        retained = [bool(x and x.get(wire.RETAIN)) for x in d[0].seen_params[-3:]]
        assert retained == [True, True, False]
        assert app[METRICS].registry.get_sample_value("turnkv_router_retention_refused_total") == 1
        # another tenant is not affected; a taken turn frees its slot
        assert (await chat(s, conversation="g", headers={"Authorization": "Bearer globex-key-456"}))["status"] == 200
        assert d[0].seen_params[-1].get(wire.RETAIN) is True


async def test_admission_control_per_tenant_and_globally():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d, tunables={"tenant_max_inflight": 1}) as (s, app):
        p[0].fault = {"delay": 0.5}
        slow = asyncio.create_task(chat(s, conversation=None))
        await asyncio.sleep(0.1)
        refused = await chat(s, conversation=None)
        assert refused["status"] == 429 and refused["headers"]["Retry-After"] == "1"
        assert (await slow)["status"] == 200
        p[0].fault = {}
        assert (await chat(s, conversation=None))["status"] == 200  # the slot came back
        assert app[METRICS].registry.get_sample_value("turnkv_router_admission_refused_total",
                                                      {"limit": "tenant"}) == 1


async def test_ops_routes_are_not_served_through_the_load_balancer():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, _):
        for path in ("/health", "/ready", "/metrics"):
            async with s.get(path) as direct, s.get(path, headers={"X-Forwarded-For": "203.0.113.9"}) as via_alb:
                assert direct.status == 200 and via_alb.status == 404


async def test_images_behind_urls_are_never_reused_but_inline_bytes_are():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, _):
        for url, expect in (("https://example.com/cat.png", "none"), ("data:image/png;base64,iVBORw0KGgo=", "hit")):
            msgs = [{"role": "user", "content": [{"type": "text", "text": "what is this? " * 50},
                                                 {"type": "image_url", "image_url": {"url": url}}]}]
            first = await chat(s, msgs, conversation=f"img-{expect}")
            second = await chat(s, next_turn(msgs, first["text"]), conversation=f"img-{expect}")
            assert second["headers"]["X-TurnKV-Reuse-Outcome"] == expect


async def test_every_render_field_separates_conversations():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, _):
        for field, a, b in (("reasoning_effort", "low", "high"), ("add_special_tokens", False, True),
                            ("truncate_prompt_tokens", 100, 200)):
            first = await chat(s, conversation=f"r-{field}", **{field: a})
            other = await chat(s, next_turn(MSGS, first["text"]), conversation=f"r-{field}", **{field: b})
            assert other["headers"]["X-TurnKV-Reuse-Outcome"] == "miss", field


async def test_an_empty_discovery_answer_keeps_the_last_pool():
    from router.engines import Engine, EnginePool
    from router.engines.health import discovery_loop

    pool = EnginePool(["http://10.0.0.1:8000"], ["http://10.0.0.2:8000"])
    answers = [{"prefill": [], "decode": [Engine("http://10.0.0.3:8000", "decode")]}]

    async def discover():
        return answers[0]

    task = asyncio.create_task(discovery_loop(pool, discover, lambda: 60))
    await asyncio.sleep(0.05)
    task.cancel()
    assert [e.url for e in pool.prefill] == ["http://10.0.0.1:8000"]
    assert [e.url for e in pool.decode] == ["http://10.0.0.3:8000"]


async def test_discovery_reports_what_cloud_map_lists_per_role_even_when_it_keeps_the_last_pool():
    """The EnginesNotRegistered alarm counts what Cloud Map lists (an empty role is 0), not the kept pool."""
    from router import telemetry
    from router.engines import Engine, EnginePool
    from router.engines.health import discovery_loop

    pool = EnginePool(["http://10.0.0.1:8000"], ["http://10.0.0.2:8000"])
    seen: list[dict] = []

    async def discover():
        return {"prefill": [], "decode": [Engine("http://10.0.0.3:8000", "decode")]}

    def observe(found):
        seen.extend(telemetry.registered_engines_records(
            namespace="turnkv/Router", deployment="prod",
            counts={role: len(found.get(role) or ()) for role in ("prefill", "decode")}))

    task = asyncio.create_task(discovery_loop(pool, discover, lambda: 60, observe))
    await asyncio.sleep(0.05)
    task.cancel()
    assert {(r["Role"], r["RegisteredEngines"]) for r in seen} == {("prefill", 0), ("decode", 1)}
    assert [e.url for e in pool.prefill] == ["http://10.0.0.1:8000"]
    assert all(r["_aws"]["CloudWatchMetrics"][0]["Dimensions"] == [["Deployment", "Role"]] for r in seen)


async def test_stored_entries_keep_decodes_signed_offer_verbatim():
    """Replaces a test that asserted a dataclass field: the store must round-trip every offer key prefill checks."""
    store = MemoryStore(100)
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d, store=store) as (s, _):
        await chat(s, conversation="rt")
        [key] = store.conversation_keys()
        entry = store.peek(key)
        assert isinstance(entry.history, History) and Entry.from_bytes(entry.to_bytes()) == entry
        returned = next(x for x in reversed(d[0].seen_params) if x)  # what decode was sent; its answer is stored
        assert returned.get(wire.RETAIN) is True
        assert all(k in entry.params for k in wire.OFFER_KEYS
                   if k not in (wire.TOKEN_PROOF, wire.HOST_TIER, wire.FORK_WINDOW, wire.TENANT, wire.SEALED))


async def test_a_stream_survives_its_decode_engine_dying_with_no_token_lost_or_repeated():
    p, d = engines(1, "prefill"), engines(2, "decode")
    long = [{"role": "user", "content": "tell me a story " * 40}]
    async with router_over(p, d) as (s, app):
        pool = app[FLOW].pool
        pool.decode[1].outstanding = 5  # decode-0 first
        calm = await chat(s, long, conversation=None, stream=True, max_tokens=12)
        d[0].fault = {"die_after": 4}
        cut = await chat(s, long, conversation=None, stream=True, max_tokens=12)
        pool.decode[1].outstanding = 0
        assert cut["status"] == 200 and not any("error" in e for e in cut["events"])
        assert cut["raw"].endswith(b"data: [DONE]\n\n")
        # the first word names the engines' request id (new per dispatch); every token after it is the same
        assert words(cut["text"]) == words(calm["text"]) and len(cut["text"].split()) == 12
        assert d[1].stats["decode"] == 1 and p[0].stats["prefill"] == 3  # the continuation's own prefill
        continuation = d[1].seen_params[-1]
        assert continuation["remote_engine_id"] == "prefill-0"
        assert app[METRICS].registry.get_sample_value("turnkv_router_stream_migrations_total",
                                                      {"result": "continued"}) == 1
        # the ids the router asked for to count tokens never reach a client that did not ask for them
        assert b"token_ids" not in cut["raw"]
        # a client that asked for token ids gets them all, once each, across the migration
        d[0].fault = {"die_after": 3}
        pool.decode[1].outstanding = 5
        with_ids = await chat(s, long, conversation=None, stream=True, max_tokens=12, return_token_ids=True)
        ids = [t for e in with_ids["events"] for c in e.get("choices", []) for t in c.get("token_ids") or []]
        assert len(ids) == 12 and with_ids["events"][0]["id"] == with_ids["events"][-1]["id"]


async def test_translated_streams_survive_their_decode_engine_dying():
    """Responses and Messages streams are chat streams to the engines: a continuation on another decode engine is
    translated like the rest, so the SDKs see one stream, every word once, and a normal end."""
    from anthropic import AsyncAnthropic
    from openai import AsyncOpenAI

    p, d = engines(1, "prefill"), engines(2, "decode")
    keys = ApiKeys(parse_keys("acme:acme-key-0123456789\n"))
    async with router_over(p, d, keys=keys) as (s, app):
        pool = app[FLOW].pool
        base = str(s._base_url).rstrip("/")
        openai = AsyncOpenAI(base_url=base + "/v1", api_key="acme-key-0123456789", max_retries=0)
        claude = AsyncAnthropic(base_url=base, api_key="acme-key-0123456789", max_retries=0)
        story = "tell me a story " * 40

        async def responses() -> str:
            events = [e async for e in await openai.responses.create(model="tiny", input=story, stream=True,
                                                                     max_output_tokens=12, store=False)]
            assert not [e for e in events if e.type == "error"]
            end = next(e for e in events if e.type in ("response.completed", "response.incomplete"))
            return end.response.output_text

        async def messages() -> str:
            async with claude.messages.stream(model="tiny", max_tokens=12,
                                              messages=[{"role": "user", "content": story}]) as events:
                final = await events.get_final_message()
            return "".join(b.text for b in final.content if b.type == "text")

        for ask in (responses, messages):
            pool.decode[1].outstanding = 5  # decode-0 first
            calm = await ask()
            d[0].fault = {"die_after": 4}
            cut = await ask()
            d[0].fault = {}
            pool.decode[1].outstanding = 0
            assert words(cut) == words(calm) and len(cut.split()) == 12, (ask.__name__, calm, cut)
        assert app[METRICS].registry.get_sample_value("turnkv_router_stream_migrations_total",
                                                      {"result": "continued"}) == 2
        await openai.close()
        await claude.close()


async def test_a_stream_that_cannot_migrate_ends_with_an_error_event():
    p, d = engines(1, "prefill"), engines(2, "decode")
    async with router_over(p, d, tunables={"decode_migrations": 0}) as (s, app):
        app[FLOW].pool.decode[1].outstanding = 5
        d[0].fault = {"die_after": 2}
        r = await chat(s, conversation=None, stream=True, max_tokens=8)
        assert r["events"][-1]["error"]["type"] == "upstream_error" and d[1].stats["decode"] == 0


async def test_a_turn_decode_evicted_is_never_replayed_and_its_blocks_never_read():
    """Decode above its share evicts its oldest retained turn: announced on its evictions feed, blocks freed
    after the grace. The router sees the announcement and recomputes that turn (without the feed check it
    replayed the offer and prefill read freed blocks); the newer turn still reuses."""
    p = engines(1, "prefill")
    d = engines(1, "decode", retain_limit=1, eviction_grace=0.5)
    alpha, beta = [{"role": "user", "content": "alpha " * 200}], [{"role": "user", "content": "beta " * 200}]
    async with router_over(p, d, tunables={"evictions_interval": 0.2}) as (s, _):
        a = await chat(s, alpha, conversation="a")
        b = await chat(s, beta, conversation="b")  # decode keeps one turn: alpha's is evicted
        assert d[0].stats["evicted"] == 1
        await asyncio.sleep(1.0)  # past the grace: alpha's blocks are free
        b2 = await chat(s, next_turn(beta, b["text"]), conversation="b")
        a2 = await chat(s, next_turn(alpha, a["text"]), conversation="a")
        assert a2["status"] == 200 and a2["headers"]["X-TurnKV-Reuse-Outcome"] == "refused"
        assert a2["headers"]["X-TurnKV-Reused-Tokens"] == "0"
        assert b2["headers"]["X-TurnKV-Reuse-Outcome"] == "hit"
        assert p[0].stats["stale_reads"] == 0


async def test_prefill_does_not_start_reading_a_replayed_offer_after_its_read_by_instant():
    """The router stamps each replay with a read-by instant (replay_window): a prefill that gets to the offer
    later (queued) recomputes, so an eviction announced meanwhile can never be read."""
    p, d = engines(1, "prefill", expiry_skew=0.0), engines(1, "decode")
    async with router_over(p, d, tunables={"replay_window": 1}) as (s, _):
        first = await chat(s, conversation="queued")
        p[0].fault = {"delay": 1.2}  # prefill queued past the read-by instant
        second = await chat(s, next_turn(MSGS, first["text"]), conversation="queued")
        assert second["status"] == 200 and second["headers"]["X-TurnKV-Reused-Tokens"] == "0"
        assert p[0].refused_offers == {"late": 1} and p[0].stats["stale_reads"] == 0


async def test_the_router_clears_what_it_replays_and_prefill_reads_nothing_it_did_not_clear(monkeypatch):
    """Prefill reads only offers a router cleared with the engines' offer secret (turnkv.wire.clear_offer). A router
    without the secret still serves every turn, recomputed (the refusal is prefill's, counted as uncleared); with
    it the same conversation reuses, and what reached prefill carries a clearance that verifies."""
    monkeypatch.delenv(wire.OFFER_SECRET_ENV, raising=False)
    monkeypatch.delenv(wire.OFFER_SECRET_FILE_ENV, raising=False)
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d, offer_secret=None) as (s, app):
        assert app[FLOW].config.offer_secret is None
        first = await chat(s, conversation="no-secret")
        second = await chat(s, next_turn(MSGS, first["text"]), conversation="no-secret")
        assert second["status"] == 200 and second["headers"]["X-TurnKV-Reused-Tokens"] == "0"
        assert second["headers"]["X-TurnKV-Reuse-Outcome"] == "recompute"
        assert p[0].refused_offers == {"uncleared": 1} and p[0].stats["pulled"] == 0
        # the router counts prefill's reason (and logs it once, naming the missing secret)
        assert app[METRICS].offer_refusals.labels("uncleared")._value.get() == 1
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, _):
        first = await chat(s, conversation="secret")
        second = await chat(s, next_turn(MSGS, first["text"]), conversation="secret")
        assert second["headers"]["X-TurnKV-Reuse-Outcome"] == "hit" and int(
            second["headers"]["X-TurnKV-Reused-Tokens"]) > 0
        assert p[0].refused_offers == {} and p[0].stats["pulled"] > 0
        replayed = next(kv for kv in p[0].seen_params if isinstance(kv, dict) and kv.get(wire.CLEARANCE))
        assert 0 < replayed[wire.READ_BY] - time.time() <= 10  # replay_window
        assert wire.check_clearance(FAKE_SECRET, replayed, time.time(), required=True,
                                    engine_id=p[0].engine_id) == "ok"


async def test_a_host_tier_offer_is_replayed_only_once_decode_lists_its_copy_as_done(monkeypatch):
    """Decode copies a turn placed on its host tier at its next step, while the offer already left with the
    response. A next turn that arrives first must not read the slots: the router clears a host-tier offer only once
    decode's feed lists it as hosted, reading the feed again on the spot when its last read did not (a fast tool
    loop still reuses once the copy is done). Without that check the race reads unwritten slots."""
    from router.engines import evictions

    alpha = [{"role": "user", "content": "alpha " * 200}]
    p, d = engines(1, "prefill"), engines(1, "decode", host_copy_delay=0.6)
    async with router_over(p, d, tunables={"evictions_interval": 3}) as (s, _):
        await asyncio.sleep(0.3)  # the feed's first read
        first = await chat(s, alpha, conversation="fast")
        racing = await chat(s, next_turn(alpha, first["text"]), conversation="fast")  # before the copy is done
        assert racing["status"] == 200 and racing["headers"]["X-TurnKV-Reuse-Outcome"] == "refused"
        second = await chat(s, [*alpha, {"role": "user", "content": "again"}], conversation="slow")
        await asyncio.sleep(0.8)  # the copy is done; the feed is read every 3 s, and once on the spot
        later = await chat(s, next_turn([*alpha, {"role": "user", "content": "again"}], second["text"]),
                           conversation="slow")
        assert later["headers"]["X-TurnKV-Reuse-Outcome"] == "hit" and p[0].stats["pulled"] > 0
        assert p[0].stats["stale_reads"] == 0
    # the same race with the router's check taken out: prefill reads the slots before decode wrote them
    monkeypatch.setattr(evictions, "HOST_COPY_PENDING", "(check disabled)")
    monkeypatch.setattr(evictions.EvictionFeed, "refuses",
                        lambda self, rid, now, interval, host_tier=False, sealed_ranks=0:
                        "evicted" if rid in self.evicted else None)
    p, d = engines(1, "prefill"), engines(1, "decode", host_copy_delay=0.6)
    async with router_over(p, d, tunables={"evictions_interval": 3}) as (s, _):
        first = await chat(s, alpha, conversation="fast")
        racing = await chat(s, next_turn(alpha, first["text"]), conversation="fast")
        assert racing["headers"]["X-TurnKV-Reuse-Outcome"] == "hit" and p[0].stats["stale_reads"] == 1


async def test_a_feed_that_answers_404_refuses_replays_until_a_read_succeeds():
    """One 404 from decode's evictions feed used to turn its eviction checks off for good, and evicted offers were
    then replayed. Now nothing of that engine is replayed while its feed is unsupported, the feed is asked again
    every interval, and reuse comes back once a read succeeds."""
    p, d = engines(1, "prefill"), engines(1, "decode")
    d[0].fault = {"evictions_status": 404}
    async with router_over(p, d, tunables={"evictions_interval": 0.2}) as (s, app):
        await asyncio.sleep(0.5)
        reads = d[0].stats["feed_reads"]
        first = await chat(s, conversation="f")
        second = await chat(s, next_turn(MSGS, first["text"]), conversation="f")
        assert second["status"] == 200 and second["headers"]["X-TurnKV-Reuse-Outcome"] == "refused"
        assert app[POOL].decode[0].feed.supported is False
        await asyncio.sleep(0.5)
        assert d[0].stats["feed_reads"] > reads  # re-probed
        d[0].fault = {}
        await asyncio.sleep(0.5)
        third = await chat(s, next_turn(MSGS, first["text"]), conversation="g")
        fourth = await chat(s, next_turn(next_turn(MSGS, first["text"]), third["text"]), conversation="g")
        assert fourth["headers"]["X-TurnKV-Reuse-Outcome"] == "hit" and app[POOL].decode[0].feed.supported
        assert p[0].stats["stale_reads"] == 0


async def test_the_retain_request_names_the_tenant_by_a_tag_and_each_replay_is_cleared_for_it():
    """The router names the tenant a turn is retained for (wire.TENANT: a keyed tag, never the key's name); decode
    signs it into its offer, and the router's clearance of each replay names the same tenant (wire.CLEARED_TENANT),
    so prefill reads the turn only for it. Reuse works as before, for each tenant."""
    from router.auth import ApiKeys, parse_keys

    keys = ApiKeys(parse_keys('{"tenants": {"acme": "acme-key-123", "globex": "globex-key-456"}}'))
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d, keys=keys) as (s, _):
        tags = []
        for key in ("acme-key-123", "globex-key-456"):
            headers = {"Authorization": f"Bearer {key}"}
            first = await chat(s, conversation=None, headers=headers)
            retain = d[0].seen_params[-1]
            assert retain.get(wire.RETAIN) is True and wire.tenant_tag(retain)
            tag = retain[wire.TENANT]
            assert "acme" not in tag and "globex" not in tag
            second = await chat(s, next_turn(MSGS, first["text"]), conversation=None, headers=headers)
            assert second["headers"]["X-TurnKV-Reuse-Outcome"] == "hit"
            replayed = next(kv for kv in reversed(p[0].seen_params) if isinstance(kv, dict) and kv.get(wire.CLEARANCE))
            assert replayed[wire.TENANT] == replayed[wire.CLEARED_TENANT] == tag
            assert wire.check_clearance(FAKE_SECRET, replayed, time.time(), required=True,
                                        engine_id=p[0].engine_id) == "ok"
            other = wire.clear_offer(FAKE_SECRET, replayed, replayed[wire.READ_BY], tenant="another-tenant-tag",
                                     prefill=p[0].engine_id)
            assert wire.check_clearance(FAKE_SECRET, other, time.time(), required=True) == "uncleared"
            tags.append(tag)
        assert tags[0] != tags[1] and p[0].stats["stale_reads"] == 0


async def test_each_replay_is_cleared_for_the_prefill_engine_it_is_sent_to():
    """The router names the prefill engine a replay is dispatched to in its clearance (wire.CLEARED_FOR: the NIXL
    engine id the engine's own answers name), so the same replay sent to another prefill engine is refused there;
    reuse works as before."""
    p, d = engines(2, "prefill"), engines(1, "decode")
    async with router_over(p, d, policy="round_robin") as (s, app):
        for i in range(4):  # every prefill engine answers: the router learns their ids
            await chat(s, [{"role": "user", "content": f"warm {i}"}], conversation=None)
        assert sorted(e.nixl_id for e in app[POOL].prefill) == sorted(e.engine_id for e in p)
        messages = MSGS
        for _ in range(3):
            reply = await chat(s, messages, conversation=None)
            assert reply["status"] == 200
            messages = next_turn(messages, reply["text"])
        assert reply["headers"]["X-TurnKV-Reuse-Outcome"] == "hit"
        cleared = [(e, kv) for e in p for kv in e.seen_params if isinstance(kv, dict) and kv.get(wire.CLEARANCE)]
        assert len(cleared) == 2
        for engine, kv in cleared:
            assert kv[wire.CLEARED_FOR] == engine.engine_id
            other = p[1] if engine is p[0] else p[0]
            assert other._admit_offer(dict(kv)) == "uncleared"  # the same replay sent elsewhere is not read
        assert p[0].stats["stale_reads"] == p[1].stats["stale_reads"] == 0
