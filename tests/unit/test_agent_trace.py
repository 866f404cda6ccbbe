"""bench.agent_trace: the agent-trace format, its validation and its deterministic expansion (no servers)."""

from __future__ import annotations

import json
import string

import pytest

from bench import agent_trace as at
from turnkv.local.model import COMMON_WORDS, PUNCTUATION


def conf(**over) -> dict:
    base = {"format": at.FORMAT, "name": "t", "seed": 3, "sessions": 4, "steps": {"distribution": "constant",
                                                                                  "value": 6},
            "max_tokens": 8, "shared_prefix_words": 120, "task_words": 20,
            "step_weights": {"tool": 1}, "tool": {"calls": 2, "result_words": 10}}
    return {**base, **over}


def trace(**over) -> at.AgentTrace:
    return at.AgentTrace.from_dict(conf(**over))


def test_expansion_is_deterministic_and_per_session():
    t = trace(step_weights={"tool": 3, "user": 1, "fork": 1}, subagent={"session_share": 0.5})
    assert at.expand(t) == at.expand(t)
    other = at.expand(trace(seed=4, step_weights={"tool": 3, "user": 1, "fork": 1}, subagent={"session_share": 0.5}))
    assert other != at.expand(t)
    # a session draws from its own generator: more sessions leave the first ones as they were (subagents off, as
    # their placement is drawn over the whole trace)
    few, more = at.expand(trace(sessions=2)), at.expand(trace(sessions=5))
    assert more[:2] == few


def test_every_session_shares_the_prefix_and_opens_with_a_task():
    sessions = at.expand(trace())
    assert len({s.system for s in sessions}) == 1
    assert len(sessions[0].system.split()) == 120
    assert all(f"function {tool} (" in sessions[0].system for tool in at.TOOL_NAMES[:5])
    for s in sessions:
        first = s.main.steps[0]
        assert first.kind == "task" and first.messages[0]["content"].startswith("task : ")
        assert len(s.main.steps) == 6 and s.max_tokens == 8


def test_parallel_tool_calls_are_user_messages_naming_the_tool():
    step = at.expand(trace())[0].main.steps[1]
    assert step.kind == "tool" and len(step.messages) == 2
    for m in step.messages:
        assert m["role"] == "user" and m["content"].startswith("tool result ( ")
        assert m["content"].split()[3] in at.TOOL_NAMES[:5]


def test_fork_expands_to_distinct_branches_from_one_history():
    t = trace(step_weights={"fork": 1}, fork={"branches": 3, "words": 5})
    s = at.expand(t)[0]
    forks = [step for step in s.main.steps if step.kind == "fork"]
    assert len(forks) == 5
    for f in forks:
        assert len(f.branches) == 3 and not f.messages
        assert len({b[0]["content"] for b in f.branches}) == 3
        assert [b[0]["content"].split()[:3] for b in f.branches] == [["step", str(i), ":"] for i in (1, 2, 3)]
    assert s.requests() == 1 + 5 * 3
    assert at.stats([s]).kinds == {"task": 1, "fork": 15}


def test_subagents_start_from_the_parent_in_the_share_of_sessions_and_join_it():
    t = trace(sessions=9, subagent={"session_share": 0.44, "count": 2, "steps": 3, "task_words": 7})
    sessions = at.expand(t)
    spawning = [s for s in sessions if any(step.children for step in s.main.steps)]
    assert len(spawning) == 4  # round(0.44 * 9)
    for s in spawning:
        (step,) = [step for step in s.main.steps if step.children]
        assert step.kind == "subagent" and len(step.children) == 2
        for child in step.children:
            assert child.name.startswith("sub") and [x.kind for x in child.steps] == ["subagent", "tool", "tool"]
            assert child.steps[0].messages[0]["content"].startswith("agent task : ")
        # 5 plain steps + 2 children x 3 turns + the parent's join
        assert s.requests() == 5 + 6 + 1
    assert at.stats(sessions).sessions_with_subagents == 4
    assert at.join_messages(["a b", "c"]) == ({"role": "user", "content": "tool result ( agent ) : a b"},
                                              {"role": "user", "content": "tool result ( agent ) : c"})


def test_think_times_by_kind_are_seeded_and_bounded():
    t = trace(think_s={"task": 0.5, "tool": {"distribution": "lognormal", "average": 4, "max": 9}})
    sessions = at.expand(t)
    assert all(s.main.steps[0].think_s == 0.5 == s.start_s() for s in sessions)
    tool = [step.think_s for s in sessions for step in s.main.steps if step.kind == "tool"]
    assert all(0 < x <= 9 for x in tool) and len(set(tool)) > 5  # drawn one by one, not rescaled to a constant
    assert tool == [step.think_s for s in at.expand(t) for step in s.main.steps if step.kind == "tool"]
    assert all(step.think_s == 0 for s in at.expand(trace()) for step in s.main.steps)  # none given: no pause


@pytest.mark.parametrize(("change", "message"), [
    ({"format": "x"}, "format: expected 'turnkv-agent-trace/1'"),
    ({"sessions": 0}, "sessions: expected an integer >= 1, got 0"),
    ({"sessions": "4"}, "sessions: expected an integer >= 1"),
    ({"step": 3}, "unknown field 'step'"),
    ({"tool": {"calls": 2, "result_word": 3}}, "unknown field 'tool.result_word'"),
    ({"tool": {"calls": {"distribution": "normal"}}}, "tool.calls: unknown distribution 'normal'"),
    ({"think_s": {"tool": {"distribution": "uniform", "min": 3}}}, "think_s.tool: uniform needs max"),
    ({"think_s": {"typing": 1}}, "think_s.typing: unknown step kind"),
    ({"step_weights": {"subagent": 1}}, "step_weights.subagent: unknown step kind"),
    ({"step_weights": {"tool": 0}}, "step_weights: at least one weight must be above 0"),
    ({"subagent": {"session_share": 1.5}}, "subagent.session_share: expected a number in [0, 1]"),
    ({"tools": []}, "tools: expected a non-empty list"),
    ({"max_tokens": -1}, "max_tokens: expected an integer >= 1"),
])
def test_validation_names_the_field(change, message):
    with pytest.raises(at.TraceError, match=None) as err:
        at.AgentTrace.from_dict(conf(**change))
    assert message in str(err.value)


def test_missing_fields_and_bad_files_are_named(tmp_path):
    for key in ("sessions", "steps", "task_words"):
        broken = conf()
        del broken[key]
        with pytest.raises(at.TraceError, match=f"missing field '{key}'"):
            at.AgentTrace.from_dict(broken)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(at.TraceError, match=r"bad\.json: not JSON"):
        at.load(bad)
    bad.write_text(json.dumps(conf(sessions=0)))
    with pytest.raises(at.TraceError, match=r"bad\.json: sessions: expected"):
        at.load(bad)
    with pytest.raises(at.TraceError, match=r"no such trace file .*agent-coding"):
        at.load(tmp_path / "missing.json")


def texts_of(agent: at.Agent) -> list[str]:
    out = []
    for step in agent.steps:
        out += [m["content"] for m in step.messages] + [m["content"] for b in step.branches for m in b]
        for child in step.children:
            out += texts_of(child)
    return out


def test_shipped_traces_are_small_cited_and_in_the_tiny_models_vocabulary():
    assert {"agent-coding", "agent-research"} <= set(at.shipped_traces())
    known = set(at.vocabulary()) | set(COMMON_WORDS) | set(PUNCTUATION) | set(string.digits)
    for name in at.shipped_traces():
        t = at.load(name)  # a shipped trace by name
        assert at.load(at.WORKLOADS / f"{name}.json") == t
        assert t.source and all("url" in s for s in t.source) and "scaled" in t.scaling.lower()
        assert 4 <= t.sessions <= 8 and 400 <= t.shared_prefix_words <= 800 and 16 <= t.max_tokens <= 32
        sessions = at.expand(t)
        shape = at.stats(sessions)
        assert shape.sessions_with_subagents >= 1 and shape.kinds.get("fork", 0) >= 2
        texts = [sessions[0].system]
        for s in sessions:
            texts += texts_of(s.main)
        unknown = {w for text in texts for w in text.split()} - known
        assert not unknown, f"{name}: words the tiny model's tokenizer lacks: {sorted(unknown)[:5]}"
    coding = at.load("agent-coding")
    assert any("57103" in json.dumps(s) for s in coding.source)
    assert coding.subagent_share == 0.44
