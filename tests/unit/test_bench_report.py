from bench import report
from bench.client import Result
from bench.workload import WorkloadSpec, build


def results():
    out = []
    for conv in range(3):
        for turn, (tokens, off, on, best) in enumerate([(1000, 600, 580, 150), (4000, 2400, 300, 260)]):
            for arm, ttft in (("off", off), ("on", on), ("best", best)):
                out.append(Result(conv, turn, arm, ttft_ms=ttft + conv, prompt_tokens=tokens,
                                  reused_tokens=3500 if (arm == "on" and turn) else 0, reply_sha=f"r{conv}{turn}"))
    out.append(Result(0, 1, "on", error="HTTP 502: boom"))
    return out


def test_summary_medians_speedup_and_identity():
    s = report.summarize(results())
    assert s["arms"] == ["off", "on", "best"]
    last = s["turns"][-1]
    assert last == {"turn": 2, "prompt_tokens": 4000, "ttft_ms_off": 2401.0, "ttft_ms_on": 301.0,
                    "ttft_ms_best": 261.0, "reused_tokens_on": 3500.0, "speedup": 7.98, "on_vs_best": 1.15}
    assert s["speedup_last_turn"] == 7.98 and s["errors"] == 1
    assert s["answers_identical"] == s["answers_compared"] == 6


def test_markdown_and_chart(tmp_path):
    s = report.write(results(), tmp_path)
    md = (tmp_path / "summary.md").read_text()
    assert "| 2 | 4000 | 2401 | 301 | 261 | 3500 | 7.98x | 1.15 |" in md
    png = (tmp_path / "ttft.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == len(results())
    assert s["requests"] == 19


def test_workload_grows_each_turn_from_the_replies():
    spec = WorkloadSpec(conversations=2, turns=3, system_words=10, first_user_words=20, turn_words=5)
    convs = build(spec)
    assert convs[0].system == convs[1].system and convs[0].user_turns != convs[1].user_turns
    m = convs[0].messages_for(2, ["r1", "r2"])
    assert [x["role"] for x in m] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert m[2]["content"] == "r1" and m[-1]["content"] == convs[0].user_turns[2]
    assert build(spec)[0] == convs[0]
