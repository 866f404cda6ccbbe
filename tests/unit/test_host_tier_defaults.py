"""The host tier a deployment's decode engines start with, decided at config time (issue #37): half the decode
node's host memory, or off for a model the host tier refuses (MLA), which ``turnkv config validate`` says."""

from __future__ import annotations

import copy
import json

from typer.testing import CliRunner

from infra import host_tier
from infra.config import DeploymentConfig
from tests.infra.configs import GPU


def config(model_id: str) -> DeploymentConfig:
    raw = copy.deepcopy(GPU)
    raw["model"] = {**raw["model"], "id": model_id}
    return DeploymentConfig.model_validate(raw)


def test_a_p5_decode_pool_gets_half_the_host_memory_and_an_mla_model_none():
    assert host_tier.default_mib(config("Qwen/Qwen3-32B")) == (1024 * 1024, "half of p5.48xlarge's host memory "
                                                                             "over its engines")
    budget, why = host_tier.default_mib(config("zai-org/GLM-5-FP8"))
    assert budget == 0 and "GLM-5-FP8 is an MLA model" in why and "FLASHMLA" in why
    assert host_tier.refusal("someone/unknown-model") is None  # caught at engine start instead


def test_config_validate_says_what_host_tier_decode_starts_with(tmp_path):
    from turnkv.cli import app

    for model_id, expected in (("Qwen/Qwen3-32B", "Host tier: 1048576 MiB per decode engine by default"),
                               ("zai-org/GLM-5-FP8", "Host tier: off by default (GLM-5-FP8 is an MLA model")):
        raw = copy.deepcopy(GPU)
        raw["model"] = {**raw["model"], "id": model_id}
        path = tmp_path / f"{model_id.replace('/', '_')}.json"
        path.write_text(json.dumps(raw))
        result = CliRunner().invoke(app, ["config", "validate", str(path)])
        assert result.exit_code == 0, result.output
        assert expected in result.output, result.output
