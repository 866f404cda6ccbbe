"""docs/deploy-aws.md states facts the code decides: each one read from the code, so they cannot drift apart."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ami import recipes
from infra.stacks.network import INTERFACE_ENDPOINTS

pytestmark = pytest.mark.infra

DOCS = (Path(__file__).resolve().parents[2] / "docs" / "deploy-aws.md").read_text()


def test_the_interface_endpoint_count():
    counts = {int(n) for n in re.findall(r"(\d+) interface endpoints", DOCS)}
    counts |= {int(n) for n in re.findall(r"\((\d+) endpoints x", DOCS)}
    assert counts == {len(INTERFACE_ENDPOINTS)}


def test_valkeys_condition_is_the_codes():
    """RouterDeploymentConfig.uses_valkey: more than one replica can exist (max_replicas > 1)."""
    assert "router.replicas` > 1" not in DOCS and "when more than one replica)" not in DOCS
    assert DOCS.count("`router.max_replicas` > 1") >= 2


def test_the_offer_secret_goes_to_engines_and_router():
    assert "engines only" not in DOCS.lower() and "**Offer secret (engines and router).**" in DOCS


def test_the_bakes_instance_types_and_quotas_are_listed():
    for spec in recipes.IMAGES.values():
        if spec.flavor == "gpu":
            assert all(f"`{t}`" in DOCS for t in spec.build_instance_types)
    assert "Running On-Demand G and VT instances" in DOCS and "Running On-Demand P instances" in DOCS


def test_the_deploy_path_ends_with_the_smoke_test():
    path = DOCS.split("## From a fresh clone to a passing smoke test", 1)[1].split("\n## ", 1)[0]
    commands = [ln for ln in path.splitlines() if ln.startswith(("make ", "npm ", "npx ", "turnkv ", ". "))]
    assert commands[-1].startswith("turnkv smoke --url")


def test_the_quota_and_roll_figures_are_the_codes():
    """The P quota row and the roll's figures (issue 46), from infra.instances, infra.roll and infra.config."""
    from infra import roll
    from infra.config import PoolConfig
    from infra.instances import INSTANCE_TYPES

    vcpus = {INSTANCE_TYPES[t].vcpus for t in ("p5en.48xlarge", "p5.48xlarge", "p5e.48xlarge")}
    assert vcpus == {192}
    assert "192 vCPUs per p5en / p5 / p5e instance: 384 for the smallest deployment, plus 192 while a surging pool " \
           "rolls" in DOCS
    lo, hi = roll.BOOT_TO_SERVE_MIN
    assert f"a weight load ({lo}-{hi} min)" in DOCS and f"| {lo}-{hi} min |" in DOCS  # the roll, the deploy table
    assert f"(default {PoolConfig.model_fields['drain_timeout_s'].default} s) bounds the wait" in DOCS
    assert f"is {roll.HOOK_MARGIN_S} s longer" in DOCS
    assert f"takes {roll.HOOK_TIMEOUT_RANGE[0]} to {roll.HOOK_TIMEOUT_RANGE[1]:,} s" in DOCS
    assert "briefly empty" not in DOCS and "Cloud9" not in DOCS
