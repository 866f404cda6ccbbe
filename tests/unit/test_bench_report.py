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
                    "ttft_ms_best": 261.0, "reused_tokens_on": 3500.0, "speedup_vs_off": 7.98, "speedup_vs_best": 0.87}
    assert s["speedup_vs_off_last_turn"] == 7.98 and s["speedup_vs_best_last_turn"] == 0.87 and s["errors"] == 1
    # turn 1 reused nothing: no speedup printed for it, whatever its TTFTs (issue #49)
    assert not any(k.startswith("speedup") for k in s["turns"][0])
    assert s["answers_identical"] == s["answers_compared"] == 6


def test_markdown_and_chart(tmp_path):
    s = report.write(results(), tmp_path)
    md = (tmp_path / "summary.md").read_text()
    assert "| 2 | 4000 | 2401 | 301 | 261 | 3500 | 7.98x | 0.87x |" in md
    assert "| 1 | 1000 | 601 | 581 | 151 | 0 | - | - |" in md
    # issue #49: the first line compares with the strongest baseline played, one direction, higher is better;
    # every arm is defined; every line fits 80 columns
    assert md.splitlines()[0] == "turnkv's TTFT speedup over best case, last turn: 0.87x (higher is better)"
    assert "- off = no prefix cache: reuse off and a fresh cache_salt" in md
    assert max(len(line) for line in md.splitlines()) <= 80, md
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


def capacity_levels():
    """Reuse off gets slower with load much faster than reuse on (synthetic TTFTs)."""
    from bench import capacity

    levels = []
    for c, off_ms, on_ms in ((1, 500, 200), (2, 900, 250), (4, 1800, 400), (8, 3600, 800), (16, 7200, 1600)):
        level = {"concurrency": c}
        for arm, base in (("off", off_ms), ("on", on_ms)):
            rs = [Result(conv, turn, arm, ttft_ms=base * (1 + turn / 10), prompt_tokens=800 + 216 * turn,
                         reused_tokens=700 if arm == "on" and turn and conv else 0)
                  for conv in range(c) for turn in range(3)]
            level[arm] = capacity.level_summary(rs)
        levels.append(level)
    return levels


def test_capacity_levels_percentiles_and_reuse_share():
    levels = capacity_levels()
    one, sixteen = levels[0], levels[-1]
    assert one["off"]["ttft_p50_ms"] == 550.0 and one["off"]["ttft_p90_ms"] == 600.0
    assert one["on"]["reuse_share"] == 0.0  # the one conversation (index 0) never reused
    assert sixteen["on"]["reuse_share"] == round(15 / 16, 3)
    assert [t["turn"] for t in sixteen["on"]["turns"]] == [1, 2, 3]
    assert sixteen["on"]["turns"][2]["prompt_tokens"] == 1232


def test_capacity_sustained_load_under_the_target(tmp_path):
    from bench import capacity

    levels = capacity_levels()
    result = capacity.write(levels, tmp_path, None, {"workload": {}})
    c = result["conclusion"]
    # default target: 2 x the reuse-off p90 at 1 conversation = 1,200 ms
    assert c["target_ms"] == 1200.0 and c["sustained_off"] == 2 and c["sustained_on"] == 8
    assert c["capacity_gain"] == 4.0
    assert capacity.conclude(levels, 3000.0)["sustained_off"] == 4
    md = (tmp_path / "capacity.md").read_text()
    assert "| 8 | 3,960 | 4,320 | 880 | 960 | 4.50x | 88% | 0/0 |" in md and "capacity with reuse: 4.00x" in md
    assert (tmp_path / "capacity.png").read_bytes()[:4] == b"\x89PNG"
    short = capacity.markdown(result, per_turn=False)
    assert "Per turn" not in short and "target" not in short
    assert len([line for line in short.splitlines() if line.startswith("|")]) == 7
    assert "x p90: off's p90 / on's (higher is better)" in " ".join(short.split())  # the short headers defined
    assert max(map(len, short.splitlines())) <= 80, short  # the demo prints it (issue #49)
    levels[1]["on"]["errors"] = 1  # an error at a level ends what a variant sustains
    assert capacity.sustained(levels, "on", 1200.0) == 1


def test_capacity_levels_are_checked():
    import pytest

    from bench import capacity

    assert capacity.parse_levels("1,2,4") == [1, 2, 4]
    for bad in ("", "1,x", "4,2", "0,1"):
        with pytest.raises(ValueError, match="--concurrency-levels"):
            capacity.parse_levels(bad)


def test_ab_under_concurrency_runs_the_arms_in_phases(monkeypatch):
    """With several conversations in flight, no reuse-on request queues behind a reuse-off one (and back)."""
    import asyncio

    from bench import runner

    sent = []

    async def fake_chat(session, url, body, headers, result, timeout):
        sent.append((result.arm, result.conversation, result.turn))
        await asyncio.sleep(0)
        result.ttft_ms, result.reply = 1.0, f"reply {result.conversation} {result.turn}"
        return result

    monkeypatch.setattr(runner, "chat", fake_chat)
    workload = WorkloadSpec(conversations=3, turns=2, system_words=5, first_user_words=5, turn_words=5)

    def arms_sent(**kw):
        sent.clear()
        spec = runner.RunSpec(url="http://127.0.0.1:1", workload=workload, ab=True, model="tiny", **kw)
        results = asyncio.run(runner.run(spec))
        assert len(results) == 12
        return [arm for arm, _, _ in sent]

    assert arms_sent(concurrency=3) == ["off"] * 6 + ["on"] * 6
    interleaved = arms_sent(concurrency=3, phased=False)
    assert interleaved != ["off"] * 6 + ["on"] * 6 and interleaved.count("on") == 6
    assert arms_sent(concurrency=1) == ["off", "on"] * 6  # one at a time: interleaved turn by turn, as before


def test_an_ab_whose_off_arm_hit_prefills_own_cache_is_flagged():
    clean = results()
    assert report.shared_prefill_cache(clean) is None
    for r in clean:
        if r.arm == "on" and r.prompt_tokens:
            r.prefill_cached_tokens = r.prompt_tokens // 2  # turnkv as deployed: its own previous turn, cached
    assert report.shared_prefill_cache(clean) is None
    for r in clean:
        if r.arm == "off" and r.prompt_tokens:
            r.prefill_cached_tokens = r.prompt_tokens // 2  # the salt did not reach prefill
    assert "--no-prefill-prefix-caching" in report.shared_prefill_cache(clean)
    assert report.shared_prefill_cache([r for r in clean if r.arm != "off"]) is None


def test_the_peer_arm_goes_to_its_router_with_reuse_off_and_salts_keep_the_arms_caches_apart(monkeypatch):
    import asyncio

    from bench import runner
    from turnkv import wire

    sent = []

    async def fake_chat(session, url, body, headers, result, timeout):
        sent.append((result.arm, url, body.get("cache_salt"), headers.get(wire.REUSE_HEADER)))
        result.ttft_ms, result.reply = 1.0, "r"
        return result

    monkeypatch.setattr(runner, "chat", fake_chat)
    workload = WorkloadSpec(conversations=1, turns=2, system_words=5, first_user_words=5, turn_words=5)
    spec = runner.RunSpec(url="http://main", workload=workload, ab=True, model="tiny", best_url="http://best",
                          peer_url="http://best")
    assert spec.arms == ["off", "on", "best", "peer"]
    results = asyncio.run(runner.run(spec))
    by_arm: dict[str, list] = {}
    for arm, url, salt, reuse in sent:
        by_arm.setdefault(arm, []).append((url, salt, reuse))
    assert {u for u, _, _ in by_arm["peer"]} == {"http://best"} and {r for _, _, r in by_arm["peer"]} == {"off"}
    off_salts = [s for _, s, _ in by_arm["off"]]
    assert len(set(off_salts)) == len(off_salts) == 2  # new every request
    assert {s for _, s, _ in by_arm["on"]} == {None} and {r for _, _, r in by_arm["on"]} == {None}
    peer_salts, best_salts = {s for _, s, _ in by_arm["peer"]}, {s for _, s, _ in by_arm["warm"] + by_arm["best"]}
    assert len(peer_salts) == len(best_salts) == 1 and peer_salts != best_salts  # one each, never shared
    summary = report.summarize(results)
    assert summary["arms"] == ["off", "on", "best", "peer"] and "ttft_ms_peer" in summary["turns"][0]
    assert "| x peer |" in report.markdown(summary)
