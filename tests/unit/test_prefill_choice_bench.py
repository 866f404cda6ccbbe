"""bench.prefill_choice's pure parts: the runs it plays and the table it prints."""

from __future__ import annotations

from bench import agent_trace, prefill_choice


def test_each_choice_plays_the_trace_on_its_own_seed_after_a_one_session_warm_up():
    trace = agent_trace.load(agent_trace.resolve("agent-coding"))
    runs = prefill_choice.runs(trace)
    assert [label for label, _ in runs] == ["warm-up", prefill_choice.BEFORE, prefill_choice.AFTER]
    assert runs[0][1].sessions == 1 and runs[1][1].sessions == runs[2][1].sessions == trace.sessions
    assert len({t.seed for _, t in runs}) == 3  # new words each time: no run warms another's prefixes
    first = [agent_trace.expand(t)[0].system for _, t in runs]
    assert len(set(first)) == 3


def test_the_table_shows_ttft_and_the_prompt_tokens_by_source_per_choice():
    tokens = {"share_prefill_cache": 0.5, "share_pulled": 0.25, "share_recomputed": 0.25}
    arm = {"requests": 69, "errors": 0, "ttft_p50_ms": 80.4, "ttft_p90_ms": 1234.0, "tokens": tokens,
           "fork_turns": 15, "fork_turns_pulled": 15}
    text = prefill_choice.table({prefill_choice.AFTER: {"per_arm": {"on": arm}}})
    assert "| cache-aware | 69 | 0 | 80 | 1,234 | 50.0% | 25.0% | 25.0% | 15/15 |" in text
