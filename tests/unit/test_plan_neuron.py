"""trn2 priced from published AWS Neuron figures (turnkv/plan/data/neuron_measurements.json): the chip constants
are the Trainium2 architecture page's, the prefill factor and decode bandwidth are fitted to the calibration row,
and the held-out published row checks the planner's prediction."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from turnkv.plan import gpu_calibration, hardware, neuron_calibration

REPO = Path(__file__).resolve().parents[2]
#: How far the planner's trn2 TTFT may be from a held-out published one: the GPU fit's own held-out rows (other
#: engines, colocated) land within about this (docs/planning.md), and the trn2 row is another engine too.
TTFT_TOLERANCE = 0.25


def held_out() -> list[dict]:
    return [r for r in neuron_calibration.fitted()["rows"] if r["split"] == "held_out"]


def test_trn2_constants_are_the_published_chip_figures():
    trn2 = hardware.INSTANCES["trn2.48xlarge"]
    source = neuron_calibration.load_data()["sources"]["trainium2-arch"]["what"]
    for figure in ("667 BF16", "1,299 FP8", "181 FP32", "96 GiB HBM at 2.9 TB/s", "1.28 TB/s"):
        assert figure in source
    assert (trn2.peak("bfloat16"), trn2.peak("fp8"), trn2.peak("float32")) == (667e12, 1299e12, 181e12)
    assert (trn2.hbm_bytes, trn2.hbm_bytes_s, trn2.devices) == (96 * hardware.GIB, 2.9e12, 16)
    assert trn2.efficiency.allreduce_bus_bytes_s == pytest.approx(0.8 * 1.28e12)
    assert "trainium2.html" in trn2.sources["accelerator"]


def test_the_planner_prices_trn2_from_the_neuron_fit_not_the_gpu_one():
    trn2, gpu = hardware.load("trn2.48xlarge"), hardware.load("p5en.48xlarge")
    fit = neuron_calibration.fitted()
    assert trn2.efficiency.dense == pytest.approx(fit["dense"]) and trn2.efficiency.dense != gpu.efficiency.dense
    assert trn2.efficiency.decode_bandwidth == pytest.approx(fit["decode_bandwidth"])
    assert "neuron_measurements.json" in trn2.efficiency.source
    assert trn2.efficiency.ttft_band == fit["band"] and "held-out" in trn2.efficiency.ttft_band_source
    assert "trn2.48xlarge" not in gpu_calibration.GPU_FACTOR_INSTANCES
    # The calibration row is reproduced by construction; it is the held-out row that says anything.
    (calibration,) = [r for r in fit["rows"] if r["split"] == "calibration"]
    assert calibration["error"] == pytest.approx(0, abs=1e-3)
    assert calibration["tpot_error"] == pytest.approx(0, abs=1e-3)
    assert 0 < fit["dense"] <= 0.75  # at most the kernel bound the GPU fit respects


@pytest.mark.parametrize("row", held_out(), ids=lambda r: r["id"])
def test_held_out_published_ttft_is_predicted_within_the_tolerance(row):
    """Llama-3.1-405B, 10,000 prompt tokens on one trn2.48xlarge: published 2,442 ms; the planner, fitted on the
    Llama-3.3-70B row only, predicts 2,706 ms (+11%)."""
    assert abs(row["error"]) <= TTFT_TOLERANCE, (row["predicted_ms"], row["measured_ms"])


@pytest.mark.xfail(strict=True, reason="held-out TPOT +190% (110.0 ms predicted against 37.9 ms published for "
                                       "Llama-3.1-405B): one fraction of HBM bandwidth fitted to the 70B's 19.8 ms "
                                       "does not carry to a model 5.8x larger at the same TP 64 (the 70B's step is "
                                       "mostly fixed cost, not weight reads); decode is priced from it anyway")
@pytest.mark.parametrize("row", held_out(), ids=lambda r: r["id"])
def test_held_out_published_tpot_is_predicted_within_the_tolerance(row):
    assert abs(row["tpot_error"]) <= TTFT_TOLERANCE, (row["tpot_predicted_ms"], row["tpot_measured_ms"])


def test_docs_show_the_neuron_table():
    assert neuron_calibration.markdown() in (REPO / "docs/planning.md").read_text(), \
        "regenerate: python -m turnkv.plan.neuron_calibration"


def test_trn2_plans_in_the_deployments_units_with_neurons_kv_cap_and_no_host_tier():
    """TP in logical NeuronCores as deploy/trn2.yaml counts it (16: four engines a node, each on 4 chips), the KV
    cache capped at vllm-neuron's 0.30 of the budget, and no host tier the Neuron image does not run (#45)."""
    import yaml

    from infra.config import from_mapping
    from infra.wheel import REPO_ROOT
    from turnkv import neuron
    from turnkv.commands import plan as cli

    deployed = from_mapping(yaml.safe_load((REPO_ROOT / "deploy/trn2.yaml").read_text()))
    fleet = cli.build_fleet("Qwen3-32B", "trn2.48xlarge", deployed.model.tensor_parallel_size, None, None, None, None,
                            None, "pull", 480.0, 64, True, Path(".turnkv"), None)
    assert fleet.tp_prefill == fleet.tp_decode == 4  # chips the model prices
    assert fleet.engines_per_node("decode") == deployed.engines_per_node(deployed.pools[1]) == 4
    inst = fleet.decode
    budget = 4 * inst.hbm_bytes * inst.memory_utilization
    assert inst.kv_cache_bytes(4, 65e9) == pytest.approx(neuron.KV_CAP_FRACTION * budget)
    assert inst.kv_cache_bytes(4, budget - 1e9) == pytest.approx(1e9)  # below the cap: what the weights leave
    assert hardware.INSTANCES["p5en.48xlarge"].kv_cap_fraction is None
    with pytest.raises(cli.typer.Exit):
        cli.build_fleet("Qwen3-32B", "trn2.48xlarge", 2, None, None, None, None, None, "pull", 480.0, 64, True,
                        Path(".turnkv"), None)  # half a chip: not a deployable engine the model prices
    assert not inst.host_tiers and hardware.INSTANCES["p5en.48xlarge"].host_tiers


def test_the_planner_takes_a_deploy_configs_shape(tmp_path):
    """`turnkv plan --config`: the config's instance type, TP and engines a node per role (#45)."""
    import yaml

    from infra.wheel import REPO_ROOT
    from turnkv.commands import plan as cli

    raw = yaml.safe_load((REPO_ROOT / "deploy/trn2.yaml").read_text())
    path = tmp_path / "trn2.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert cli.from_deploy_config(path, "Qwen3-8B", "p5en.48xlarge", None) == ("Qwen3-32B", "trn2.48xlarge", 16, (4, 4))
    raw["pools"][1]["engines_per_node"] = 2
    path.write_text(yaml.safe_dump(raw))
    assert cli.from_deploy_config(path, "Qwen3-32B", "p5en.48xlarge", None)[3] == (4, 2)
    with pytest.raises(cli.typer.Exit):
        cli.from_deploy_config(path, "Qwen3-32B", "p5en.48xlarge", 8)  # --tp against the config's


def test_no_offload_arm_where_the_image_runs_no_offload_tier(tmp_path):
    from typer.testing import CliRunner

    from infra.wheel import REPO_ROOT
    from turnkv.cli import app

    config = str(REPO_ROOT / "deploy/trn2.yaml")
    run = CliRunner().invoke(app, ["plan", "--config", config, "--out", str(tmp_path), "--json"])
    assert run.exit_code == 0, run.output
    verdict = json.loads((tmp_path / "plan.json").read_text())["verdict"]
    assert verdict["arms"]["peer"]["prefill_offload_gib"] == 0 and "peer+offload" not in verdict["reason"]
