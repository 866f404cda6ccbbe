"""The shipped Trainium2 deploy config (deploy/trn2.yaml) synthesizes as a user's `cdk deploy` would: nag-clean,
cfn-lint clean, the Neuron image baked on a Trainium2 build instance, and each engine of a trn2 node confined to its
NeuronCores through vllm-neuron's own variable, with the config's explicit opt-in in its env."""

from __future__ import annotations

import json

import pytest
import yaml

from infra.wheel import REPO_ROOT
from tests.infra import test_compliance
from tests.infra.conftest import synthesize
from turnkv import neuron, node_env


@pytest.fixture(scope="module")
def trn2(tmp_path_factory, image_sources):
    raw = yaml.safe_load((REPO_ROOT / "deploy/trn2.yaml").read_text())
    return synthesize(raw, tmp_path_factory.mktemp("trn2"), image_sources)


def _user_data(synth) -> dict[str, str]:
    out = {}
    for res in synth.resources("serving", "AWS::EC2::LaunchTemplate").values():
        ud = res["Properties"]["LaunchTemplateData"]["UserData"]["Fn::Base64"]
        out[res["Properties"]["LaunchTemplateName"]] = ud if isinstance(ud, str) else "".join(
            p if isinstance(p, str) else "<ref>" for p in ud["Fn::Join"][1])
    return out


def test_trn2_synth_is_nag_and_cfn_lint_clean(trn2):
    nag = test_compliance._nag_report(trn2)
    assert nag["violations"] == [] and nag["conclusion"] == "success"
    test_compliance.test_cfn_lint_is_clean_on_every_template(trn2)  # in the config region, which offers trn2


def test_the_neuron_image_bakes_on_trainium2_from_the_neuron_dlami(trn2):
    (infra_config,) = trn2.resources("image", "AWS::ImageBuilder::InfrastructureConfiguration").values()
    # us-east-2 offers trn2.48xlarge but not trn2.3xlarge (infra.instances.OFFERED_AZS): the bake skips it there.
    assert infra_config["Properties"]["InstanceTypes"] == ["trn2.48xlarge"]
    (recipe,) = trn2.resources("image", "AWS::ImageBuilder::ImageRecipe").values()
    assert "/aws/service/neuron/dlami/pytorch-inference-vllm-" in json.dumps(recipe["Properties"]["ParentImage"])


def test_each_engine_of_a_trn2_node_gets_its_neuroncores_and_the_opt_in(trn2):
    texts = _user_data(trn2)
    assert set(texts) == {"turnkv-trn-prefill", "turnkv-trn-decode"}
    for text in texts.values():
        # TP 16 on 64 logical NeuronCores: four engines, each on its own range (node_env.engine_slots).
        for k in range(4):
            assert f"{neuron.VISIBLE_DEVICES} {16 * k}-{16 * k + 15} " in text  # printf '%s=%s\\n' pairs
        assert node_env.CUDA_VISIBLE_DEVICES not in text and node_env.NEURON_RT_VISIBLE_CORES not in text
        assert "TURNKV_ALLOW_UNVERIFIED=neuron" in text and "TURNKV_MODE=pull" in text
        assert "TURNKV_BACKENDS=LIBFABRIC" in text
        assert len(text.encode()) < 16384


def test_a_gpu_fleet_writes_no_opt_in(gpu):
    assert not any("TURNKV_ALLOW_UNVERIFIED" in t for t in _user_data(gpu).values())
