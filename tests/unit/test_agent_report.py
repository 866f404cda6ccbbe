"""bench.agent_report's math and `turnkv bench agent`'s errors (no servers)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from bench import agent_bench, agent_report
from bench.agent_bench import Record
from tests.conftest import free_port
from turnkv.cli import app


def rec(arm, step, kind="tool", ttft=100.0, prompt=1000, reused=0, cached=0, branch=0, sha="a", error=None,
        session=0, agent="main"):
    return Record(arm, session, agent, step, kind, branch, ttft_ms=ttft, latency_ms=ttft and ttft + 50,
                  prompt_tokens=prompt, reused_tokens=reused, prefill_cached_tokens=cached, reply_sha=sha, error=error,
                  reuse_outcome="hit" if reused else "miss")


def records() -> list[Record]:
    out = []
    for arm, base in (("off", 1000.0), ("on", 200.0)):
        out.append(rec(arm, 0, "task", ttft=base, prompt=800, cached=512))  # the shared prefix from prefill's cache
        for step in range(1, 10):
            out.append(rec(arm, step, ttft=base + 10 * step, prompt=1000 + 100 * step,
                           reused=(900 + 100 * step) if arm == "on" else 0))
        for branch in range(3):  # a fork: one branch pulls, the others recompute
            out.append(rec(arm, 10, "fork", ttft=base * 2, prompt=2000, branch=branch, sha=f"f{branch}",
                           reused=1900 if arm == "on" and branch == 0 else 0))
    out.append(rec("on", 11, "join", error="HTTP 502: boom", ttft=None, prompt=None))
    out.append(rec("best", 0, "task", ttft=90.0, prompt=800, cached=700, sha="other"))
    return out


def test_ttft_percentiles_per_arm_and_step_kind():
    s = agent_report.summarize(records())
    assert s["arms"] == ["off", "on", "best"]
    off, on = s["per_arm"]["off"], s["per_arm"]["on"]
    # nearest rank over 13 TTFTs: 1000, 1010..1090, 2000 x 3
    assert off["ttft_p50_ms"] == 1060.0 and off["ttft_p90_ms"] == 2000.0
    assert on["by_kind"]["tool"] == {"requests": 9, "ttft_p50_ms": 250.0, "ttft_p90_ms": 290.0}
    assert on["by_kind"]["fork"]["ttft_p50_ms"] == 400.0 and on["by_kind"]["task"]["requests"] == 1
    assert on["by_kind"]["join"] == {"requests": 1, "ttft_p50_ms": None, "ttft_p90_ms": None}
    assert on["requests"] == 14 and on["errors"] == 1 and s["errors"] == 1 and s["requests"] == 28
    assert s["error_samples"] == ["HTTP 502: boom"]


def test_tokens_by_source_and_forks_that_pulled():
    s = agent_report.summarize(records())
    on, off, best = (s["per_arm"][a] for a in ("on", "off", "best"))
    prompt = 800 + sum(1000 + 100 * k for k in range(1, 10)) + 3 * 2000
    pulled = sum(900 + 100 * k for k in range(1, 10)) + 1900
    assert on["tokens"]["prompt_tokens"] == off["tokens"]["prompt_tokens"] == prompt  # the failed join not counted
    assert on["tokens"]["pulled_tokens"] == pulled and on["tokens"]["prefill_cached_tokens"] == 512
    assert on["tokens"]["recomputed_tokens"] == prompt - pulled - 512
    assert on["tokens"]["share_pulled"] == round(pulled / prompt, 4)
    assert off["tokens"]["pulled_tokens"] == 0 and off["tokens"]["recomputed_tokens"] == prompt - 512
    assert best["tokens"]["share_prefill_cache"] == 0.875 and best["tokens"]["share_recomputed"] == 0.125
    assert (on["fork_turns"], on["fork_turns_pulled"]) == (3, 1)
    assert (off["fork_turns"], off["fork_turns_pulled"]) == (3, 0)
    assert on["outcomes"] == {"hit": 10, "miss": 4}


def test_recomputed_is_never_negative():
    (r,) = [rec("on", 1, prompt=100, reused=90, cached=64)]
    assert agent_report.sources([r])["recomputed_tokens"] == 0
    assert agent_report.sources([])["share_pulled"] is None


def test_answers_are_compared_request_by_request_against_the_first_arm():
    s = agent_report.summarize(records())
    ans = s["answers"]
    # on: 13 of 14 answered (the join failed), all identical; best: its one task differs
    assert ans["reference"] == "off" and ans["compared"] == 14 and ans["identical"] == 13
    assert ans["mismatch_count"] == 1
    assert ans["mismatches"] == [{"arm": "best", "session": 0, "agent": "main", "step": 0, "branch": 0}]


def test_markdown_and_files(tmp_path):
    s = agent_report.write(records(), tmp_path, {"trace": "t"})
    md = (tmp_path / "summary.md").read_text()
    assert md == agent_report.markdown(s)
    assert "| on | 14 | 1 | 260 | 400 | 3% | 71% | 26% | 1/3 |" in md
    assert "| fork | 2,000 / 2,000 (3) | 400 / 400 (3) | - |" in md
    assert "identical answers against reuse off: 13/14 (1 differ)" in md
    assert json.loads((tmp_path / "summary.json").read_text())["meta"] == {"trace": "t"}
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert len(lines) == 28 and {"arm", "session", "agent", "step", "kind", "branch", "ttft_ms", "prompt_tokens",
                                 "reused_tokens", "prefill_cached_tokens", "reuse_outcome", "reply",
                                 "error"} <= set(json.loads(lines[0]))


def test_arms_parse_and_need_their_router():
    assert agent_bench.parse_arms("on, off") == ("off", "on")
    assert agent_bench.default_arms(None) == "off,on" and agent_bench.default_arms("http://x") == "off,on,best"
    with pytest.raises(ValueError, match="unknown arm 'fast'"):
        agent_bench.parse_arms("on,fast")
    with pytest.raises(ValueError, match="--best-url"):
        agent_bench.PlaySpec(arms=("on", "best"))
    # the peer-best arm of bench.arms (issue #36's three arms: off, peer, on)
    assert agent_bench.default_arms(None, "http://p") == "off,on,peer"
    assert agent_bench.parse_arms("peer,on,off") == ("off", "on", "peer")
    with pytest.raises(ValueError, match="--peer-url"):
        agent_bench.PlaySpec(arms=("on", "peer"))


def test_cli_refuses_a_bad_trace_naming_the_field(tmp_path):
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"format": "turnkv-agent-trace/1", "sessions": 2, "steps": 3, "task_words": 5,
                               "think_s": {"tool": {"distribution": "uniform", "min": 1}}}))
    result = CliRunner().invoke(app, ["bench", "agent", "--trace", str(bad), "--out", str(tmp_path / "o")],
                                env={"COLUMNS": "300"})
    assert result.exit_code == 2 and "think_s.tool: uniform needs max" in result.output
    assert "Traceback" not in result.output
    missing = CliRunner().invoke(app, ["bench", "agent", "--trace", "no-such-trace"], env={"COLUMNS": "300"})
    assert missing.exit_code == 2 and "no such trace file" in missing.output and "agent-coding" in missing.output
    best = CliRunner().invoke(app, ["bench", "agent", "--arms", "best"], env={"COLUMNS": "300"})
    assert best.exit_code == 2 and "--best-url" in best.output
    peer = CliRunner().invoke(app, ["bench", "agent", "--arms", "off,peer,on"], env={"COLUMNS": "300"})
    assert peer.exit_code == 2 and "--peer-url" in peer.output


def test_cli_says_when_the_router_is_unreachable(tmp_path):
    down = f"http://127.0.0.1:{free_port()}"
    for flag in ("--url", "--router"):  # --router: the name issue #30 used, a hidden alias
        result = CliRunner().invoke(app, ["bench", "agent", flag, down, "--time-scale", "0", "--out",
                                          str(tmp_path)], env={"COLUMNS": "300"})
        assert result.exit_code == 1, result.output
        assert "agent benchmark failed" in result.output and down in result.output
        assert "Traceback" not in result.output and not (tmp_path / "summary.json").exists()
    shown = CliRunner().invoke(app, ["bench", "agent", "--help"], env={"COLUMNS": "300"}).stdout
    assert "--best-url" in shown and "--time-scale" in shown and "--router" not in shown


def test_an_ab_whose_on_arm_found_the_off_arms_prompts_in_prefills_cache_is_flagged():
    from bench.agent_report import shared_prefill_cache

    def summary(share, arms=("off", "on")):
        return {"arms": list(arms), "per_arm": {"on": {"tokens": {"share_prefill_cache": share}}}}

    assert "no-prefill-prefix-caching" in shared_prefill_cache(summary(0.8))
    assert shared_prefill_cache(summary(0.0)) is None
    assert shared_prefill_cache(summary(0.8, arms=("on", "best"))) is None  # no off arm played before
    # an off arm with a fresh cache_salt per request (every run since issue #36) left nothing for the on arm to find
    assert shared_prefill_cache({**summary(0.8), "meta": {"off_salted": True}}) is None
