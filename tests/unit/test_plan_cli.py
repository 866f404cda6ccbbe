"""`turnkv plan` as a user runs it: JSON schema, chart, errors; `turnkv bench multiturn --workload` shape."""

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from bench.workload import from_workload_file
from turnkv.cli import app
from turnkv.plan.workload import load, sample

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def test_plan_json_has_the_issue_schema(tmp_path):
    # the seeds' setting (no prefix cache on prefill), where reuse's TTFT gain is plain
    res = runner.invoke(app, ["plan", "--model", "GLM-5-FP8", "--json", "--out", str(tmp_path), "--ttft-target-ms",
                              "900", "--no-prefill-prefix-caching"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    for arm in ("off", "on"):
        assert set(data["ttft_ms"][arm]) >= {"mean", "p50", "p90"}
    assert data["ttft_ms"]["on"]["mean"] < data["ttft_ms"]["off"]["mean"]
    row = data["per_turn"][1]
    assert set(row) >= {"turn", "prompt_tokens", "ttft_ms_off", "ttft_ms_on", "transfer_ms"}
    assert row["transfer_ms"] > 0 and data["per_turn"][0]["transfer_ms"] == 0
    assert data["retained_gib_per_decode"] > 0 and 0 < data["reuse_share"] <= 1
    assert data["nodes"]["prefill"] >= 1 and data["nodes"]["decode"] >= 1
    assert data["cost_per_hour"] == round(63.296 * sum(data["nodes"].values()), 2)
    rec = data["recommend"]
    assert rec["params_set"].startswith(f"turnkv params set decoder_kv_blocks_ttl={rec['decoder_kv_blocks_ttl']} ")
    assert (tmp_path / "plan.png").stat().st_size > 10_000 and (tmp_path / "plan.json").is_file()


def test_recommended_params_pass_the_catalog_checks(tmp_path):
    from turnkv import params
    from turnkv.aws_params import parse_assignments

    res = runner.invoke(app, ["plan", "--json", "--out", str(tmp_path)])
    line = json.loads(res.stdout)["recommend"]["params_set"]
    changes = parse_assignments([a for a in line.split()[3:] if "=" in a])
    params.cross_check(params.defaults() | {k: params.get(k).parse(v) for k, v in changes.items()})


def test_a_tighter_ttft_target_needs_more_prefill_nodes(tmp_path):
    wl = tmp_path / "busy.json"
    # GPU TTFT carries ~410 ms of fitted fixed costs (two hops and a pull): enough load to queue above them
    conf = json.loads((ROOT / "bench/workloads/agentic-p5en.json").read_text()) | {"num_clients": 4000,
                                                                                   "think_time_s": 1}
    wl.write_text(json.dumps(conf))
    base = ["plan", "--json", "--out", str(tmp_path), "--workload", str(wl)]
    loose = json.loads(runner.invoke(app, base).stdout)
    tight = json.loads(runner.invoke(app, [*base, "--ttft-target-ms", "500"]).stdout)
    assert tight["nodes"]["prefill"] > loose["nodes"]["prefill"] >= 1 and tight["ttft_target_met"]
    assert tight["prefill_utilization"]["on"] < loose["prefill_utilization"]["on"]
    impossible = json.loads(runner.invoke(app, [*base, "--ttft-target-ms", "5"]).stdout)
    assert not impossible["ttft_target_met"] and impossible["nodes"] == loose["nodes"]
    # reuse off needs more prefill engines for the same load
    assert loose["nodes_without_reuse"]["prefill"] > loose["nodes"]["prefill"]


def test_bad_inputs_name_the_fix(tmp_path):
    res = runner.invoke(app, ["plan", "--workload", str(tmp_path / "none.json")])
    assert res.exit_code == 2 and "no such workload file" in res.output
    res = runner.invoke(app, ["plan", "--model", "gpt-9"])
    assert res.exit_code == 2 and "Qwen3-32B" in res.output
    res = runner.invoke(app, ["plan", "--instance", "p9.huge"])
    assert res.exit_code == 2 and "p5en.48xlarge" in res.output
    res = runner.invoke(app, ["plan", "--tp", "16"])
    assert res.exit_code == 2 and "exceeds the 8 devices" in res.output
    res = runner.invoke(app, ["plan", "--model", "GLM-5-FP8", "--instance", "p5.48xlarge"])
    assert res.exit_code == 2 and "leave no room for a KV cache" in res.output
    res = runner.invoke(app, ["plan", "--instance", "local-cpu"])  # the default model on this machine
    assert res.exit_code == 2 and "--model tiny-local" in res.output and "turnkv plan twin" in res.output


def test_bench_plays_the_same_load_the_plan_describes():
    """One word is one token for the local tokenizer: the benchmark's messages carry the plan's counts."""
    w = load(ROOT / "bench/workloads/demo.json")
    convs = from_workload_file(w)
    turns = sample(w, w.num_conversations, 7)
    assert len(convs) == w.num_conversations
    for c in convs:
        sel = turns.conv == c.index
        words = [len(m.split()) for m in c.user_turns]
        assert words[0] + len(c.system.split()) + w.template_tokens_per_message == turns.new_tokens[sel][0]
        assert np.array_equal(np.array(words[1:]) + w.template_tokens_per_message, turns.new_tokens[sel][1:])
        assert list(c.max_tokens) == turns.output_tokens[sel].tolist()


def test_every_ttft_carries_the_calibration_band(tmp_path):
    from turnkv.plan import gpu_calibration

    res = runner.invoke(app, ["plan", "--out", str(tmp_path)])
    band = gpu_calibration.band()
    assert res.exit_code == 0 and f"TTFT band: ±{band:.0%}" in res.output and " ±" in res.output
    out = json.loads((tmp_path / "plan.json").read_text())
    assert out["ttft_band"]["relative"] == band and "gpu_measurements.json" in out["ttft_band"]["source"]
    p90 = out["ttft_ms"]["on"]["p90"]
    assert out["ttft_ms_band"]["on"]["p90"] == pytest.approx([p90 * (1 - band), p90 * (1 + band)], abs=0.1)
    assert all(r["ttft_ms_on_band"][0] < r["ttft_ms_on"] < r["ttft_ms_on_band"][1] for r in out["per_turn"])


def test_unreadable_inputs_and_unwritable_outputs_are_messages_not_tracebacks(tmp_path):
    """A folder as --workload, --out under /proc or under a file (as a read-only working folder for the default
    results/plan: the same OSError): exit 2 naming the option and the fix."""
    res = runner.invoke(app, ["plan", "--workload", str(tmp_path)])
    assert res.exit_code == 2 and "cannot be read" in res.output and "Traceback" not in res.output
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for out in (blocker / "plan", Path("/proc/turnkv-plan")):
        res = runner.invoke(app, ["plan", "--out", str(out)])
        assert res.exit_code == 2 and "cannot write plan.json" in " ".join(res.output.split()), res.output
        assert isinstance(res.exception, SystemExit)


def test_the_plan_fits_80_columns_without_cutting_a_name(tmp_path):
    """Issue #49: at 80 columns rich cut the tables' headers and arm names ("prefi…", "peer+…"). Headers are
    short (units in the caption), no column is narrower than its longest word, and a table wider than the terminal
    prints one record per row."""
    from typer.testing import CliRunner

    from turnkv.cli import app

    done = CliRunner().invoke(app, ["plan", "--model", "Qwen3-32B", "--ttft-target-ms", "300", "--out",
                                    str(tmp_path)], env={"COLUMNS": "80"})
    assert done.exit_code == 0, done.output
    assert "…" not in done.output and "peer+offload" in done.output, done.output
