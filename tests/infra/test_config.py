"""The deployment config: valid ones parse; each mistake fails with the field and the fix."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from infra.config import ConfigError, from_context, from_mapping
from tests.infra import configs
from turnkv.engine_args import Mode, Role

pytestmark = pytest.mark.infra


def test_each_default_is_written_once_in_the_models():
    """The models hold the defaults (pydantic fields); parsing fills them in, nothing repeats them."""
    from infra import config

    c = from_mapping(configs.PUSH)
    assert c.router.cpu == config.RouterDeploymentConfig.model_fields["cpu"].default == 1024
    assert c.network.cidr == config.NetworkConfig.model_fields["cidr"].default
    assert c.router.memory_mib == 2048 and c.model.s3_uri is None and c.pools[0].count == 1
    assert c.network.availability_zones == ("us-east-2a", "us-east-2b", "us-east-2c")
    source = (Path(config.__file__)).read_text()
    assert source.count('"10.40.0.0/16"') == 1
    assert len(re.findall(r"^\s+idle_timeout_s:.*= 900$", source, re.M)) == 1 and source.count("= 900") == 2  # + drain


def test_gpu_config_parses_with_types():
    c = from_mapping(configs.GPU)
    assert c.name == "gpu" and c.prefix == "turnkv-gpu"
    assert [p.role for p in c.pools] == [Role.PREFILL, Role.DECODE, Role.DECODE]
    assert c.pools[2].capacity_block and c.pools[2].capacity_reservation_id == "cr-0f1e2d3c4b5a69788"
    assert c.connector.mode is Mode.PULL and c.router.uses_valkey
    assert c.ami_parameter("gpu") == "/turnkv/gpu/ami/gpu"
    assert c.network.vpc_cidr == "10.40.0.0/16"


def test_cdk_json_example_is_valid():
    from infra.wheel import REPO_ROOT

    context = json.loads((REPO_ROOT / "cdk.json").read_text())["context"]
    c = from_context(context["turnkv"], None)
    assert {p.role for p in c.pools} == {Role.PREFILL, Role.DECODE}
    assert not c.router.public and c.router.idle_timeout_s >= 900


def _problems(raw) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        from_mapping(raw)
    assert "turnkv deployment config is invalid" in str(info.value)
    return dict(info.value.problems)


@pytest.mark.parametrize(("changes", "field", "fix"), [
    ({"name": "Prod_1"}, "name", "lowercase"),
    ({"region": "useast"}, "region", "us-east-2"),
    ({"availability_zone": "us-west-2a"}, "availability_zone", "use e.g. us-east-2a"),
    ({"pools.0.instance_type": "p4d.24xlarge"}, "pools[0].instance_type", "use one of p5en.48xlarge"),
    ({"pools.0.role": "both"}, "pools[0].role", "prefill, decode"),
    ({"pools.0.capacity_reservation_id": "reservation-1"}, "pools[0].capacity_reservation_id", "cr-"),
    ({"pools.1.capacity_block": True}, "pools[1].capacity_block", "capacity_reservation_id"),
    ({"pools.0.count": -1}, "pools[0].count", "1 .. 64"),
    ({"pools.0.count": 0}, "pools[0].count", "every role needs a pool"),
    ({"pools.1.allow_on_demand": False}, "pools[1].capacity_reservation_id",
     "launch fails with InsufficientInstanceCapacity after the 1-2 h bake"),
    ({"pools.0.capacity_reservation_id": "cr-0123456789abcdef0"}, "pools[0].capacity_reservation_id",
     "the example's placeholder; put the id of your own"),
    ({"model.s3_uri": "s3://acme-llm-weights/Qwen3-32B/"}, "model.s3_uri", "is a placeholder"),
    ({"tunables": {"decoder_kv_blocks_ttl": 99999}}, "tunables.decoder_kv_blocks_ttl", "out of range"),
    ({"tunables": {"kv_ttl": 100}}, "tunables.kv_ttl", "unknown tunable 'kv_ttl'"),
    ({"region": "us-east-9"}, "region", "'us-east-9' is no AWS region; use us-east-2 or us-east-1"),
    ({"model.max_model_len": 999999}, "model.max_model_len", "more than Qwen/Qwen3-32B serves (40,960"),
    ({"tunables": {"conversation_ttl": 900}}, "tunables", "must stay below decoder_kv_blocks_ttl"),
    # issue #51 item 3: a host tier the decode node cannot back (p5.48xlarge: 2,048 GiB, one TP-8 engine).
    ({"tunables": {"host_kv_budget_mib": 4000000}}, "tunables.host_kv_budget_mib", "use at most 1572864"),
    ({"model.tensor_parallel_size": 6}, "model.tensor_parallel_size", "power of two"),
    ({"model.tensor_parallel_size": 16}, "model.tensor_parallel_size", "lower it or pick a larger instance type"),
    ({"model.s3_uri": None}, "model.s3_uri", "network.nat_gateways: 1"),
    ({"pools.0.engines_per_node": 0}, "pools[0].engines_per_node", "1 .. 64"),
    ({"pools.0.engines_per_node": 2}, "pools[0].engines_per_node", "use at most 1, or leave it out"),
    ({"pools.1.engines_per_node": 3, "model.tensor_parallel_size": 4}, "pools[1].engines_per_node",
     "3 engines of tensor-parallel size 4 need 12 accelerators; p5.48xlarge has 8"),
    ({"model.id": "Qwen/Qwen3 32B"}, "model.id", "letters, digits"),
    ({"connector.mode": "teleport"}, "connector.mode", "pull, push"),
    # Refused at synth, not at deploy or on the node (turnkv.neuron.TRN1_REFUSAL).
    ({"pools.0.instance_type": "trn2.48xlarge", "pools.1.instance_type": "trn2.48xlarge",
      "pools.2.instance_type": "trn1.32xlarge", "model.tensor_parallel_size": 8},
     "pools[2].instance_type", "runs on Trn2 and Trn3 only"),
    ({"model.s3_uri": "s3://replace-me-model-bucket/Qwen3-32B/"}, "model.s3_uri", "is a placeholder; upload"),
    ({"model.s3_uri": "s3://my-bucket/Qwen3-32B/"}, "model.s3_uri", "network.nat_gateways: 1"),
    ({"network.cidr": "10.40.0.0/20"}, "network.cidr", "use a /18 or larger block"),
    ({"network.cidr": "10.40.0.0/19"}, "network.cidr", "2 AZs need a public /24 and a private /20 each (12288)"),
    ({"router.certificate_arn": None}, "router.certificate_arn", "router.allow_http: true"),
    ({"pools.1.placement_group": "my-cluster"}, "pools[1].placement_group", "set capacity_reservation_id too"),
    ({"pools.2.placement_group": "my-cluster"}, "pools[2].placement_group", "a Capacity Block places"),
    ({"router.allowed_cidrs": []}, "router.allowed_cidrs", "write 0.0.0.0/0 explicitly"),
    ({"router.allowed_cidrs": ["10.0.0.0/33"]}, "router.allowed_cidrs[0]", "CIDR block"),
    ({"router.max_replicas": 1}, "router.max_replicas", "raise it"),
    ({"router.cpu": 300}, "router.cpu", "Fargate takes one of"),
    ({"router.certificate_arn": "arn:aws:acm:us-east-1:123456789012:certificate/"
                                "12345678-1234-1234-1234-123456789012"}, "router.certificate_arn", "us-east-2"),
    ({"router.idle_timeout_s": 30}, "router.idle_timeout_s", "60 .. 4000"),
    ({"network.availability_zones": ["us-east-2a"]}, "network.availability_zones", "at least two"),
    ({"network.cidr": "10.0.0.0/24"}, "network.cidr", "/18 or larger"),
    ({"alarm_email": "nobody"}, "alarm_email", "e-mail"),
    ({"alarms.kv_cache_usage_percent": 120}, "alarms.kv_cache_usage_percent", "1 .. 100"),
    ({"alarms.ttft_p99_ms": 0}, "alarms.ttft_p99_ms", "1 .. 3600000"),
    ({"alarms.errors_per_minute": -1}, "alarms.errors_per_minute", "0 .. 1000000"),
    ({"network.flow_log_retention_days": 100}, "network.flow_log_retention_days", "one of 1, 3, 5"),
    ({"router.replicas": "two"}, "router.replicas", "is not an integer"),
    ({"media_domains": ["https://images.example.com/"]}, "media_domains[0]", "not a DNS host name"),
    ({"media_domains": ["*.example.com"]}, "media_domains[0]", "no scheme, port, path or wildcard"),
    ({"media_domains": ["169.254.169.254"]}, "media_domains[0]", "not a DNS host name"),
    ({"media_domains": ["metadata.google.internal"]}, "media_domains[0]", "names this network's inside"),
])
def test_bad_values_name_the_field_and_the_fix(changes, field, fix):
    problems = _problems(configs.variant(configs.GPU, **changes))
    assert field in problems, problems
    assert fix in problems[field], problems[field]
    # every problem reads "what is wrong; how to fix it"
    assert all("; " in message for message in problems.values()), problems


def test_unknown_fields_are_named_with_the_known_ones():
    raw = configs.variant(configs.GPU)
    raw["pools"][0]["instance"] = "p5en.48xlarge"
    raw["routr"] = {}
    problems = _problems(raw)
    assert "known fields here" in problems["pools[0].instance"] and "instance_type" in problems["pools[0].instance"]
    assert "routr" in problems


def test_all_problems_are_reported_at_once():
    raw = configs.variant(configs.GPU, **{"name": "X", "pools.0.count": 99, "router.cpu": 3})
    assert {"name", "pools[0].count", "router.cpu"} <= set(_problems(raw))


def test_pools_need_both_roles_unique_names_and_one_accelerator_family():
    only_prefill = configs.variant(configs.GPU)
    only_prefill["pools"] = [only_prefill["pools"][0]]
    assert "no decode pool" in _problems(only_prefill)["pools"]
    dup = configs.variant(configs.GPU, **{"pools.1.name": "prefill"})
    assert "used twice" in _problems(dup)["pools"]
    mixed = configs.variant(configs.GPU, **{"pools.1.instance_type": "trn2.48xlarge"})
    assert "different accelerator families" in _problems(mixed)["pools"]


def test_missing_required_fields():
    problems = _problems({"region": "us-east-2"})
    assert "required" in problems["name"] and "required" in problems["availability_zone"]
    assert "at least one prefill and one decode pool" in problems["pools"]


def test_existing_vpc_needs_one_private_subnet_per_az():
    raw = configs.variant(configs.GPU, **{"router.public": False, "network.existing": {
        "vpc_id": "vpc-0123456789abcdef0", "cidr": "10.1.0.0/16",
        "private_subnet_ids": ["subnet-0123456789abcdef0"]}})
    assert "one subnet per" in _problems(raw)["network.existing.private_subnet_ids"]
    raw["network"]["existing"]["private_subnet_ids"].append("subnet-0fedcba9876543210")
    c = from_mapping(raw)
    raw["router"]["public"] = True
    assert "public_subnet_ids" in _problems(raw)["router.public"]
    assert c.network.existing.vpc_id == "vpc-0123456789abcdef0" and c.network.vpc_cidr == "10.1.0.0/16"


def test_config_file_yaml_and_json(tmp_path):
    import yaml

    y = tmp_path / "prod.yaml"
    y.write_text(yaml.safe_dump(configs.PUSH))
    assert from_context(None, str(y)).name == "push"
    j = tmp_path / "prod.json"
    j.write_text(json.dumps(configs.GPU))
    assert from_context({"ignored": True}, str(j)).name == "gpu"
    with pytest.raises(ConfigError, match="does not exist"):
        from_context(None, str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="no config"):
        from_context(None, None)


def test_app_main_reports_config_errors_without_a_traceback(capsys):
    import aws_cdk as cdk

    from infra import app

    bad = cdk.App(context={"turnkv": configs.variant(configs.GPU, **{"router.cpu": 3})})
    assert app.main(bad) == 1
    err = capsys.readouterr().err
    assert "router.cpu: 3 is not a Fargate CPU size; Fargate takes one of" in err


def test_trn2_pools_need_the_explicit_opt_in_and_pull_mode():
    raw = configs.variant(configs.PUSH, **{"pools.0.instance_type": "trn2.48xlarge",
                                           "pools.1.instance_type": "trn2.48xlarge"})
    problems = _problems(raw)
    assert set(problems) == {"connector.allow_unverified", "connector.mode"}
    assert "allow_unverified: [neuron]" in problems["connector.allow_unverified"]
    assert "read mode only" in problems["connector.mode"]
    ok = configs.variant(raw, **{"connector.mode": "pull", "connector.allow_unverified": ["neuron"]})
    assert from_mapping(ok).connector.allow_unverified == ("neuron",)
    # Only a platform turnkv knows to be unverified can be named.
    assert "neuron" in _problems(configs.variant(ok, **{"connector.allow_unverified": ["tpu"]}))[
        "connector.allow_unverified[0]"]


def test_the_config_opt_in_names_every_unverified_platform():
    import typing

    from infra.config import ConnectorConfig
    from turnkv import platforms

    (literal,) = typing.get_args(ConnectorConfig.model_fields["allow_unverified"].annotation)[:1]
    assert set(typing.get_args(literal)) == set(platforms.UNVERIFIED)


def test_the_smallest_vpc_that_fits_synthesizes(tmp_path):
    """The size check is the allocation CDK makes: a /18 holds two AZs' subnets (a /19 does not, above)."""
    from infra.config import subnet_addresses

    assert subnet_addresses(2) == 12288 and subnet_addresses(3) == 16384
    assert from_mapping(configs.variant(configs.GPU, **{"network.cidr": "10.40.0.0/18"})).network.cidr


def test_http_on_a_public_alb_only_when_allowed_explicitly():
    raw = configs.variant(configs.GPU, **{"router.certificate_arn": None, "router.allow_http": True})
    assert from_mapping(raw).router.allow_http
    assert from_mapping(configs.PUSH).router.certificate_arn is None  # an internal ALB may serve HTTP


def test_a_reservation_in_a_cluster_placement_group_names_it():
    c = from_mapping(configs.variant(configs.GPU, **{"pools.0.placement_group": "odcr-cluster"}))
    assert c.pools[0].placement_group == "odcr-cluster"


def test_engines_per_node_defaults_to_every_accelerator_and_may_be_lowered():
    tp4 = from_mapping(configs.variant(configs.GPU, **{"model.tensor_parallel_size": 4}))
    assert [tp4.engines_per_node(p) for p in tp4.pools] == [2, 2, 2]
    tp8 = from_mapping(configs.GPU)
    assert [tp8.engines_per_node(p) for p in tp8.pools] == [1, 1, 1]
    one = from_mapping(configs.variant(configs.GPU, **{"model.tensor_parallel_size": 1, "pools.1.engines_per_node": 3}))
    assert [one.engines_per_node(p) for p in one.pools] == [8, 3, 8]


def test_every_problem_at_once_with_a_wrong_region():
    """Issue #49: two bad tunables read as "1 problem", and a wrong region stopped the rules that read it (the
    context length among them). Now each is its own problem, and a wrong region's rules run with its AZ's region."""
    problems = _problems(configs.variant(configs.GPU, **{
        "region": "us-east-9", "model.max_model_len": 999999,
        "tunables": {"decoder_kv_blocks_ttl": -5, "kv_recompute_threshold": "abc", "decoder_kv_block_ttl": 60}}))
    assert set(problems) == {"region", "model.max_model_len", "tunables.decoder_kv_blocks_ttl",
                             "tunables.kv_recompute_threshold", "tunables.decoder_kv_block_ttl"}, problems
    assert "did you mean decoder_kv_blocks_ttl" in problems["tunables.decoder_kv_block_ttl"]
    assert problems["tunables.kv_recompute_threshold"].startswith("'abc' is not a number")
