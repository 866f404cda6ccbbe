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


def test_modes_table_puts_each_mode_beside_the_pull_baseline(tmp_path):
    from bench import modes
    from turnkv.engine_args import Mode

    def summary(off, on):
        return {"turns": [{"turn": 1, "prompt_tokens": 1000, "ttft_ms_off": off[0], "ttft_ms_on": on[0],
                           "reused_tokens_on": 0.0},
                          {"turn": 2, "prompt_tokens": 4000, "ttft_ms_off": off[1], "ttft_ms_on": on[1],
                           "reused_tokens_on": 3500.0}],
                "requests": 4, "errors": 0, "answers_identical": 2, "answers_compared": 2}

    summaries = {Mode.PULL: summary((600, 2400), (580, 300)), Mode.PUSH: summary((590, 2300), (570, 240))}
    rows = modes.combine(summaries)
    assert rows[1]["pull + bi-directional"] == 300 and rows[1]["push + bi-directional"] == 240
    assert rows[1]["speedup_pull"] == 8.0 and rows[1]["speedup_push"] == 10.0  # both against pull's reuse off
    assert rows[1]["reused_tokens_push"] == 3500.0
    md = modes.markdown(rows, summaries)
    assert "| 2 | 4000 | 2400 | 300 | 2300 | 240 | 8.00x | 10.00x |" in md
    assert "push: requests 4, errors 0, identical answers with reuse on and off 2/2" in md
    assert modes.chart(rows, tmp_path / "ttft.png").stat().st_size > 0
    pull_only = modes.combine({Mode.PULL: summaries[Mode.PULL]})
    assert "push + bi-directional" not in pull_only[0]


def test_modes_cli_names_the_fix_for_a_bad_mode():
    from typer.testing import CliRunner

    from turnkv.cli import app

    bad = CliRunner().invoke(app, ["bench", "modes", "--modes", "pull,bogus"])
    assert bad.exit_code == 2 and "expected pull and/or push" in bad.output
    no_baseline = CliRunner().invoke(app, ["bench", "modes", "--modes", "push"])
    assert no_baseline.exit_code == 2 and "must include pull" in no_baseline.output
