"""The roll of a new image or user data over the engine pools (infra/roll.py): order, surge, the hook's bound and
the cost ``turnkv config validate`` states before the deploy."""

from __future__ import annotations

from infra import roll
from infra.config import from_mapping
from tests.infra import configs


def test_example_sized_pools_state_that_a_roll_empties_each_role():
    """The example's reserved count-1 pools: no room to surge, one node a role: both roles go empty in turn (one
    at a time now, never together), and the plan says so with the choices."""
    config = from_mapping(configs.variant(configs.GPU, pools=[
        {"name": "prefill", "role": "prefill", "instance_type": "p5en.48xlarge", "count": 1,
         "capacity_reservation_id": "cr-0a1b2c3d4e5f60718"},
        {"name": "decode", "role": "decode", "instance_type": "p5en.48xlarge", "count": 1,
         "capacity_reservation_id": "cr-0f1e2d3c4b5a69788"}]))
    lines = roll.plan(config)
    assert lines[0].startswith("prefill (prefill, 1 x p5en.48xlarge): one node at a time, in place")
    assert "0 of 1 in service" in lines[0]
    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(warnings) == 2 and "empties prefill" in warnings[0] and "empties decode" in warnings[1]
    assert "roll_surge: true" in warnings[0] and "15-30 min" in warnings[0]
    assert roll.peak_vcpus(config) == 384  # no surge: the pools' own


def test_a_reservation_with_room_surges_and_keeps_the_role_serving():
    raw = configs.variant(configs.GPU, **{"pools.2.roll_surge": True, "pools.0.drain_timeout_s": 1800})
    config = from_mapping(raw)
    rolls = {p.name: roll.pool_roll(p) for p in config.pools}
    assert (rolls["decode-block"].max_size, rolls["decode-block"].min_in_service) == (2, 1)
    assert (rolls["prefill"].max_size, rolls["prefill"].min_in_service) == (2, 1)  # reserved: in place
    assert (rolls["decode"].max_size, rolls["decode"].min_in_service) == (3, 2)  # on demand: surge
    assert rolls["prefill"].hook_timeout_s == 1800 + roll.HOOK_MARGIN_S
    assert rolls["decode"].hook_timeout_s == 900 + roll.HOOK_MARGIN_S
    assert not any(line.startswith("warning:") for line in roll.plan(config))
    # groups roll one at a time: the pools' 5 x 192 vCPUs plus one surge instance, never two
    assert roll.peak_vcpus(config) == 5 * 192 + 192


def test_prefill_pools_roll_before_decode_pools():
    config = from_mapping(configs.variant(configs.GPU, pools=[
        {"name": "decode", "role": "decode", "instance_type": "p5.48xlarge", "count": 1, "allow_on_demand": True},
        {"name": "prefill", "role": "prefill", "instance_type": "p5.48xlarge", "count": 1, "allow_on_demand": True},
        {"name": "decode-b", "role": "decode", "instance_type": "p5.48xlarge", "count": 1, "allow_on_demand": True}]))
    assert [p.name for p in roll.roll_order(config.pools)] == ["prefill", "decode", "decode-b"]


def test_the_longest_drain_the_config_takes_fits_the_hooks_limit():
    config = from_mapping(configs.variant(configs.GPU, **{"pools.0.drain_timeout_s": 7140}))
    assert roll.pool_roll(config.pools[0]).hook_timeout_s == roll.HOOK_TIMEOUT_RANGE[1]
    try:
        from_mapping(configs.variant(configs.GPU, **{"pools.0.drain_timeout_s": 7141}))
    except Exception as exc:
        assert "7200 s" in str(exc)
    else:
        raise AssertionError("a drain past the hook's limit was accepted")


def test_only_pools_without_a_reservation_use_the_deployments_placement_group():
    """A deployment of reserved pools only created a cluster placement group no instance launched into."""
    config = from_mapping(configs.GPU)
    assert [p.joins_deployment_placement_group for p in config.pools] == [False, True, False]
    reserved = from_mapping(configs.variant(configs.GPU, **{"pools.1.capacity_reservation_id": "cr-0a1b2c3d4e5f60719",
                                                            "pools.1.allow_on_demand": False}))
    assert not any(p.joins_deployment_placement_group for p in reserved.pools)



def test_config_validate_states_the_rolls_cost(tmp_path):
    import json

    from typer.testing import CliRunner

    from turnkv.cli import app

    path = tmp_path / "prod.json"
    path.write_text(json.dumps(configs.GPU))
    done = CliRunner().invoke(app, ["config", "validate", str(path)])
    assert done.exit_code == 0, done.output
    assert "A roll (new image or user data), one group at a time; P/Trn vCPUs at its peak: 1152:" in done.output
    lines = [line.strip() for line in done.output.splitlines()]
    assert lines.index(next(x for x in lines if x.startswith("prefill (prefill"))) < lines.index(
        next(x for x in lines if x.startswith("decode (decode")))
    assert "decode-block (decode, 1 x p5e.48xlarge): one node at a time, in place (no room to surge); 0 of 1" in \
        done.output
    assert "warning:" not in done.output  # decode keeps the on-demand pool's engines while the block rolls
