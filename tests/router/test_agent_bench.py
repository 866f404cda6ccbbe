"""bench.agent_bench plays an agent trace through the real router over fake engines (loopback, seconds)."""

from __future__ import annotations

from collections import defaultdict

import orjson
from aiohttp import web

from bench import agent_bench, agent_report, agent_trace
from tests.conftest import free_port
from tests.router.conftest import engines, router_over

TINY = {"format": agent_trace.FORMAT, "name": "tiny", "seed": 5, "sessions": 2, "steps": 5, "max_tokens": 4,
        "shared_prefix_words": 60, "task_words": 20, "step_weights": {"tool": 1, "fork": 1},
        "tool": {"calls": 2, "result_words": 10}, "fork": {"branches": 3, "words": 3},
        "subagent": {"session_share": 0.5, "count": 2, "steps": 2, "task_words": 8},
        "think_s": {"tool": 0.05, "fork": 0.01}}


def groups(records, kind):
    out = defaultdict(list)
    for r in records:
        if r.kind == kind:
            out[(r.arm, r.session, r.step)].append(r)
    return out


async def test_a_trace_plays_through_the_router_with_forks_and_subagents_at_once():
    sessions = agent_trace.expand(agent_trace.AgentTrace.from_dict(TINY))
    shape = agent_trace.stats(sessions)
    assert shape.kinds.get("fork", 0) >= 3 and shape.kinds["subagent"] == 2 and shape.kinds["join"] == 1
    # decode waits before its first token, so requests sent one after the other could not overlap
    # decode keeps a read turn for forks (fork_window, as the connector's default does)
    p, d = engines(1, "prefill"), engines(1, "decode", request_marker=False, fault={"delay": 0.15}, fork_window=30.0)
    async with router_over(p, d) as (s, _):
        spec = agent_bench.PlaySpec(url=str(s._base_url), arms=("off", "on"), time_scale=1.0)
        seen = []
        records = await agent_bench.play(sessions, spec, seen.append)
    assert len(records) == len(seen) == agent_bench.total_requests(sessions, spec.arms)
    assert all(r.error is None for r in records), [r.error for r in records if r.error][:3]
    for r in records:
        assert r.ttft_ms is not None and r.latency_ms >= r.ttft_ms >= 150 and r.ended_s > r.started_s >= 0
        assert r.reply and len(r.reply_sha) == 16 and r.prefill_cached_tokens == 0  # this router sends no such header
        assert r.kind in agent_trace.REQUEST_KINDS
    off = [r for r in records if r.arm == "off"]
    on = [r for r in records if r.arm == "on"]
    assert {r.reuse_outcome for r in off} == {"disabled"} and not any(r.reused_tokens for r in off)
    # every later main-agent turn that is not a fork branch continues the turn before it: found by content, pulled
    later = [r for r in on if r.agent == "main" and r.kind in ("tool", "user")]
    assert later and all(r.reuse_outcome == "hit" and r.reused_tokens > 0 for r in later)
    assert {r.reuse_outcome for r in on if r.kind == "task"} == {"none"}
    # forks: the branches were in flight together, and every branch pulls the turn they fork from
    forks = groups(records, "fork")
    for branches in forks.values():
        assert len(branches) == 3
        assert max(b.started_s for b in branches) < min(b.ended_s for b in branches)
    for (arm, _, _), branches in forks.items():
        assert sum(b.reused_tokens > 0 for b in branches) == (3 if arm == "on" else 0)
    # subagents started together from the parent's history; the parent resumed after both had finished
    subs = [r for r in records if r.agent.startswith("sub")]
    for arm in ("off", "on"):
        firsts = [r for r in subs if r.arm == arm and r.kind == "subagent"]
        assert len(firsts) == 2 and max(r.started_s for r in firsts) < min(r.ended_s for r in firsts)
        (join,) = [r for r in records if r.arm == arm and r.kind == "join"]
        assert join.started_s >= max(r.ended_s for r in subs if r.arm == arm)
    assert sum(r.reused_tokens > 0 for r in subs if r.arm == "on" and r.kind == "subagent") == 2
    (join,) = [r for r in on if r.kind == "join"]
    assert join.reuse_outcome == "hit"  # the parent's turn the subagents started from, read once more
    summary = agent_report.summarize(records)
    assert summary["answers"]["compared"] == len(on) == summary["answers"]["identical"]
    on_summary = summary["per_arm"]["on"]
    assert on_summary["fork_turns_pulled"] == on_summary["fork_turns"] == 3 * len(forks) // 2
    assert p[0].stats["stale_reads"] == 0


async def test_the_prefill_cache_header_and_usage_are_recorded():
    """A router that sends X-TurnKV-Prefill-Cached-Tokens (and usage in the stream) has both recorded."""
    seen = []

    async def models(_):
        return web.json_response({"data": [{"id": "m"}]})

    async def chat(request):
        body = orjson.loads(await request.read())
        seen.append((dict(request.headers), body))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-TurnKV-Reused-Tokens": "0",
                                           "X-TurnKV-Reuse-Outcome": "none",
                                           agent_bench.PREFILL_CACHED_HEADER: "7"})
        await resp.prepare(request)
        for chunk in ({"choices": [{"delta": {"content": "hi "}}]}, {"choices": [{"delta": {"content": "there"}}]},
                      {"choices": [], "usage": {"prompt_tokens": 42, "completion_tokens": 2}}):
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        trace = agent_trace.AgentTrace.from_dict({**TINY, "sessions": 1, "steps": 2, "step_weights": {"tool": 1},
                                                  "subagent": {}, "think_s": {}})
        records = await agent_bench.play(agent_trace.expand(trace),
                                         agent_bench.PlaySpec(url=f"http://127.0.0.1:{port}", arms=("off", "on"),
                                                              api_key="k"))
    finally:
        await runner.cleanup()
    assert [(r.arm, r.step, r.kind) for r in records] == [("off", 0, "task"), ("off", 1, "tool"), ("on", 0, "task"),
                                                          ("on", 1, "tool")]
    assert all(r.prefill_cached_tokens == 7 and r.prompt_tokens == 42 and r.reply == "hi there" for r in records)
    headers = [h for h, _ in seen]
    assert [h.get("X-TurnKV-Reuse") for h in headers] == ["off", "off", None, None]
    assert all(h["Authorization"] == "Bearer k" for h in headers)
    # the second turn sends the reply back unchanged, then the tool results as user messages
    _, body = seen[1]
    assert body["model"] == "m" and body["temperature"] == 0 and body["stream"] is True
    assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "user", "user"]
    assert body["messages"][2] == {"role": "assistant", "content": "hi there"}
    assert body["messages"][3]["content"].startswith("tool result ( ")
