"""Requests of several sequences over fake engines (router.choices; issue #50, and #51 item 5).

One P/D pair carries the KV of one engine request, so: ``n > 1``, beam search and ``best_of`` go to decode alone (no
prefill leg, no kv_transfer_params), and a /v1/completions list of prompts is one P/D pair per prompt, the answers
merged in vLLM's shape (streamed and not). A request holds one unit of the decode pool per sequence it asks for, at
most ``max_choices`` of them."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from router.app import FLOW, METRICS
from router.auth import ApiKeys, parse_keys
from tests.router.conftest import engines, router_over
from tests.router.test_flow_fake import MSGS, chat
from turnkv import params

PROMPTS = ["the first prompt " * 20, "a second, different prompt " * 15, "third " * 40]
TOKEN_PROMPTS = [[11, 12, 13, 14] * 10, [21, 22, 23] * 12, [31, 32] * 30]
USAGE = {"stream_options": {"include_usage": True}}
SEVERAL = "turnkv_router_several_sequences_total"


async def complete(s, prompt: Any, stream: bool = False, headers: dict[str, str] | None = None, **extra) -> dict:
    """A /v1/completions request: status, headers, and the answer (``body``) or its stream's ``events`` (without
    ``[DONE]``, counted in ``done``)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "stream": stream, **extra}
    async with s.post("/v1/completions", json=body, headers=headers or {}) as resp:
        raw = await resp.read()
    out: dict[str, Any] = {"status": resp.status, "headers": dict(resp.headers), "raw": raw}
    if resp.status != 200:
        out["error"] = orjson.loads(raw)["error"]
    elif not stream:
        out["body"] = orjson.loads(raw)
    else:
        data = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]
        out["done"], out["last_is_done"] = data.count(b"[DONE]"), data[-1] == b"[DONE]"
        out["events"] = [orjson.loads(e) for e in data if e != b"[DONE]"]
    return out


def texts(answer: dict) -> dict[int, str]:
    """Each choice's text by index, from a unary answer or a whole stream."""
    out: dict[int, str] = {}
    for event in [answer["body"]] if "body" in answer else answer["events"]:
        for choice in event.get("choices") or ():
            out[choice["index"]] = out.get(choice["index"], "") + choice["text"]
    return out


def usage(answer: dict) -> dict:
    if "body" in answer:
        return answer["body"]["usage"]
    [last] = [e for e in answer["events"] if not e.get("choices") and e.get("usage")]
    return last["usage"]


def key(prompt: Any) -> bytes:
    return orjson.dumps(prompt)


# -- a list of prompts: one P/D pair per prompt --------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("prompts", [PROMPTS, TOKEN_PROMPTS], ids=["strings", "token_lists"])
async def test_a_list_of_prompts_is_one_pd_pair_per_prompt_merged_as_vllm_answers_it(stream, prompts):
    p, d = engines(1, "prefill", request_marker=False), engines(1, "decode", request_marker=False)
    async with router_over(p, d) as (s, app):
        alone = [await complete(s, prompt, stream, **USAGE) for prompt in prompts]
        for engine in (*p, *d):
            engine.seen_bodies.clear()
            engine.seen_request_ids.clear()
        listed = await complete(s, prompts, stream, **USAGE)
        assert listed["status"] == 200, listed
        # the engines: one prefill leg per prompt, each with that prompt alone...
        prefilled = dict(zip(p[0].seen_request_ids, (b["prompt"] for b in p[0].seen_bodies), strict=True))
        assert sorted(map(key, prefilled.values())) == sorted(map(key, prompts))
        # ...and one decode leg per prompt, each reading the blocks of its own prompt's prefill, none shared
        assert sorted(map(key, (b["prompt"] for b in d[0].seen_bodies))) == sorted(map(key, prompts))
        read = [b["kv_transfer_params"]["remote_request_id"] for b in d[0].seen_bodies]
        assert len(set(read)) == len(prompts)
        assert all(prefilled[rid] == b["prompt"] for rid, b in zip(read, d[0].seen_bodies, strict=True))
        assert len({key(b["kv_transfer_params"]["remote_block_ids"]) for b in d[0].seen_bodies}) == len(prompts)
        # the answer: vLLM's to a list: choice i is prompt i's, as the prompt alone gets it; usage summed
        assert texts(listed) == {i: texts(a)[0] for i, a in enumerate(alone)}
        assert usage(listed) == {k: sum(usage(a)[k] for a in alone)
                                 for k in ("prompt_tokens", "total_tokens", "completion_tokens")}
        assert b"kv_transfer_params" not in listed["raw"]
        if stream:
            assert listed["done"] == 1 and listed["last_is_done"]
            assert len({e["id"] for e in listed["events"]}) == 1, "one stream id, as vLLM's"
            assert listed["events"][-1]["choices"] == [], "the summed usage chunk comes last"
        else:
            assert [c["index"] for c in listed["body"]["choices"]] == [0, 1, 2]
            assert listed["body"]["object"] == "text_completion"
        assert app[METRICS].registry.get_sample_value(SEVERAL, {"served": "per_prompt"}) == 1
        assert app[FLOW].decode_gate.queue.total == 0 and app[FLOW].engine_gate.queue.total == 0


async def test_a_flat_list_of_token_ids_is_one_prompt_and_one_pd_pair():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, _):
        ids = [5, 6, 7, 8] * 20
        answer = await complete(s, ids)
        assert answer["status"] == 200 and [c["index"] for c in answer["body"]["choices"]] == [0]
        assert [b["prompt"] for b in p[0].seen_bodies] == [ids] and [b["prompt"] for b in d[0].seen_bodies] == [ids]
        assert d[0].seen_bodies[0]["kv_transfer_params"]["remote_request_id"] == p[0].seen_request_ids[0]


async def test_a_prompt_that_fails_mid_stream_ends_the_merged_stream_with_one_error_and_done():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, app):
        d[0].fault = {"midstream_error": True}
        answer = await complete(s, PROMPTS, stream=True)
        assert answer["status"] == 200 and answer["done"] == 1 and answer["last_is_done"]
        errors = [e for e in answer["events"] if "error" in e]
        assert len(errors) == 1 and "remote_host" not in str(errors[0]), "redacted, as every engine error"
        assert app[FLOW].decode_gate.queue.total == 0


async def test_a_prompt_whose_legs_fail_fails_the_whole_list_and_leaves_nothing_held():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, app):
        d[0].fault = {"status": 400}
        for stream in (False, True):
            answer = await complete(s, PROMPTS, stream=stream)
            assert answer["status"] == 400
        flow = app[FLOW]
        assert flow.decode_gate.queue.total == 0 and flow.engine_gate.queue.total == 0
        assert d[0].stats["running"] == 0


# -- n > 1, beam search, best_of: decode alone ----------------------------------------------------------------------

ALONE = [
    ("chat", {"n": 3}),
    ("chat", {"n": 2, "seed": 7, "temperature": 0.8}),
    ("chat", {"best_of": 3}),
    ("completion", {"n": 4}),
    ("completion", {"n": 2, "prompt": PROMPTS}),  # a list with n > 1: decode alone, prompts and children as sent
    ("completion", {"use_beam_search": True, "n": 2}),
]


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("route,extra", ALONE, ids=[f"{r}-{'-'.join(e)}" for r, e in ALONE])
async def test_several_sequences_go_to_decode_alone_without_kv_transfer_params(route, extra, stream):
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, app):
        if route == "chat":
            answer = await chat(s, stream=stream, conversation=None, **extra)
        else:
            answer = await complete(s, extra.pop("prompt", PROMPTS[0]), stream, **extra)
        assert answer["status"] == 200
        assert p[0].stats["requests"] == 0, "no prefill leg: its KV would serve one sequence of one prompt"
        [sent] = d[0].seen_bodies
        assert "kv_transfer_params" not in sent, "decode computes the prompt itself"
        assert {k: sent[k] for k in extra} == extra, "the client's request, as it sent it"
        assert sent["stream"] is stream and sent["max_tokens"] == (4 if route == "chat" else 6)
        assert answer["headers"]["X-TurnKV-Reuse-Outcome"] == "none"
        assert app[METRICS].registry.get_sample_value(SEVERAL, {"served": "decode_alone"}) == 1
        assert app[FLOW].decode_gate.queue.total == 0


async def test_a_chat_turn_of_several_choices_is_not_stored_for_reuse():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, _):
        first = await chat(s, n=2)
        assert first["status"] == 200
        follow = [*MSGS, {"role": "assistant", "content": first["text"]}, {"role": "user", "content": "more"}]
        second = await chat(s, follow)
        assert second["headers"]["X-TurnKV-Reuse-Outcome"] == "miss"
        assert "retain" not in str(d[0].seen_bodies[0]), "decode was not asked to keep the turn"


@pytest.mark.parametrize("path,body", [
    ("/v1/responses", {"model": "tiny", "input": "hi", "n": 2}),
    ("/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "n": 2}),
])
async def test_the_translated_apis_carry_no_n(path, body):
    """Responses and Anthropic Messages have no n: refused naming the field (never silently one sequence)."""
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, _):
        async with s.post(path, json=body) as resp:
            assert resp.status == 400 and "'n'" in (await resp.text())
        assert p[0].stats["requests"] == d[0].stats["requests"] == 0


# -- max_choices and the decode pool's units ------------------------------------------------------------------------

async def test_more_choices_than_max_choices_are_refused_400_naming_it():
    default = int(params.get("max_choices").default)
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, _):
        for answer in (await chat(s, conversation=None, n=default + 1),
                       await complete(s, PROMPTS, n=default // 2),  # 3 prompts x 64
                       await complete(s, ["p"] * (default + 1))):
            error = answer["error"].get("error", answer["error"])  # chat() keeps the whole body
            assert answer["status"] == 400 and error["limit"] == "max_choices", answer
            assert f"max_choices is {default}" in error["message"]
        assert (await chat(s, conversation=None, n=default))["status"] == 200
        assert p[0].stats["requests"] == 0 and d[0].stats["requests"] == 1
    async with router_over(engines(1, "prefill"), engines(1, "decode"),
                           tunables={"max_choices": default * 2}) as (s, _):
        assert (await chat(s, conversation=None, n=default + 1))["status"] == 200


KEYS = ApiKeys(parse_keys('{"tenants": {"light": "light-key-0001", "heavy": "heavy-key-0001"}}'))
LIGHT = {"Authorization": "Bearer light-key-0001"}
HEAVY = {"Authorization": "Bearer heavy-key-0001"}
PREFILL_OFF = int(params.get("prefill_fair_tokens").maximum)


async def _in_flight(d, count: int) -> None:
    for _ in range(50):
        if d.stats["running"] >= count:
            return
        await asyncio.sleep(0.02)


async def test_a_request_holds_one_decode_unit_per_sequence_it_asks_for():
    """decode_fair_sequences 4: a heavy tenant's request of n 4 fills the pool, so its next request waits in the router
    while a light tenant's goes at once (one unit per request let 65,536 sequences in with four requests of n
    16,384). A list of prompts holds one per prompt; a request asking for more than the pool still goes, alone."""
    p, d = engines(1, "prefill"), engines(1, "decode")
    tunables = {"decode_fair_sequences": 4, "prefill_fair_tokens": PREFILL_OFF}
    async with router_over(p, d, keys=KEYS, tunables=tunables) as (s, app):
        gate = app[FLOW].decode_gate.queue
        d[0].fault = {"delay": 0.6}
        big = asyncio.create_task(chat(s, conversation=None, headers=HEAVY, n=4))
        await _in_flight(d[0], 1)
        assert gate.held("heavy") == 4
        more = asyncio.create_task(chat(s, conversation=None, headers=HEAVY))
        await asyncio.sleep(0.1)
        assert gate.waiting_of("heavy") == 1 and d[0].stats["running"] == 1, "the heavy tenant's next one waits"
        light = asyncio.create_task(chat(s, conversation=None, headers=LIGHT))
        await _in_flight(d[0], 2)
        assert d[0].stats["running"] == 2 and gate.waiting_of("light") == 0, "the light tenant's goes at once"
        assert [(await t)["status"] for t in (big, more, light)] == [200] * 3
        listed = asyncio.create_task(complete(s, PROMPTS, headers=LIGHT))
        await _in_flight(d[0], 3)
        assert gate.held("light") == 3
        assert (await listed)["status"] == 200
        d[0].fault = {}
        assert (await chat(s, conversation=None, headers=HEAVY, n=40))["status"] == 200, "more than the pool: alone"
        assert gate.total == 0 and gate.waiting == 0
