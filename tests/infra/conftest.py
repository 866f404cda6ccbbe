"""Synthesize each test deployment once per session (jsii start-up is the slow part).

Two apps cover the ground: ``gpu`` (p5en/p5/p5e pools, an On-Demand Capacity Reservation and a Capacity
Block, HTTPS, public ALB for one CIDR, two router replicas with Valkey) and ``push`` (p5/p5en, push mode,
NAT, HTTP, internal ALB, one replica without Valkey). Both synthesize with cdk-nag on and CloudFormation
validation off; ``test_synth_with_builtin_validation`` synthesizes once more with it on.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest

os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")
os.environ.setdefault("JSII_DEPRECATED", "quiet")

from tests.infra import configs


@dataclass
class Synth:
    """One synthesized app: the constructs, the cloud assembly folder and each stack's template."""

    app: object  # infra.app.TurnkvApp
    outdir: Path
    templates: dict[str, dict] = field(default_factory=dict)

    def template(self, role: str) -> dict:
        """Template of the stack whose id ends with ``-<role>`` (network, params, image, ...)."""
        matches = [t for name, t in self.templates.items() if name.endswith(f"-{role}")]
        assert len(matches) == 1, f"no single {role} stack in {sorted(self.templates)}"
        return matches[0]

    def assertions(self, role: str):
        from aws_cdk.assertions import Template

        return Template.from_json(self.template(role))

    def resources(self, role: str, kind: str) -> dict[str, dict]:
        return {k: v for k, v in self.template(role)["Resources"].items() if v["Type"] == kind}


@pytest.fixture(scope="session")
def image_sources(tmp_path_factory):
    """The image stack's inputs: this tree's AMI recipes and a freshly built turnkv wheel."""
    from infra.stacks.image import ImageSources
    from infra.wheel import REPO_ROOT, build_node_wheel

    wheel = build_node_wheel(tmp_path_factory.mktemp("wheel"))
    from ami import recipes

    assert Path(recipes.__file__).resolve().parent == (REPO_ROOT / "ami").resolve()
    return ImageSources(images=recipes.IMAGES, scripts_dir=recipes.SCRIPTS_DIR, wheel=wheel,
                        deploy_parameters=recipes.deploy_parameters, recipe_fingerprint=recipes.recipe_fingerprint)


def synthesize(raw: dict, outdir: Path, image_sources, validation: bool = False, nag: bool = True) -> Synth:
    import aws_cdk as cdk

    from infra.app import build
    from infra.config import from_mapping

    app = cdk.App(outdir=str(outdir), builtin_cloud_formation_validation=validation)
    result = build(app, config=from_mapping(raw), image_sources=image_sources, run_nag=nag)
    app.synth()
    templates = {s.stack_name: json.loads((outdir / f"{s.artifact_id}.template.json").read_text())
                 for s in result.stacks}
    return Synth(result, outdir, templates)


@pytest.fixture(scope="session")
def gpu(tmp_path_factory, image_sources) -> Synth:
    return synthesize(configs.GPU, tmp_path_factory.mktemp("gpu"), image_sources)


@pytest.fixture(scope="session")
def push(tmp_path_factory, image_sources) -> Synth:
    return synthesize(configs.PUSH, tmp_path_factory.mktemp("push"), image_sources)


@pytest.fixture(scope="session")
def open_router(tmp_path_factory, image_sources) -> Synth:
    """The GPU app with the listener opened to the internet on purpose."""
    raw = configs.variant(configs.GPU, **{"router.allowed_cidrs": ["0.0.0.0/0"]})
    return synthesize(raw, tmp_path_factory.mktemp("open"), image_sources)


@pytest.fixture(scope="session")
def gpu_account(tmp_path_factory, image_sources) -> Synth:
    """The GPU app with a concrete account (``account:`` in the config), as a user with credentials synthesizes
    it: ARNs render with the number, not ``<AWS::AccountId>``. Its reserved prefill pool names the cluster
    placement group its On-Demand Capacity Reservation was made in."""
    raw = configs.variant(configs.GPU, account=configs.ACCOUNT, **{"pools.0.placement_group": "odcr-cluster"})
    return synthesize(raw, tmp_path_factory.mktemp("account"), image_sources)


@pytest.fixture(scope="session", params=["gpu", "push", "gpu_account"])
def any_app(request) -> Synth:
    return request.getfixturevalue(request.param)


EXISTING_VPC = configs.variant(configs.PUSH, **{"network.existing": {
    "vpc_id": "vpc-0123456789abcdef0", "cidr": "10.1.0.0/16",
    "private_subnet_ids": ["subnet-0aaaaaaaaaaaaaaa1", "subnet-0bbbbbbbbbbbbbbb2", "subnet-0ccccccccccccccc3"]},
    "image.ami_id": "ami-0123456789abcdef0"})


@pytest.fixture(scope="session")
def existing_vpc(tmp_path_factory, image_sources) -> Synth:
    """The Neuron app in a VPC that already exists (ids only: no lookups), on an AMI the user brings."""
    return synthesize(EXISTING_VPC, tmp_path_factory.mktemp("existing"), image_sources)


@pytest.fixture(scope="session")
def tp4(tmp_path_factory, image_sources) -> Synth:
    """The GPU app at tensor-parallel size 4: two engines on every 8-GPU node."""
    raw = configs.variant(configs.GPU, **{"model.tensor_parallel_size": 4})
    return synthesize(raw, tmp_path_factory.mktemp("tp4"), image_sources)
