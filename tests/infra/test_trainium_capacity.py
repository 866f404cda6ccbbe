"""Trainium capacity and limits at `turnkv config validate` (issue #45): trn2 pools need a reservation, a Capacity Block
or an explicit On-Demand choice like P-family; a zone the offering table lacks is refused with the command that checks
it; a node whose user data would exceed EC2's 16 KB is refused with the engines a node can run (exit 2), never a
synth traceback. Pure config checks: no synth."""

from __future__ import annotations

import copy

import pytest
import yaml
from typer.testing import CliRunner

from infra import bootstrap
from infra.config import build_types_offered, check
from infra.wheel import REPO_ROOT

TRN2 = yaml.safe_load((REPO_ROOT / "deploy/trn2.yaml").read_text())


def _variant(tp: int | None = None, **pool) -> dict:
    raw = copy.deepcopy(TRN2)
    if tp is not None:
        raw["model"]["tensor_parallel_size"] = tp
    for p in raw["pools"]:
        p.update(pool)
        for key in [k for k, v in pool.items() if v is None]:
            del p[key]
    return raw


def _problems(raw) -> dict[str, str]:
    config, problems = check(raw)
    assert (config is None) == bool(problems)
    return dict(problems)


@pytest.mark.parametrize("tp", [8, 16])
def test_trn2_fleets_of_tp_8_and_16_are_valid_and_fit_the_user_data_limit(tp):
    config, problems = check(_variant(tp))
    assert problems == []
    for pool in config.pools:
        assert bootstrap.user_data_size(config, pool) <= bootstrap.USER_DATA_LIMIT


def test_a_tp4_fleet_is_refused_at_validate_with_the_engines_a_node_can_run(tmp_path):
    problems = _problems(_variant(4))
    assert set(problems) == {"pools[0]", "pools[1]"}
    message = problems["pools[0]"]
    assert "16 engines" in message and "16384-byte limit" in message
    # the most engines whose user data fits (the node's scripts grow: measured, not a constant)
    config, _ = check(_variant(4, engines_per_node=1))
    fits = max(n for n in range(1, 17)
               if bootstrap.user_data_size(config, config.pools[0], n) <= bootstrap.USER_DATA_LIMIT)
    assert 8 <= fits < 16 and f"engines_per_node: {fits} " in message and "tensor_parallel_size to 8" in message
    # The fix it names is valid, and synth's own guard agrees on the size.
    fixed = _variant(4, engines_per_node=fits)
    config, problems = check(fixed)
    assert problems == [] and bootstrap.user_data_size(config, config.pools[0]) <= bootstrap.USER_DATA_LIMIT
    path = tmp_path / "tp4.yaml"
    path.write_text(yaml.safe_dump(_variant(4)))
    from turnkv.cli import app

    run = CliRunner().invoke(app, ["config", "validate", str(path)])
    assert run.exit_code == 2 and f"engines_per_node: {fits} " in run.output and "Traceback" not in run.output


def test_trn2_pools_need_a_reservation_a_capacity_block_or_an_explicit_on_demand_choice():
    problems = _problems(_variant(allow_on_demand=None))
    assert "On-Demand Trainium capacity is rarely there" in problems["pools[0].capacity_reservation_id"]
    assert "capacity_block: true" in problems["pools[1].capacity_reservation_id"]
    block = _variant(allow_on_demand=None, capacity_reservation_id="cr-0a1b2c3d4e5f60718", capacity_block=True)
    assert _problems(block) == {}


def test_a_zone_the_offering_table_lacks_is_refused_until_confirmed():
    raw = _variant()
    raw.update(region="us-west-2", availability_zone="us-west-2b")
    raw["network"]["availability_zones"] = ["us-west-2a", "us-west-2b"]
    problems = _problems(raw)
    assert "not offered in us-west-2b" in problems["pools[0].instance_type"]
    assert "describe-instance-type-offerings --region us-west-2" in problems["pools[0].instance_type"]
    for p in raw["pools"]:
        p["offering_confirmed"] = True
    assert set(_problems(raw)) == {"image.build_instance_types"}  # the bake's types are not offered there either
    raw["image"] = {"build_instance_types": ["trn2.48xlarge"]}
    assert "image.build_instance_types" in _problems(raw)
    raw["image"] = {"ami_id": "ami-0123456789abcdef0"}
    assert _problems(raw) == {}


def test_the_bake_uses_only_build_types_the_region_offers():
    assert build_types_offered(("trn2.3xlarge", "trn2.48xlarge"), "us-east-2") == ("trn2.48xlarge",)
    assert build_types_offered(("trn2.3xlarge", "trn2.48xlarge"), "ap-south-2") == ("trn2.3xlarge", "trn2.48xlarge")
    assert build_types_offered(("g6.2xlarge", "g5.2xlarge"), "us-east-1") == ("g6.2xlarge", "g5.2xlarge")  # untracked
