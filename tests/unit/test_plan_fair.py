"""`turnkv plan` a buyer can trust (issue #28): the no-reuse arm sized on its own, engines packed per node, the
deployed block size, inputs refused as the infra and vLLM refuse them, and the assumptions printed."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from turnkv.cli import app
from turnkv.engine_args import EngineSpec
from turnkv.plan import architectures, closed_form, hardware
from turnkv.plan.workload import load, sample

ROOT = Path(__file__).resolve().parents[2]
WORKLOAD = ROOT / "bench/workloads/agentic-p5en.json"
runner = CliRunner()


def plan_json(tmp_path, *args):
    res = runner.invoke(app, ["plan", "--json", "--out", str(tmp_path), *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_the_no_reuse_arm_is_sized_on_its_own_by_the_same_function(tmp_path):
    # device only (--host-kv-gib 0): reuse's retained turns then take decode nodes of their own
    data = plan_json(tmp_path, "--model", "Qwen3-32B", "--workload", str(WORKLOAD), "--ttft-target-ms", "300",
                     "--host-kv-gib", "0")
    inst = hardware.load("p5en.48xlarge")
    fleet = closed_form.Fleet(architectures.load("Qwen3-32B"), inst, inst)
    wl = load(WORKLOAD)
    alone, met = closed_form.size_fleet(fleet, wl, 300, turns=sample(wl, 5000, 0), arm="off")
    off = data["nodes_without_reuse"]
    assert (off["prefill"], off["decode"]) == (alone.instances("prefill"), alone.instances("decode"))
    assert off["ttft_target_met"] is met is False  # 584 ms p90 unloaded: no fleet meets 300 ms without reuse
    # Without reuse decode holds only the turns in flight, not what the TTL retains: fewer decode nodes.
    assert off["decode"] < data["nodes"]["decode"]
    assert off["cost_per_hour"] == round(alone.cost_per_hour(), 2)


def test_a_small_tp_packs_engines_on_a_node_and_bills_instances(tmp_path):
    data = plan_json(tmp_path, "--model", "Qwen3-8B", "--tp", "1")
    assert data["engines_per_node"] == {"prefill": 8, "decode": 8}
    nodes, engines = data["nodes"], data["engines"]
    assert engines == {role: 8 * nodes[role] for role in ("prefill", "decode")}
    assert data["cost_per_hour"] == round(63.296 * (nodes["prefill"] + nodes["decode"]), 2)
    assert nodes["prefill"] + nodes["decode"] <= 4  # not 24 whole instances for 24 one-GPU engines


def test_engines_per_node_and_instances():
    inst = hardware.load("p5en.48xlarge")
    fleet = closed_form.Fleet(architectures.load("Qwen3-8B"), inst, inst, tp_prefill=2, tp_decode=1, prefill_nodes=5,
                             decode_nodes=9)
    assert (fleet.engines_per_node("prefill"), fleet.engines_per_node("decode")) == (4, 8)
    assert (fleet.instances("prefill"), fleet.instances("decode")) == (2, 2)
    assert fleet.cost_per_hour() == pytest.approx(4 * 63.296)
    assert (fleet.filled().prefill_nodes, fleet.filled().decode_nodes) == (8, 16)


def test_the_default_block_size_is_the_deployed_engines(tmp_path):
    assert closed_form.Fleet.block_size == EngineSpec.block_size == 128
    assert plan_json(tmp_path)["inputs"]["block_size"] == EngineSpec.block_size


@pytest.mark.parametrize("args,words", [
    (["--kv-dtype", "banana"], ["--kv-dtype 'banana'", "fp8"]),
    (["--kv-dtype", "fp4"], ["--kv-dtype 'fp4'", "bf16"]),
    (["--dtype", "int4"], ["--dtype 'int4'", "fp8"]),
    (["--tp", "3"], ["--tensor-parallel-size 3", "power of two", "1, 2, 4, 8"]),
    (["--decode-tensor-parallel-size", "6"], ["--decode-tensor-parallel-size 6", "power of two"]),
    (["--tp-decode", "6"], ["--decode-tensor-parallel-size 6", "power of two"]),  # the former name, hidden
    (["--mode", "both"], ["--mode 'both'", "pull or push"]),
])
def test_inputs_the_deployment_or_vllm_refuse_are_refused(tmp_path, args, words):
    res = runner.invoke(app, ["plan", "--out", str(tmp_path), *args])
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    for word in words:
        assert word in text, text


def test_the_tp_the_infra_accepts_is_the_tp_the_plan_accepts():
    from infra.config import _power_of_two

    _power_of_two(4)
    with pytest.raises(ValueError):
        _power_of_two(3)


def test_instances_the_infra_cannot_deploy_are_flagged(tmp_path):
    from infra.config import _instance_type

    for name, inst in hardware.INSTANCES.items():
        if name == "local-cpu":
            continue
        try:
            _instance_type(name)
            deployable = True
        except ValueError:
            deployable = False
        assert inst.deployable is deployable, name
    data = plan_json(tmp_path, "--instance", "trn1.32xlarge")
    assert data["inputs"]["deployable"] is False and "not deployable" in data["inputs"]["deployable_note"]
    # trn2 deploys behind the config's opt-in; the plan still says it is unverified.
    data = plan_json(tmp_path, "--instance", "trn2.48xlarge")
    assert data["inputs"]["deployable"] is True and "allow_unverified: [neuron]" in data["inputs"]["deployable_note"]
    res = runner.invoke(app, ["plan", "--out", str(tmp_path), "--instance", "trn2.48xlarge"])
    assert res.exit_code == 0 and "unverified: deployable only behind" in " ".join(res.output.split())


def test_the_output_states_its_assumptions(tmp_path):
    data = plan_json(tmp_path, "--workload", str(WORKLOAD))
    a = data["assumptions"]
    assert a["num_clients"] == 1024 and a["think_time_s_mean"] > 0 and a["turns_per_s"] > 0
    assert a["max_prefill_utilization"] == 0.85 and a["block_size"] == 128
    assert a["prefill_prefix_caching"] is True and a["engines_per_node"] == {"prefill": 1, "decode": 1}
    res = runner.invoke(app, ["plan", "--out", str(tmp_path), "--workload", str(WORKLOAD)],
                        env={"COLUMNS": "200"})
    text = " ".join(res.output.split())
    for words in ("1,024 clients", "think time", "turns/s", "85%", "block size 128", "prefix caching on"):
        assert words in text, words


def test_engines_sharing_a_node_are_said_to_be_what_the_stack_deploys():
    """The CDK stack runs accelerators / TP engines per instance (infra: pools[].engines_per_node), as the plan
    counts them; the output says so instead of warning that it does not."""
    from infra.config import INSTANCE_TYPES as infra_types

    result = runner.invoke(app, ["plan", "--model", "Qwen3-8B", "--tp", "1"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    assert "8/8 engines share a node here; the CDK stack runs them so by default" in result.output
    assert "one engine per instance" not in result.output
    assert hardware.load("p5en.48xlarge").devices == infra_types["p5en.48xlarge"].accelerators
