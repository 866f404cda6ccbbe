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
