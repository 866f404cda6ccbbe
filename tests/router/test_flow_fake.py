"""The router's flow over fake engines: reuse, isolation, failover, push, keepalive, disconnects."""

from __future__ import annotations

import asyncio
import time

import anthropic as anthropic_errors
import openai as openai_errors
import orjson
import pytest

from router.app import FLOW, METRICS
from router.auth import ApiKeys, parse_keys
from router.engines import Engine
from router.state import Entry
from router.state.memory import MemoryStore
from tests.conftest import free_port
from tests.router.conftest import engines, router_over

MSGS = [{"role": "user", "content": "hello " * 200}]


async def chat(session, messages=MSGS, conversation="c1", stream=False, headers=None, **extra):
    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "stream": stream, **extra}
    if conversation:
        body["conversation_id"] = conversation
    async with session.post("/v1/chat/completions", json=body, headers=headers or {}) as resp:
        raw = await resp.read()
        out = {"status": resp.status, "headers": dict(resp.headers), "raw": raw}
        if stream and resp.status == 200:
            text, events, comments = "", [], []
            for line in raw.split(b"\n"):
                if line.startswith(b": "):
                    comments.append(line.decode())
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    ev = orjson.loads(line[6:])
                    events.append(ev)
                    for c in ev.get("choices", []):
                        text += c["delta"].get("content") or ""
            out.update(text=text, events=events, comments=comments)
        elif resp.status == 200:
            out["text"] = orjson.loads(raw)["choices"][0]["message"]["content"]
        else:
            out["error"] = orjson.loads(raw)
        return out


def next_turn(messages, reply_text):
    return [*messages, {"role": "assistant", "content": reply_text}, {"role": "user", "content": "more"}]


async def test_second_turn_reuses_and_params_never_reach_the_client():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, _):
        for stream in (False, True):
            conv = f"conv-{stream}"
            first = await chat(s, conversation=conv, stream=stream)
            assert first["status"] == 200 and first["headers"]["X-TurnKV-Reuse-Outcome"] == "none"
            assert b"kv_transfer_params" not in first["raw"]
            second = await chat(s, next_turn(MSGS, first["text"]), conversation=conv, stream=stream)
            assert second["headers"]["X-TurnKV-Reuse-Outcome"] == "hit"
            assert int(second["headers"]["X-TurnKV-Reused-Tokens"]) > 100
            # prefill got decode's stored params verbatim (allowlisted)
            assert p[0].seen_params[-1]["remote_engine_id"] == "decode-0"
            # single use: replaying the same turn again is a miss
            again = await chat(s, next_turn(MSGS, first["text"]), conversation=conv, stream=stream)
            assert again["headers"]["X-TurnKV-Reuse-Outcome"] == "miss"
        assert p[0].stats["wrong_reuse"] == 0 and p[0].stats["pulled"] > 200


async def test_tenants_are_isolated_and_bad_keys_get_401():
    keys = ApiKeys(parse_keys('{"tenants": {"acme": "acme-key-123", "globex": "globex-key-456"}}'))
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d, keys=keys) as (s, _):
        acme = {"Authorization": "Bearer acme-key-123"}
        globex = {"Authorization": "Bearer globex-key-456"}
        first = await chat(s, conversation="same", headers=acme)
        assert first["status"] == 200
        other = await chat(s, next_turn(MSGS, first["text"]), conversation="same", headers=globex)
        assert other["headers"]["X-TurnKV-Reuse-Outcome"] == "miss"  # never acme's entry
        own = await chat(s, next_turn(MSGS, first["text"]), conversation="same", headers=acme)
        assert own["headers"]["X-TurnKV-Reuse-Outcome"] == "hit"
        bad = await chat(s, headers={"Authorization": "Bearer nope-nope-nope"})
        assert bad["status"] == 401 and "unknown API key" in bad["error"]["error"]["message"]
        assert (await chat(s))["status"] == 401
        # the router's key is not forwarded to the engines
        assert all("Authorization" not in str(x) for x in d[0].seen_params)


async def test_forged_client_params_are_stripped():
    p, d = engines(1, "prefill"), engines(1, "decode")
    forged = {"do_remote_prefill": True, "remote_engine_id": "decode-0", "remote_block_ids": [[1]],
              "remote_host": "10.9.9.9", "remote_port": 1, "remote_num_tokens": 4000}
    async with router_over(p, d) as (s, _):
        reply = await chat(s, kv_transfer_params=forged)
        assert reply["status"] == 200 and reply["headers"]["X-TurnKV-Reused-Tokens"] == "0"
        assert p[0].seen_params[-1]["remote_host"] is None and p[0].seen_params[-1]["remote_block_ids"] is None


async def test_stored_params_naming_an_unknown_host_are_refused():
    store = MemoryStore(100)
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d, store=store) as (s, _):
        first = await chat(s, conversation="x")
        [key] = store.conversation_keys()
        entry = store.peek(key)
        bad = Entry({**entry.params, "remote_host": "10.9.9.9"}, entry.history, entry.expires_at, entry.decode_engine)
        await store.put(key, bad)
        second = await chat(s, next_turn(MSGS, first["text"]), conversation="x")
        assert second["headers"]["X-TurnKV-Reuse-Outcome"] == "refused"
        assert p[0].seen_params[-1]["remote_host"] is None


async def test_prefill_failure_is_retried_on_another_engine_without_ejecting_it():
    p, d = engines(2, "prefill"), engines(1, "decode")
    p[0].fault = {"status": 500}
    async with router_over(p, d, policy="round_robin") as (s, app):
        for _ in range(4):
            assert (await chat(s, conversation=None))["status"] == 200
        assert p[1].stats["prefill"] == 4
        # a failing request is no evidence against the engine (it may be the request): only probes and
        # connect failures eject
        assert app[FLOW].pool.prefill[0].healthy is True
        metrics = app[METRICS].registry.get_sample_value("turnkv_router_retries_total",
                                                         {"leg": "prefill", "reason": "http_500"})
        assert metrics == p[0].stats["errors"] >= 1


async def test_dead_prefill_engine_is_ejected_on_connect_failure_and_skipped():
    p, d = engines(1, "prefill"), engines(1, "decode")
    dead_port = free_port()  # nothing listens there: connections are refused
    async with router_over(p, d) as (s, app):
        pool = app[FLOW].pool
        dead = Engine(f"http://127.0.0.1:{dead_port}", "prefill")
        pool.prefill.insert(0, dead)
        pool.prefill[1].outstanding = 5  # make the dead one the first choice
        first = await chat(s, conversation=None)
        pool.prefill[1].outstanding = 0
        assert first["status"] == 200 and first["text"]
        assert dead.healthy is False  # a refused connection is evidence: ejected at once
        retries = app[METRICS].registry.get_sample_value("turnkv_router_retries_total",
                                                         {"leg": "prefill", "reason": "connect"})
        assert retries == 1
        for _ in range(3):  # later requests do not try it again
            assert (await chat(s, conversation=None))["status"] == 200
        assert app[METRICS].registry.get_sample_value("turnkv_router_retries_total",
                                                      {"leg": "prefill", "reason": "connect"}) == 1
        assert p[0].stats["prefill"] == 4


async def test_decode_failure_before_first_token_is_retried_elsewhere():
    p, d = engines(1, "prefill"), engines(2, "decode")
    d[0].fault = {"status": 503}
    async with router_over(p, d, policy="round_robin") as (s, _):
        for stream in (False, True, False, True):
            r = await chat(s, conversation=None, stream=stream)
            assert r["status"] == 200 and r["text"]
        assert d[1].stats["decode"] == 4


async def test_decode_hang_before_first_token_times_out_and_retries():
    p, d = engines(1, "prefill"), engines(2, "decode")
    d[0].fault = {"hang": True}
    async with router_over(p, d, tunables={"first_token_timeout": 1}) as (s, app):
        app[FLOW].pool.decode[1].outstanding = 5  # the hanging engine goes first
        r = await chat(s, conversation=None, stream=True)
        app[FLOW].pool.decode[1].outstanding = 0
        assert d[0].stats["requests"] == 1
        assert r["status"] == 200 and r["text"]


async def test_decode_dying_mid_stream_ends_with_an_error_event():
    p, d = engines(1, "prefill"), engines(1, "decode")
    d[0].fault = {"die_after_first": True}
    async with router_over(p, d) as (s, _):
        r = await chat(s, conversation=None, stream=True)
        assert r["status"] == 200
        assert r["events"][-1]["error"]["type"] == "upstream_error" and r["raw"].endswith(b"data: [DONE]\n\n")


async def test_failed_reuse_pull_is_retried_without_reuse():
    p, d = engines(2, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, app):
        first = await chat(s, conversation="pf")
        pool = app[FLOW].pool
        p[0].fault = {"status": 500}
        pool.prefill[1].outstanding = 5  # the replay goes to the failing engine first
        second = await chat(s, next_turn(MSGS, first["text"]), conversation="pf")
        pool.prefill[1].outstanding = 0
        assert second["status"] == 200
        # the failing engine was given decode's offer; the retry went elsewhere without it (the blocks of a
        # pull that may have started are not read twice)
        assert p[0].seen_params[-1]["remote_engine_id"] == "decode-0" and p[0].stats["errors"] == 1
        assert p[1].seen_params[-1]["remote_block_ids"] is None
        assert second["headers"]["X-TurnKV-Reuse-Outcome"] == "recompute"
        assert second["headers"]["X-TurnKV-Reused-Tokens"] == "0" and p[1].stats["pulled"] == 0


async def test_client_disconnect_aborts_both_legs():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, _):
        d[0].fault = {"token_delay": 0.2}
        body = {"model": "tiny", "messages": MSGS, "max_tokens": 50, "stream": True}
        async with s.post("/v1/chat/completions", json=body) as resp:
            await resp.content.readline()
        await asyncio.sleep(0.5)
        assert d[0].stats["aborted"] == 1 and d[0].stats["running"] == 0
        p[0].fault = {"hang": True}
        d[0].fault = {}
        try:
            async with asyncio.timeout(0.5):
                await chat(s, conversation=None)
        except TimeoutError:
            pass
        await asyncio.sleep(0.3)
        assert p[0].stats["aborted"] == 1 and p[0].stats["running"] == 0


async def test_keepalive_comments_before_the_first_token_and_trailing_outcome():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d, tunables={"sse_keepalive": 1}) as (s, _):
        p[0].fault = {"delay": 1.5}
        r = await chat(s, stream=True, conversation="ka")
        assert r["status"] == 200 and r["comments"][0] == ": keepalive"
        assert r["comments"][-1].startswith(": turnkv reuse_outcome=none reused_tokens=0")
        assert r["text"]


async def test_client_leaving_after_a_keepalive_aborts_the_prefill_leg():
    """The keepalive writer runs beside the legs (router.keepalive): a client that goes away after a comment still
    cancels the handler, and with it the prefill under way."""
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d, tunables={"sse_keepalive": 1}) as (s, _):
        p[0].fault = {"hang": True}
        body = {"model": "tiny", "messages": MSGS, "max_tokens": 5, "stream": True}
        async with s.post("/v1/chat/completions", json=body) as resp:
            assert resp.status == 200 and await resp.content.readline() == b": keepalive\n"
        await asyncio.sleep(0.5)
        assert p[0].stats["aborted"] == 1 and p[0].stats["running"] == 0 and d[0].stats["decode"] == 0


async def test_translated_streams_keep_their_sdks_parsing_through_keepalives_and_mid_stream_errors():
    from anthropic import AsyncAnthropic
    from openai import AsyncOpenAI

    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d, tunables={"sse_keepalive": 1}) as (s, _):
        base = str(s._base_url).rstrip("/")
        openai = AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
        claude = AsyncAnthropic(base_url=base, api_key="k", max_retries=0)
        p[0].fault = {"delay": 1.5}  # keepalive comments go out before the first event
        events = [e async for e in await openai.responses.create(model="tiny", input="hi " * 50, stream=True,
                                                                 max_output_tokens=4)]
        assert events[0].type == "response.created" and events[-1].response.output_text
        async with claude.messages.stream(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
                                          ) as stream:
            assert (await stream.get_final_message()).content[0].text
        p[0].fault = {}
        d[0].fault = {"die_after": 2}  # decode dies mid-stream: each SDK raises on its API's error event
        with pytest.raises(openai_errors.APIError):
            async for _ in await openai.responses.create(model="tiny", input="x " * 50, stream=True,
                                                         max_output_tokens=8):
                pass
        with pytest.raises(anthropic_errors.APIStatusError):
            async with claude.messages.stream(model="tiny", max_tokens=8, messages=[{"role": "user", "content": "x"}]
                                              ) as stream:
                await stream.get_final_message()
        await openai.close()
        await claude.close()


async def test_push_mode_dispatches_concurrently_with_one_request_id():
    p, d = engines(1, "prefill", mode="push", bidirectional=False), engines(1, "decode", mode="push",
                                                                            bidirectional=False)
    async with router_over(p, d, mode="push", identity=False) as (s, app):
        r1 = await chat(s, conversation=None)  # identity unknown: serial, then learned
        r2 = await chat(s, conversation=None, stream=True)
        assert r1["status"] == r2["status"] == 200
        reg = app[METRICS].registry
        assert reg.get_sample_value("turnkv_router_push_dispatches_total", {"kind": "serial"}) == 1
        assert reg.get_sample_value("turnkv_router_push_dispatches_total", {"kind": "concurrent"}) == 1
        dp, pp = d[0].seen_params[-1], p[0].seen_params[-1]
        assert dp["remote_engine_id"] == "prefill-0" and dp["transfer_id"] == pp["transfer_id"]
        assert "remote_block_ids" not in dp
        assert p[0].seen_request_ids[-1] == d[0].seen_request_ids[-1] == dp["remote_request_id"]


async def test_push_mode_with_identity_from_discovery_and_a_failing_decode_cancels_prefill():
    p, d = engines(1, "prefill", mode="push"), engines(2, "decode", mode="push")
    async with router_over(p, d, mode="push", identity=True) as (s, app):
        p[0].fault = {"delay": 0.5}
        d[0].fault = {"status": 500}
        app[FLOW].pool.decode[1].outstanding = 5  # the failing engine goes first
        t0 = time.perf_counter()
        r = await chat(s, conversation=None)
        app[FLOW].pool.decode[1].outstanding = 0
        assert r["status"] == 200
        await asyncio.sleep(0.2)
        assert p[0].stats["aborted"] == 1  # the first dispatch's prefill was cancelled
        assert time.perf_counter() - t0 < 3  # not two full prefills plus a decode timeout


async def test_entries_expire_before_the_engine_does():
    store = MemoryStore(100)
    p, d = engines(1, "prefill"), engines(1, "decode", expiry_ttl=16)
    async with router_over(p, d, store=store) as (s, _):
        await chat(s, conversation="exp")
        [entry] = [store.peek(k) for k in store.conversation_keys()]
        # the engine said its blocks live 16 s: the entry goes expiry_margin (10 s) before that
        assert entry.expires_at <= time.time() + 6.1


async def test_all_ejected_engines_are_still_tried_and_no_engine_is_a_503():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, app):
        app[FLOW].pool.decode[0].healthy = False
        assert (await chat(s, conversation=None))["status"] == 200  # panic mode
        app[FLOW].pool.decode[0].healthy = False
        async with s.get("/ready") as ready:
            assert ready.status == 503
        app[FLOW].pool.decode = []
        r = await chat(s, conversation=None)
        assert r["status"] == 503 and "no decode engine known" in r["error"]["error"]["message"]
        async with s.get("/health") as live, s.get("/ready") as ready:
            assert live.status == 200 and (await live.json())["status"] == "degraded"
            assert ready.status == 503


async def test_one_emf_line_per_request_and_the_request_id_in_log_lines(caplog):
    import io
    import logging

    from router import telemetry

    p, d = engines(1, "prefill"), engines(1, "decode")
    p[0].fault = {"status": 500}  # a retry logs a warning
    async with router_over(engines(1, "prefill") + p, d, emf=True) as (s, app):
        app[FLOW].pool.prefill[0].outstanding = 5  # the failing engine goes first
        buf = io.StringIO()
        app[FLOW].emf.stream = buf
        handler_filter = telemetry.RequestIdFilter()
        caplog.handler.addFilter(handler_filter)
        with caplog.at_level(logging.WARNING, logger="turnkv.router"):
            for i in range(2):
                r = await chat(s, conversation=f"emf-{i}", headers={"X-Request-Id": f"rid-{i}"})
                assert r["status"] == 200, r
                assert {k.lower(): v for k, v in r["headers"].items()}["x-request-id"] == f"rid-{i}", r["headers"]
        app[FLOW].emf.flush()
        lines = [orjson.loads(x) for x in buf.getvalue().splitlines()]
        assert [x["request_id"] for x in lines] == ["rid-0", "rid-1"]
        assert lines[0]["_aws"]["CloudWatchMetrics"][0]["Namespace"] == "turnkv/Router"
        assert lines[0]["ReuseOutcome"] == "none" and lines[0]["TTFT"] > 0
        assert lines[0]["session"] == "emf-0" and lines[0]["session_source"] == "body:conversation_id"
        assert [x["retries"] for x in lines] == [1, 1]  # the failing engine stays in the pool (no probe failed)
        # the client's id is echoed and logged, never sent to an engine: each dispatch and retry has its own
        sent = p[0].seen_request_ids + d[0].seen_request_ids
        assert sent and not {"rid-0", "rid-1"} & set(sent) and all(x.startswith("turnkv-") for x in sent)
        assert len(set(p[0].seen_request_ids)) == len(p[0].seen_request_ids) == 2
        warned = [rec for rec in caplog.records if "retrying" in rec.getMessage()]
        assert warned and warned[0].request_id in ("rid-0", "rid-1")


async def test_entries_of_a_decode_engine_ejected_since_are_not_replayed():
    p, d = engines(1, "prefill"), engines(2, "decode")
    async with router_over(p, d) as (s, app):
        first = await chat(s, conversation="crash")
        pool = app[FLOW].pool
        holder = next(e for e in pool.decode if e.name == app[FLOW].store.peek(
            app[FLOW].store.conversation_keys()[0]).decode_engine)
        pool.report_failure(holder)  # it crashed (and may come back with other blocks under the same ids)
        pool.report_success(holder, probe=True)
        pool.report_success(holder, probe=True)
        assert holder.healthy
        second = await chat(s, next_turn(MSGS, first["text"]), conversation="crash")
        assert second["status"] == 200 and second["headers"]["X-TurnKV-Reuse-Outcome"] == "refused"
        assert p[0].seen_params[-1]["remote_block_ids"] is None


async def test_clients_without_any_id_reuse_from_the_second_turn():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, app):
        for stream in (False, True):
            messages = [{"role": "user", "content": f"plain client {stream} " * 100}]
            for turn in range(3):
                r = await chat(s, messages, conversation=None, stream=stream)
                assert r["status"] == 200
                assert r["headers"]["X-TurnKV-Reuse-Outcome"] == ("none" if turn == 0 else "hit"), (stream, turn)
                assert turn == 0 or int(r["headers"]["X-TurnKV-Reused-Tokens"]) > 100
                messages = next_turn(messages, r["text"])
        assert p[0].stats["wrong_reuse"] == 0
        assert app[METRICS].registry.get_sample_value("turnkv_router_session_hints_total",
                                                      {"source": "header:x-session-id"}) == 0


async def test_forks_of_one_history_one_pulls_the_other_recomputes():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, _):
        first = await chat(s, conversation=None)
        a = [*MSGS, {"role": "assistant", "content": first["text"]}, {"role": "user", "content": "branch a"}]
        b = [*MSGS, {"role": "assistant", "content": first["text"]}, {"role": "user", "content": "branch b"}]
        ra, rb = await asyncio.gather(chat(s, a, conversation=None), chat(s, b, conversation=None, stream=True))
        outcomes = sorted([ra["headers"]["X-TurnKV-Reuse-Outcome"], rb["headers"]["X-TurnKV-Reuse-Outcome"]])
        assert outcomes == ["hit", "miss"] and ra["text"] and rb["text"]
        assert p[0].stats["wrong_reuse"] == 0
        # each branch is its own turn from now on
        for branch, reply in ((a, ra), (b, rb)):
            nxt = await chat(s, next_turn(branch, reply["text"]), conversation=None)
            assert nxt["headers"]["X-TurnKV-Reuse-Outcome"] == "hit"


async def test_a_session_hint_steers_decode_but_never_attaches_another_conversations_kv():
    p, d = engines(1, "prefill"), engines(3, "decode")
    async with router_over(p, d) as (s, app):
        pool = app[FLOW].pool
        from router import hints

        target = hints.rendezvous("", "agent-7", [e.name for e in pool.decode])
        mine = await chat(s, conversation=None, headers={"X-Correlation-ID": "agent-7"})
        assert d[[e.name for e in pool.decode].index(target)].stats["decode"] == 1  # first turn: the hint's engine
        # another conversation sends the same (forged or reused) hint: its own history decides, not the hint
        other = [{"role": "user", "content": "other " * 100}, {"role": "assistant", "content": mine["text"]},
                 {"role": "user", "content": "more"}]
        stolen = await chat(s, other, conversation=None, headers={"X-Correlation-ID": "agent-7"})
        assert stolen["headers"]["X-TurnKV-Reuse-Outcome"] == "miss"
        assert p[0].seen_params[-1]["remote_block_ids"] is None
        own = await chat(s, next_turn(MSGS, mine["text"]), conversation=None, headers={"X-Correlation-ID": "agent-7"})
        assert own["headers"]["X-TurnKV-Reuse-Outcome"] == "hit" and p[0].stats["wrong_reuse"] == 0
        assert app[METRICS].registry.get_sample_value("turnkv_router_session_hints_total",
                                                      {"source": "header:x-correlation-id"}) == 3


async def test_completion_sessions_need_a_hint_and_reuse_only_an_exact_prefix():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, _):
        async def complete(prompt, **headers):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 4}
            async with s.post("/v1/completions", json=body, headers=headers) as resp:
                return resp.headers["X-TurnKV-Reuse-Outcome"], (await resp.json())["choices"][0]["text"]

        prompt = "once upon a time " * 50
        assert (await complete(prompt))[0] == "none"  # no turn boundaries and no session: nothing to address
        outcome, text = await complete(prompt, **{"X-Session-ID": "s1"})
        assert outcome == "miss"  # the session's slot is empty
        assert (await complete(prompt + "EDITED" + text + " more", **{"X-Session-ID": "s1"}))[0] == "mismatch"
        outcome, text = await complete(prompt, **{"X-Session-ID": "s2"})
        assert (await complete(prompt + text + " more", **{"X-Session-ID": "s2"}))[0] == "hit"
        assert p[0].stats["wrong_reuse"] == 0


async def test_responses_and_messages_refuse_what_they_cannot_honour_by_name():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, _):
        async with s.post("/v1/responses", json={"model": "tiny", "input": "hi", "previous_response_id": "r1"}) as r:
            assert r.status == 400 and "'r1' not found" in (await r.json())["error"]["message"]
        async with s.post("/v1/messages", json={"model": "tiny", "max_tokens": 4, "top_logprobs": 2,
                                                "messages": [{"role": "user", "content": "hi"}]}) as r:
            body = await r.json()  # Anthropic's error shape
            assert r.status == 400 and body["type"] == "error" and "top_logprobs" in body["error"]["message"]
        async with s.get("/v1/responses/resp_1") as r:
            assert r.status == 501 and "retrieving stored responses" in (await r.json())["error"]["message"]
        assert p[0].stats["requests"] == d[0].stats["requests"] == 0


async def test_the_responses_and_anthropic_sdks_reuse_over_fake_engines():
    from anthropic import AsyncAnthropic
    from openai import AsyncOpenAI

    p, d = engines(1, "prefill"), engines(1, "decode")
    keys = ApiKeys(parse_keys("acme:acme-key-0123456789\n"))
    async with router_over(p, d, keys=keys) as (s, _):
        base = str(s._base_url).rstrip("/")
        openai = AsyncOpenAI(base_url=base + "/v1", api_key="acme-key-0123456789", max_retries=0)
        claude = AsyncAnthropic(base_url=base, api_key="acme-key-0123456789", max_retries=0)  # x-api-key
        for stream in (False, True):
            items: list = [{"role": "user", "content": f"responses {stream} " * 200}]
            messages: list = [{"role": "user", "content": f"messages {stream} " * 200}]
            outcomes = {"responses": [], "messages": []}
            for _ in range(3):
                raw = await openai.responses.with_raw_response.create(model="tiny", input=items, stream=stream,
                                                                      max_output_tokens=4, store=False)
                if stream:
                    done = [e async for e in raw.parse() if e.type in ("response.completed", "response.incomplete")]
                    response = done[0].response
                else:
                    response = raw.parse()
                assert response.output_text
                outcomes["responses"].append(raw.headers["X-TurnKV-Reuse-Outcome"])
                items = [*items, *response.output, {"role": "user", "content": "and then?"}]
                if stream:
                    async with claude.messages.stream(model="tiny", max_tokens=4, messages=messages) as events:
                        message = await events.get_final_message()
                        outcome = events.response.headers["X-TurnKV-Reuse-Outcome"]
                else:
                    raw = await claude.messages.with_raw_response.create(model="tiny", max_tokens=4,
                                                                         messages=messages)
                    message, outcome = await raw.parse(), raw.headers["X-TurnKV-Reuse-Outcome"]
                assert message.content[0].text and message.stop_reason == "max_tokens"
                outcomes["messages"].append(outcome)
                messages = [*messages, {"role": "assistant", "content": message.content},
                            {"role": "user", "content": "and then?"}]
            assert outcomes == {"responses": ["none", "hit", "hit"], "messages": ["none", "hit", "hit"]}, stream
        await openai.close()
        await claude.close()
        assert p[0].stats["wrong_reuse"] == 0


async def test_responses_continued_by_previous_response_id_reuse_and_stay_in_their_tenant():
    """The Responses API's own way to continue (previous_response_id, store defaulting to true): the router keeps
    the conversation, the next turn renders the same prompt and pulls; an id is useless to another tenant, and a
    response sent with store: false is not kept."""
    from openai import AsyncOpenAI, BadRequestError

    p, d = engines(1, "prefill"), engines(1, "decode")
    keys = ApiKeys(parse_keys("acme:acme-key-0123456789\nglobex:globex-key-0123456789\n"))
    async with router_over(p, d, keys=keys) as (s, _):
        base = str(s._base_url).rstrip("/") + "/v1"
        acme = AsyncOpenAI(base_url=base, api_key="acme-key-0123456789", max_retries=0)
        globex = AsyncOpenAI(base_url=base, api_key="globex-key-0123456789", max_retries=0)
        for stream in (False, True):
            previous, outcomes = None, []
            for turn in range(3):
                text = f"previous id {stream} " * 200 if turn == 0 else f"and then {turn}?"
                raw = await acme.responses.with_raw_response.create(
                    model="tiny", instructions="be brief", input=text, stream=stream, max_output_tokens=4,
                    **({"previous_response_id": previous} if previous else {}))
                if stream:
                    done = [e async for e in raw.parse() if e.type in ("response.completed", "response.incomplete")]
                    response = done[0].response
                else:
                    response = raw.parse()
                assert response.output_text and response.store and response.previous_response_id == previous
                outcomes.append(raw.headers["X-TurnKV-Reuse-Outcome"])
                previous = response.id
            assert outcomes == ["none", "hit", "hit"], (stream, outcomes)
            try:
                await globex.responses.create(model="tiny", input="mine now?", previous_response_id=previous,
                                              max_output_tokens=4)
                raise AssertionError("another tenant continued acme's response")
            except BadRequestError as exc:
                assert "not found" in str(exc)
        unkept = await acme.responses.create(model="tiny", input="forget me", store=False, max_output_tokens=4)
        assert unkept.store is False
        try:
            await acme.responses.create(model="tiny", input="x", previous_response_id=unkept.id, max_output_tokens=4)
            raise AssertionError("a store: false response was kept")
        except BadRequestError as exc:
            assert "not found" in str(exc)
        await acme.close()
        await globex.close()
        assert p[0].stats["wrong_reuse"] == 0


async def test_the_openai_sdk_with_no_field_reuses_over_fake_engines():
    from openai import AsyncOpenAI

    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, _):
        client = AsyncOpenAI(base_url=str(s._base_url).rstrip("/") + "/v1", api_key="unused", max_retries=0)
        for stream in (False, True):
            messages = [{"role": "user", "content": f"sdk {stream} " * 200}]
            outcomes = []
            for _ in range(3):
                raw = await client.chat.completions.with_raw_response.create(
                    model="tiny", messages=messages, max_tokens=4, stream=stream)
                if stream:
                    text = "".join([c.choices[0].delta.content or "" async for c in raw.parse() if c.choices])
                    reply = {"role": "assistant", "content": text}
                else:
                    reply = raw.parse().choices[0].message  # appended as the SDK returns it
                outcomes.append(raw.headers["X-TurnKV-Reuse-Outcome"])
                messages = [*messages, reply, {"role": "user", "content": "and then?"}]
            assert outcomes == ["none", "hit", "hit"], (stream, outcomes)
        await client.close()
        assert p[0].stats["wrong_reuse"] == 0


async def test_engine_load_is_given_back_on_every_way_a_leg_ends():
    """Load accounting (requests and prompt tokens in flight per engine) must return to zero after successes,
    prefill errors retried elsewhere, decode hangs timed out, decode dying mid-stream (with migration) and
    clients leaving mid-stream: a leaked count would steer least-load away from an idle engine forever."""
    p, d = engines(2, "prefill"), engines(2, "decode")
    async with router_over(p, d, tunables={"first_token_timeout": 1}) as (s, app):
        pool = app[FLOW].pool
        assert (await chat(s, conversation=None, stream=True))["status"] == 200
        assert (await chat(s, conversation=None))["status"] == 200
        p[0].fault = {"status": 500}
        pool.prefill[1].outstanding = 5  # the failing engine goes first
        assert (await chat(s, conversation=None, stream=True))["status"] == 200
        pool.prefill[1].outstanding = 0
        p[0].fault = {}
        d[0].fault = {"hang": True}
        pool.decode[1].outstanding = 5
        assert (await chat(s, conversation=None, stream=True))["status"] == 200
        pool.decode[1].outstanding = 0
        d[0].fault = {"die_after_first": True}
        pool.decode[1].outstanding = 5
        assert (await chat(s, conversation=None, stream=True, max_tokens=8))["status"] == 200
        pool.decode[1].outstanding = 0
        d[0].fault = {"token_delay": 0.2}
        pool.decode[1].outstanding = 5
        body = {"model": "tiny", "messages": MSGS, "max_tokens": 50, "stream": True}
        async with s.post("/v1/chat/completions", json=body) as resp:
            await resp.content.readline()  # then the client leaves
        pool.decode[1].outstanding = 0
        await asyncio.sleep(0.5)
        assert [(e.name, e.outstanding, e.outstanding_tokens) for e in pool.all] == [
            (e.name, 0, 0) for e in pool.all]


async def test_legs_reuse_their_engine_connections_after_a_stream_ends():
    """A decode stream read to its end gives its connection back, as a unary leg does: a connection per stream
    cost the router a connect and the engine an accept and a close per request (about 16% of the router's CPU
    at 16 reply tokens). A stream cut short must still close its connection (vLLM aborts on it)."""
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, _app):
        for n in range(4):
            answer = await chat(s, conversation=f"reuse-{n}", stream=n % 2 == 0)
            assert answer["status"] == 200 and answer["text"]
        assert d[0].stats["requests"] == 4 and len(d[0].peers) == 1
        assert p[0].stats["requests"] == 4 and len(p[0].peers) == 1
        d[0].fault = {"token_delay": 0.2}
        body = {"model": "tiny", "messages": MSGS, "max_tokens": 50, "stream": True}
        async with s.post("/v1/chat/completions", json=body) as resp:
            await resp.content.readline()  # the client leaves mid-stream: decode's connection is closed
        for _ in range(50):
            if d[0].stats["aborted"]:
                break
            await asyncio.sleep(0.05)
        assert d[0].stats["aborted"] == 1
        d[0].fault = {}
        assert (await chat(s, conversation="reuse-after", stream=True))["status"] == 200
        assert len(d[0].peers) == 2  # the cut connection was not reused


async def test_streamed_events_reach_the_client_framed_without_the_params_chunk():
    """Decode's params-only chunk is cut with the blank line that ended it: the client reads whole events only."""
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, _):
        for conversation in ("framed", None):  # retained (lines parsed) and not (lines passed through)
            r = await chat(s, conversation=conversation, stream=True, max_tokens=6)
            assert r["status"] == 200 and b"kv_transfer_params" not in r["raw"]
            assert r["raw"].endswith(b"\n\ndata: [DONE]\n\n") and b"\n\n\n" not in r["raw"]
            events = r["raw"].split(b"\n\n")[:-1]
            assert all(e.startswith((b"data: ", b": ")) for e in events), events
            assert len(r["events"]) >= 6  # every token's event arrived
    assert d[0].stats["requests"] == 2
