"""Params (every catalog tunable in SSM), network (endpoints, flow logs, no internet path) and
observability (dashboard widgets, alarms to SNS) stacks."""

from __future__ import annotations

import json
import re

import pytest
from aws_cdk.assertions import Match

from infra.instances import INSTANCE_TYPES
from tests.infra import configs
from turnkv import metric_names as mn
from turnkv import params
from turnkv.aws_params import allowed_pattern

pytestmark = pytest.mark.infra


def test_every_tunable_is_an_ssm_parameter_with_its_default(any_app):
    """Created with the deployment's default: the Tunables custom resource answers it where no value is stored
    yet (infra/lambdas/keep_tunables.py), the stored value afterwards."""
    (keeper,) = any_app.resources("params", "AWS::CloudFormation::CustomResource").values()
    spec = json.loads(keeper["Properties"]["Tunables"])
    stored = {r["Properties"]["Name"]: {**r["Properties"], "Value": spec[r["Properties"]["Value"]["Fn::GetAtt"][1]][
        "default"]} for r in any_app.resources("params", "AWS::SSM::Parameter").values()}
    name = any_app.app.config.name
    assert set(stored) == {t.ssm_path(name) for t in params.CATALOG}
    for t in params.CATALOG:
        p = stored[t.ssm_path(name)]
        expected = t.default
        if t.name == "host_kv_budget_mib":  # sized from the decode nodes: half of a p5/p5en's 2 TiB, one TP-8 engine
            expected = 1024 * 1024
        # the deploy config's tunables: section replaces the default (configs.GPU sets retained_kv_share)
        expected = any_app.app.config.tunables.get(t.name, expected)
        assert p["Value"] == str(expected) and p["Type"] == "String"
        assert p["AllowedPattern"] == allowed_pattern(t) and re.match(p["AllowedPattern"], p["Value"])
        assert t.help[:40] in p["Description"] and t.allowed in p["Description"]
    assert stored[f"/turnkv/{name}/engine/decoder_kv_blocks_ttl"]["Value"] == "480"
    assert stored[f"/turnkv/{name}/engine/kv_recompute_threshold"]["Value"] == "64"
    assert stored[f"/turnkv/{name}/router/conversation_ttl"]["Value"] == "450"


def test_the_host_tier_budget_is_sized_from_the_decode_nodes_host_memory():
    from infra.instances import host_tier_budget_mib

    assert host_tier_budget_mib("p5en.48xlarge", 8) == 1024 * 1024  # 1 TiB of the node's 2 TiB, one engine
    assert host_tier_budget_mib("p5en.48xlarge", 1) == 128 * 1024  # eight engines share it
    assert host_tier_budget_mib("trn1.32xlarge", 32) == 256 * 1024
    assert all(host_tier_budget_mib(t, 8) <= params.get("host_kv_budget_mib").maximum for t in INSTANCE_TYPES)


def test_the_routers_decode_share_follows_the_engines_max_num_seqs():
    """decode_fair_sequences is the decode engines' max_num_seqs: vLLM's default on the GPUs turnkv deploys (H100,
    H200: 1024) unless ``model.max_num_seqs`` sets theirs; the config's ``tunables`` over both."""
    import copy

    from infra.config import DeploymentConfig
    from infra.stacks.params import deployment_defaults

    assert deployment_defaults(DeploymentConfig.model_validate(configs.GPU))["decode_fair_sequences"] == 1024
    raw = copy.deepcopy(configs.GPU)
    raw["model"]["max_num_seqs"] = 256
    assert deployment_defaults(DeploymentConfig.model_validate(raw))["decode_fair_sequences"] == 256
    raw["tunables"] = {**raw.get("tunables", {}), "decode_fair_sequences": 224}  # headroom for a newcomer
    assert deployment_defaults(DeploymentConfig.model_validate(raw))["decode_fair_sequences"] == 224


def test_vpc_flow_logs_and_endpoints_without_internet_path(gpu):
    t = gpu.assertions("network")
    t.has_resource_properties("AWS::EC2::FlowLog", {"TrafficType": "ALL", "LogDestinationType": "cloud-watch-logs"})
    t.resource_count_is("AWS::EC2::NatGateway", 0)
    endpoints = [r["Properties"] for r in gpu.resources("network", "AWS::EC2::VPCEndpoint").values()]
    services = {json.dumps(e["ServiceName"]) for e in endpoints}
    for needle in ("ssm", "logs", "monitoring", "servicediscovery", "data-servicediscovery", "ecr.api", "ecr.dkr",
                   "secretsmanager", "sts", ".s3"):
        assert any(needle in s for s in services), needle
    # the private subnets route nowhere but the S3 gateway endpoint
    routes = [r["Properties"] for r in gpu.resources("network", "AWS::EC2::Route").values()]
    assert all("GatewayId" in r for r in routes)  # only the public subnets' internet gateway routes
    assert len(routes) == len(gpu.app.config.network.availability_zones)


def test_nat_when_configured(push):
    push.assertions("network").resource_count_is("AWS::EC2::NatGateway", 1)


def _dashboard(synth) -> dict:
    (dash,) = synth.resources("observability", "AWS::CloudWatch::Dashboard").values()
    body = dash["Properties"]["DashboardBody"]
    text = body if isinstance(body, str) else "".join(p if isinstance(p, str) else "<ref>"
                                                      for p in body["Fn::Join"][1])
    return json.loads(text)


def test_dashboard_widgets(any_app):
    widgets = _dashboard(any_app)["widgets"]
    titles = [w["properties"].get("title", "") for w in widgets]
    for wanted in ("TTFT p50 by reuse outcome", "TTFT p90 by reuse outcome", "TTFT p99 by reuse outcome",
                   "TTFT p99 by outcome and prompt length", "Reuse hit rate", "Reused tokens",
                   "Prefill leg time and prefill time saved", "Requests by reuse outcome", "Router errors",
                   "Engine TTFT", "Inter-token latency", "KV cache usage", "NIXL transfer time",
                   "NIXL bytes transferred", "EFA RDMA bytes", "EFA retransmits / unresponsive remotes",
                   "ALB requests and 5xx", "Healthy / unhealthy router tasks"):
        assert wanted in titles, wanted
    expressions = [m[0]["expression"] for w in widgets for m in w["properties"].get("metrics", [])
                   if isinstance(m[0], dict) and "expression" in m[0]]
    ttft = [e for e in expressions if e.startswith("SEARCH(") and f'MetricName="{mn.TTFT}"' in e]
    assert {re.search(r"'(p\d+)'", e).group(1) for e in ttft} == {"p50", "p90", "p99"}
    assert all(f'{mn.DEPLOYMENT}="{any_app.app.config.name}"' in e for e in ttft)
    text = json.dumps(widgets)
    assert mn.REUSE_OUTCOME in text and mn.PROMPT_BUCKET in text and "'p99'" in text
    for name in (mn.KV_CACHE_USAGE, mn.ENGINE_TTFT_P99, mn.ENGINE_ITL, mn.NIXL_XFER_TIME, mn.NIXL_BYTES,
                 mn.NIXL_EXPIRED, mn.EFA_RDMA_READ_BYTES, mn.EFA_RETRANS_PKTS):
        assert f'"{name}"' in text, name
    assert f'"{mn.ENGINE_NAMESPACE}"' in text


def test_gpu_widget_only_with_gpus(gpu, push):
    def has_gpu(synth):
        return any(w["properties"].get("title") == "GPU utilization" for w in _dashboard(synth)["widgets"])

    assert has_gpu(gpu) and has_gpu(push)  # every pool is a GPU pool (Neuron pools are refused)


def test_alarms_notify_an_encrypted_topic(any_app):
    t = any_app.assertions("observability")
    t.has_resource_properties("AWS::SNS::Topic", {"KmsMasterKeyId": Match.any_value()})
    alarms = any_app.resources("observability", "AWS::CloudWatch::Alarm")
    names = {a["Properties"]["AlarmName"] for a in alarms.values()}
    prefix = any_app.app.config.prefix
    assert {f"{prefix}-RouterTtftP99", f"{prefix}-Alb5xx", f"{prefix}-RouterUnhealthy"} <= names
    assert {f"{prefix}-PoolBelowDesired-{p.name}" for p in any_app.app.config.pools} <= names
    for a in alarms.values():
        assert a["Properties"]["AlarmActions"] and a["Properties"]["OKActions"], a["Properties"]["AlarmName"]
        assert a["Properties"]["AlarmDescription"]


def _thresholds(synth) -> dict[str, float]:
    prefix = synth.app.config.prefix
    return {a["Properties"]["AlarmName"].removeprefix(f"{prefix}-"): a["Properties"]["Threshold"]
            for a in synth.resources("observability", "AWS::CloudWatch::Alarm").values()}


def test_alarm_thresholds_come_from_the_config(gpu, tmp_path, image_sources):
    """The defaults are the thresholds the stack always had; a config's ``alarms`` section moves them."""
    from infra.config import AlarmsConfig
    from tests.infra.conftest import synthesize

    assert AlarmsConfig() == AlarmsConfig(ttft_p99_ms=10_000, errors_per_minute=10, kv_cache_usage_percent=95)
    default = _thresholds(gpu)
    assert (default["RouterTtftP99"], default["RouterErrors"], default["Alb5xx"],
            default["KvCacheFull-decode"]) == (10_000, 10, 10, 95)
    raw = configs.variant(configs.GPU, alarms={"ttft_p99_ms": 4000, "errors_per_minute": 3,
                                               "kv_cache_usage_percent": 90})
    moved = _thresholds(synthesize(raw, tmp_path / "out", image_sources))
    assert (moved["RouterTtftP99"], moved["RouterErrors"], moved["Alb5xx"], moved["KvCacheFull-decode"],
            moved["KvCacheFull-prefill"]) == (4000, 3, 3, 90, 90)
    assert {k: v for k, v in moved.items() if not k.startswith(("RouterTtft", "RouterErrors", "Alb5xx", "KvCache"))} \
        == {k: v for k, v in default.items() if not k.startswith(("RouterTtft", "RouterErrors", "Alb5xx", "KvCache"))}


def test_flow_log_retention_table_matches_the_config_choices(gpu):
    from aws_cdk import aws_logs as logs

    from infra.config import LOG_RETENTION_DAYS
    from infra.stacks import network

    assert tuple(network._RETENTION) == LOG_RETENTION_DAYS
    assert all(hasattr(logs.RetentionDays, name) for name in network._RETENTION.values())
    gpu.assertions("network").has_resource_properties("AWS::Logs::LogGroup", {"RetentionInDays": 90})
