"""Issue #39: the plan's verdict against what a user would run instead, the deployed system's model (prefill's
prefix cache, the pull's named fixed cost, room per arm, the stated cap), and the inputs it refuses."""

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from turnkv.cli import app
from turnkv.plan import architectures, closed_form, hardware
from turnkv.plan.workload import Workload, WorkloadError, load, sample

ROOT = Path(__file__).resolve().parents[2]
WORKLOAD = ROOT / "bench" / "workloads" / "agentic-p5en.json"
runner = CliRunner()


def plan_json(tmp_path, *args):
    res = runner.invoke(app, ["plan", "--json", "--out", str(tmp_path), *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def refused(tmp_path, *args) -> str:
    res = runner.invoke(app, ["plan", "--out", str(tmp_path), *args], env={"COLUMNS": "300"})
    assert res.exit_code == 2, res.output
    return " ".join(res.output.split())


def workload_file(tmp_path, **changes) -> Path:
    conf = json.loads(WORKLOAD.read_text())
    for key, value in changes.items():
        node = conf
        *parents, last = key.split(".")
        for p in parents:
            node = node[p]
        if value is None:
            node.pop(last)
        else:
            node[last] = value
    path = tmp_path / "w.json"
    path.write_text(json.dumps(conf))
    return path


# -- the verdict ----------------------------------------------------------------------------------


def test_every_plan_ends_with_a_verdict_from_the_same_numbers(tmp_path):
    data = plan_json(tmp_path)
    v = data["verdict"]
    assert isinstance(v["pays"], bool) and v["reason"].startswith("reuse pays" if v["pays"] else "reuse does not pay")
    assert set(v["arms"]) == {"reuse", "peer", "peer_no_offload"}
    for arm in v["arms"].values():
        assert set(arm["ttft_ms"]) >= {"p50", "p90"} and arm["cost_per_hour"] > 0 and arm["cost_per_1k_turns"] > 0
        assert arm["cost_per_1k_turns"] == pytest.approx(arm["cost_per_hour"] / (arm["turns_per_s"] * 3.6), rel=1e-3)
        assert sum(arm["token_sources"].values()) == pytest.approx(1.0, abs=2e-3)
    # the reuse arm is the plan's own fleet, and the peers run prefill prefix caching
    assert v["arms"]["reuse"]["nodes"] == data["nodes"] and v["arms"]["reuse"]["cost_per_hour"] == data["cost_per_hour"]
    assert v["arms"]["peer"]["prefill_prefix_caching"] and v["arms"]["peer"]["prefill_offload_gib"] > 0
    assert v["arms"]["peer_no_offload"]["prefill_offload_gib"] == 0
    assert v["dominant"] in v["reason"] and v["against"] in ("peer", "peer_no_offload")
    # the pull's fixed cost is a column of the per-turn table and named in the assumptions
    assert all("pull_fixed_ms" in r for r in data["per_turn"]) and data["per_turn"][0]["pull_fixed_ms"] == 0
    assert data["assumptions"]["pull_fixed_ms"] == pytest.approx(111.0)
    assert {c["name"] for c in data["assumptions"]["pull_fixed_components"]} >= {"step_alignment", "router_lookup"}


def test_the_verdict_follows_the_fleets(tmp_path):
    # the deploy's host tier (the default) holds decode's retained turns in the peers' node count: reuse is as cheap
    # and faster, so it pays; device only, reuse needs decode nodes the peers do not, and does not
    deployed = plan_json(tmp_path)["verdict"]
    device_only = plan_json(tmp_path, "--host-kv-gib", "0")["verdict"]
    assert deployed["pays"] and deployed["arms"]["reuse"]["host_kv_gib"] == 1024
    assert not device_only["pays"] and device_only["dominant"] == "decode nodes for retained KV"
    r, p = device_only["arms"]["reuse"], device_only["arms"][device_only["against"]]
    assert r["cost_per_1k_turns"] > p["cost_per_1k_turns"] and r["nodes"]["decode"] > p["nodes"]["decode"]


def test_the_text_prints_the_verdict_line(tmp_path):
    res = runner.invoke(app, ["plan", "--out", str(tmp_path)], env={"COLUMNS": "250"})
    text = " ".join(res.output.split())
    assert res.exit_code == 0 and "verdict: reuse" in text and "per 1k turns" in text and "pull fixed" in text


# -- the model of the deployed system ------------------------------------------------------------------


def gpu_fleet(**kw) -> closed_form.Fleet:
    inst = hardware.load("p5en.48xlarge")
    return closed_form.Fleet(architectures.load("Qwen3-32B"), inst, inst, **kw)


def test_prefix_caching_is_on_by_default_and_its_hits_follow_memory_and_routing():
    w = load(WORKLOAD)
    turns = sample(w, 2000, 0)
    assert closed_form.Fleet.__dataclass_fields__["prefill_prefix_caching"].default is True
    device = closed_form.evaluate(gpu_fleet(), w, turns=turns).cache
    offload = closed_form.evaluate(gpu_fleet(prefill_offload_gib=1024), w, turns=turns).cache
    more = closed_form.evaluate(gpu_fleet(prefill_nodes=4), w, turns=turns).cache
    rr = closed_form.evaluate(gpu_fleet(prefill_nodes=4, routing="round-robin"), w, turns=turns).cache
    off = closed_form.evaluate(gpu_fleet(prefill_prefix_caching=False), w, turns=turns).cache
    assert off.hit_share == 0 and not off.cached.any()
    assert device.hit_share < offload.hit_share and offload.offload_share > 0 and offload.t_total_s > device.t_device_s
    assert more.hit_share > device.hit_share  # prefix-aware routing adds the engines' caches up
    assert rr.hit_share < 0.4 * more.hit_share  # round-robin finds the right engine 1 time in 4


def test_a_pull_moves_only_what_prefill_lacks_and_pays_its_named_fixed_cost():
    f = gpu_fleet()
    # 9,000 tokens of history, prefill's cache holds the previous prompt (8,000): only the tail is pulled
    c = closed_form.turn_costs(f, [9140], [9000], cached=[8000])
    assert float(c.pulled[0]) == 1000 and c.pull_fixed == pytest.approx(0.111)
    base = closed_form.turn_costs(f, [9140], [9000], cached=[0])
    assert float(c.transfer_on[0]) < float(base.transfer_on[0]) and float(c.compute_off[0]) < float(base.compute_off[0])
    # from decode's host tier the read runs at the host rate, never faster than the link
    host = closed_form.turn_costs(f, [9140], [9000], from_host=[True])
    assert float(host.transfer_on[0]) >= float(base.transfer_on[0])


def test_the_threshold_is_the_break_even_of_the_same_costs():
    f = gpu_fleet(prefill_prefix_caching=False)
    t = closed_form.break_even_tokens(f, 140)  # on a grid 3.5% apart
    low, high = int(t * 0.95), int(t * 1.05)
    below, above = closed_form.turn_costs(f, [low + 140], [low]), closed_form.turn_costs(f, [high + 140], [high])
    assert below.ttft_on[0] >= below.ttft_off[0] and above.ttft_on[0] < above.ttft_off[0]


def test_the_host_tier_does_not_shrink_the_no_reuse_fleet(tmp_path):
    a = plan_json(tmp_path, "--host-kv-gib", "0")["nodes_without_reuse"]
    b = plan_json(tmp_path, "--host-kv-gib", "1024")["nodes_without_reuse"]
    assert (a["prefill"], a["decode"]) == (b["prefill"], b["decode"])
    w = load(WORKLOAD)
    turns = sample(w, 2000, 0)
    plain, _ = closed_form.size_fleet(gpu_fleet(), w, turns=turns, arm="off")
    hosted, _ = closed_form.size_fleet(gpu_fleet(host_kv_gib=1024), w, turns=turns, arm="off")
    assert plain.decode_nodes == hosted.decode_nodes


def test_a_fleet_beyond_the_cap_is_stated(tmp_path):
    data = plan_json(tmp_path, "--workload", str(workload_file(tmp_path, num_clients=1_000_000)), "--host-kv-gib", "0")
    assert data["capped"] and data["max_engines_per_role"] == closed_form.MAX_ENGINES
    assert not data["verdict"]["pays"] and "sizing stopped" in data["verdict"]["reason"]
    assert closed_form._fewest(lambda n: n >= 37, 4096) == 37 and closed_form._fewest(lambda n: False, 64) == 64


# -- inputs ----------------------------------------------------------------------------------------


def test_an_unknown_workload_key_is_refused_with_the_fix(tmp_path):
    conf = json.loads(WORKLOAD.read_text())
    conf["num_clent"] = conf.pop("num_clients")
    with pytest.raises(WorkloadError, match="did you mean 'num_clients'"):
        Workload.from_dict(conf)
    text = refused(tmp_path, "--workload", str(workload_file(tmp_path, num_clent=64)))
    assert "unknown key 'num_clent'" in text and "num_clients" in text
    nested = workload_file(tmp_path, **{"prompt_input.num_token": {"distribution": "constant", "value": 3}})
    assert "prompt_input: unknown key 'num_token'" in refused(tmp_path, "--workload", str(nested))
    bad_dist = workload_file(tmp_path, **{"prompt_input.num_tokens": {"distribution": "uniform", "min": 1, "mx": 2}})
    assert "unknown key 'mx'" in refused(tmp_path, "--workload", str(bad_dist))


def test_a_conversation_beyond_the_context_window_is_refused(tmp_path):
    long = workload_file(tmp_path, **{"prompt_input.prefix_num_tokens": {"distribution": "constant",
                                                                          "value": 200_000}})
    text = refused(tmp_path, "--workload", str(long))
    assert "40,960-token context" in text and "Qwen3-32B" in text and "lower prefix_num_tokens" in text


@pytest.mark.parametrize("size,instance", [("7", "p5en.48xlarge"), ("24", "p5en.48xlarge"), ("16", "local-cpu")])
def test_a_block_size_the_backend_cannot_run_is_refused(tmp_path, size, instance):
    text = refused(tmp_path, "--block-size", size, "--instance", instance, "--model", "tiny-local")
    assert f"--block-size {size}" in text and "multiples of" in text


def test_a_missing_config_file_is_named_as_such(tmp_path):
    text = refused(tmp_path, "--model", "/nonexistent/config.json")
    assert "no such file" in text and "unknown model" not in text
    assert "unknown model 'nosuch'" in refused(tmp_path, "--model", "nosuch")


@pytest.mark.parametrize("name", ["Qwen3-32B", "Qwen/Qwen3-32B", "qwen3-32b", "QWEN/QWEN3-32B"])
def test_models_are_named_as_the_deploy_path_names_them(name):
    assert architectures.load(name) == architectures.CATALOG["Qwen3-32B"]


def test_p5e_and_any_case_instance_names_are_accepted(tmp_path):
    data = plan_json(tmp_path, "--instance", "P5E.48xlarge")
    assert data["inputs"]["instance"] == "p5e.48xlarge" and data["nodes"]["prefill"] >= 1
    assert hardware.load("p5e.48xlarge").efficiency.dense == hardware.load("p5en.48xlarge").efficiency.dense


def test_local_pull_cost_is_measured_and_gpu_pull_cost_is_published():
    for c in hardware.GPU_PULL:
        assert "vLLM" in c.source or "ElastiCache" in c.source or "neuralmagic" in c.source
    assert any("measured" in c.source for c in hardware.LOCAL_PULL)
    assert hardware.INSTANCES["local-cpu"].efficiency.pull_overhead_s == pytest.approx(0.008)
    assert np.isclose(hardware.pull_fixed_s(hardware.GPU_PULL), 0.111)


def test_seeds_setting_still_available(tmp_path):
    data = plan_json(tmp_path, "--no-prefill-prefix-caching")
    assert data["inputs"]["prefill_prefix_caching"] is False
    assert all(r["prefill_cached_tokens"] == 0 for r in data["per_turn"])
    # the peers a user would run keep their prefix cache whatever the reuse arm's setting
    assert data["verdict"]["arms"]["peer"]["prefill_prefix_caching"] is True
    assert replace(gpu_fleet(), prefill_prefix_caching=False).prefill_prefix_caching is False


def test_under_a_target_both_meet_cost_decides(tmp_path):
    v = plan_json(tmp_path, "--ttft-target-ms", "500")["verdict"]
    r, p = v["arms"]["reuse"], v["arms"][v["against"]]
    assert r["ttft_target_met"] and p["ttft_target_met"] and r["ttft_ms"]["p90"] <= 500
    assert v["pays"] == (r["cost_per_1k_turns"] < p["cost_per_1k_turns"] * (1 - 0.005))
    assert "cost decides" in v["reason"]
    # the TTFT terms say where the difference comes from, and the fixed cost counts against reuse
    assert v["ttft_terms_ms"]["pull_fixed"] < 0 and v["ttft_terms_ms"]["transfer"] < 0


# -- the local twin ----------------------------------------------------------------------------------


def test_the_twin_describes_bench_capacity_conversations_as_demo_json_does():
    from turnkv.plan import twin

    # demo.json is the demo's conversations (500 system words, 700 first, 380 per turn, 32-token replies)
    demo = load(ROOT / "bench" / "workloads" / "demo.json")
    wl = twin.CapacitySpec(turns=8, system_words=500, first_user_words=700, turn_words=380, max_tokens=32).workload(3)
    a, b = sample(demo, 3, 0), sample(wl, 3, 0)
    assert np.abs(a.prompt_tokens - b.prompt_tokens).max() <= 8 and (a.turn == b.turn).all()


def test_mean_value_analysis_of_the_closed_loop():
    from turnkv.plan import twin

    assert twin.mva_stretch(1, 0.1, 0.05) == (1.0, pytest.approx(1 / 0.15))
    stretch, rate = twin.mva_stretch(16, 0.1, 0.0)
    assert stretch == pytest.approx(16.0) and rate == pytest.approx(10.0)  # saturated: one job at a time
    light, _ = twin.mva_stretch(4, 0.01, 1.0)
    assert 1.0 < light < 1.05  # mostly delay: little queueing


def test_the_twin_predicts_from_a_calibration_only(tmp_path):
    from turnkv.plan import twin

    res = runner.invoke(app, ["plan", "twin", "--state-dir", str(tmp_path)])
    assert res.exit_code == 2 and "turnkv plan calibrate" in " ".join(res.output.split())
    inst = hardware.INSTANCES["local-cpu"]
    fleet = closed_form.Fleet(architectures.tiny_local(), inst, inst, 1, 1)
    out = twin.predict(fleet, twin.CapacitySpec(), [1, 2, 4, 8])
    p90 = [lv["off"]["ttft_p90_ms"] for lv in out["levels"]]
    assert p90 == sorted(p90) and out["sustained_off"] in (1, 2, 4, 8)
    assert all(0 <= lv["on"]["reuse_share"] <= 1 for lv in out["levels"])
    # bench capacity replays the same conversations (one seed, temperature 0): with prefill's prefix cache the
    # reuse-on arm, after reuse off at the same level, finds whole prompts cached and pulls nothing; an earlier
    # level's conversations are cached whole in the reuse-off arm too
    assert all(lv["on"]["reuse_share"] == 0 for lv in out["levels"])
    fresh = twin.predict_level(fleet, twin.CapacitySpec(), 2, "off", seen=0)["ttft_p50_ms"]
    assert twin.predict_level(fleet, twin.CapacitySpec(), 2, "off", seen=1)["ttft_p50_ms"] < fresh


def test_staggered_conversations_overlap_in_part():
    from turnkv.plan import twin

    assert twin.overlap(1, 5.0, 0.2) == 1.0
    assert twin.overlap(8, 1e6, 0.2) == pytest.approx(8.0, rel=1e-3)  # long conversations: all together
    assert twin.overlap(8, 0.2, 0.2) == pytest.approx(1.0)  # each ends as the next starts
    assert 1.0 < twin.overlap(8, 1.0, 0.2) < 8.0
    lo, hi = twin.mva_stretch(3, 0.1, 0.1)[0], twin.mva_stretch(4, 0.1, 0.1)[0]
    assert lo < twin.mva_stretch_at(3.5, 0.1, 0.1)[0] < hi
