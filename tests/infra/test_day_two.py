"""Day two on AWS (issue 40): the synthesized templates keep what an operator changes later working, and the synth
refuses what would fail only at deploy. Each test fails on the templates of before (see the commit messages)."""

from __future__ import annotations

import json

import pytest

from infra.config import ConfigError
from tests.infra import configs
from tests.infra.conftest import synthesize

pytestmark = pytest.mark.infra


def _one(synth, role: str, kind: str) -> dict:
    (resource,) = synth.resources(role, kind).values()
    return resource["Properties"]


def test_the_alb_has_no_fixed_name(any_app):
    """Toggling router.public replaces the ALB (its Scheme); CloudFormation creates the new one first, which a
    fixed name makes fail ("already exists"). The DNS name is a stack output instead."""
    assert "Name" not in _one(any_app, "router", "AWS::ElasticLoadBalancingV2::LoadBalancer")
    outputs = any_app.template("router")["Outputs"]
    assert any(k.startswith("AlbDnsName") for k in outputs), sorted(outputs)


def test_router_tasks_drain_as_long_as_a_stream_may_stay_silent(any_app):
    """A router deploy or scale-in deregisters tasks: with 120 s of draining against a 900 s idle timeout, long
    streams were cut on every deploy."""
    attrs = {a["Key"]: a["Value"] for a in
             _one(any_app, "router", "AWS::ElasticLoadBalancingV2::TargetGroup")["TargetGroupAttributes"]}
    idle = any_app.app.config.router.idle_timeout_s
    assert int(attrs["deregistration_delay.timeout_seconds"]) == min(idle, 3600) >= 900


def test_a_deploy_leaves_the_autoscaled_task_count_alone(any_app):
    """A DesiredCount in the template resets the count autoscaling chose on every deploy; without it ECS keeps the
    running count and the scalable target's minimum is router.replicas."""
    rc = any_app.app.config.router
    assert "DesiredCount" not in _one(any_app, "router", "AWS::ECS::Service")
    target = _one(any_app, "router", "AWS::ApplicationAutoScaling::ScalableTarget")
    assert (target["MinCapacity"], target["MaxCapacity"]) == (rc.replicas, rc.max_replicas)


def test_mark_unhealthy_names_only_this_deployments_groups(any_app):
    """turnkv-prod-* would also match deployment prod-x's groups (turnkv-prod-x-decode)."""
    config = any_app.app.config
    statements = [s for p in any_app.resources("serving", "AWS::IAM::Policy").values()
                  for s in p["Properties"]["PolicyDocument"]["Statement"] if s.get("Sid") == "MarkUnhealthy"]
    (statement,) = statements
    resources = statement["Resource"] if isinstance(statement["Resource"], list) else [statement["Resource"]]
    flat = ["".join(p if isinstance(p, str) else "<token>" for p in r["Fn::Join"][1]) if isinstance(r, dict) else r
            for r in resources]
    names = sorted(r.split(":autoScalingGroupName/", 1)[1] for r in flat)
    assert names == sorted(f"{config.prefix}-{p.name}" for p in config.pools)


def test_user_data_over_ec2s_limit_stops_the_synth(tmp_path, image_sources):
    """EC2 refuses user data over 16 KB at launch (after the bake); the deploy config's check (the synth's first
    step, and `turnkv config validate`'s) measures it with the deploy-time values in place of its tokens and
    refuses it, naming the pool and the fix."""
    raw = configs.variant(configs.PUSH, **{"model.tensor_parallel_size": 1, "pools.0.engines_per_node": 8,
                                           "model.served_model_name": "m" * 900})
    with pytest.raises(ValueError, match=r"pools\[0\]: a p5\.48xlarge node of 8 engines needs \d+ bytes of user "
                                         r"data, over EC2's 16384-byte limit; set pools\[0\]\.engines_per_node"):
        synthesize(raw, tmp_path, image_sources)


def test_a_p_family_pool_without_a_reservation_stops_the_synth(tmp_path, image_sources):
    raw = configs.variant(configs.PUSH, **{"pools.0.allow_on_demand": False})
    with pytest.raises(ConfigError, match=r"pools\[0\]\.capacity_reservation_id: missing for p5\.48xlarge"):
        synthesize(raw, tmp_path, image_sources)


def test_the_bake_waits_for_its_roles_policy(gpu):
    """The build instance downloads the scripts and the wheel with the build role's grants (its DefaultPolicy):
    the image must be created after that policy, not only after the role (through the instance profile)."""
    template = gpu.template("image")
    policies = {k for k, v in template["Resources"].items()
                if v["Type"] == "AWS::IAM::Policy" and k.startswith("BuildRoleDefaultPolicy")}
    assert policies
    for name, image in template["Resources"].items():
        if image["Type"] == "AWS::ImageBuilder::Image":
            assert policies <= set(image.get("DependsOn", [])), name


def test_engine_root_volumes_fit_the_image_and_the_bill(any_app):
    """Weights go to the instance NVMe: the root volume holds the image (at least its snapshot's 200 GiB) and
    caches, at gp3's baseline IOPS, not 1000 GiB at 16k IOPS (~$180 a month per node)."""
    from ami import recipes

    baked = max(spec.volume_size_gib for spec in recipes.IMAGES.values())
    for name, lt in any_app.resources("serving", "AWS::EC2::LaunchTemplate").items():
        (root,) = [b["Ebs"] for b in lt["Properties"]["LaunchTemplateData"]["BlockDeviceMappings"]]
        assert baked <= root["VolumeSize"] <= 300 and root["Iops"] == 3000 and root["VolumeType"] == "gp3", name


def test_pool_and_efa_alarms_need_more_than_one_datapoint(any_app):
    """PoolBelowDesired and EfaUnresponsive fired on 1 of 3 datapoints (EFA on every peer replacement)."""
    for alarm in any_app.resources("observability", "AWS::CloudWatch::Alarm").values():
        p = alarm["Properties"]
        if "PoolBelowDesired" in p["AlarmName"] or "EfaUnresponsive" in p["AlarmName"]:
            assert p["DatapointsToAlarm"] == p["EvaluationPeriods"] >= 3, p["AlarmName"]


def test_the_dashboard_picture_is_drawn_from_the_synthesized_body(gpu, tmp_path):
    """docs/dashboard.png comes from infra.dashboard_picture over the observability template: every widget placed,
    the TTFT-by-reuse-outcome graphs named with their per-outcome lines."""
    from pathlib import Path

    from infra import dashboard_picture

    body = dashboard_picture.dashboard_body(gpu.template("observability"))
    titles = [w["properties"].get("title", "") for w in body["widgets"]]
    ttft = body["widgets"][titles.index("TTFT p50 by reuse outcome")]["properties"]
    assert dashboard_picture.metric_labels(ttft) == ["TTFT p50 (a line per ReuseOutcome)"]
    out = dashboard_picture.render(body, tmp_path / "d.png", "test")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    committed = Path(__file__).resolve().parents[2] / "docs" / "dashboard.png"
    assert committed.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "](docs/dashboard.png)" in (committed.parents[1] / "README.md").read_text()


def test_a_capacity_block_warns_before_it_ends(gpu):
    """EC2 terminates a Capacity Block's instances 30 minutes before its end and warns 10 minutes earlier on
    EventBridge: the warning reaches the engine events topic (alarm_email), for the pool's block only."""
    from infra.stacks.serving import CAPACITY_BLOCK_WARNINGS

    (rule,) = [r["Properties"] for r in gpu.resources("serving", "AWS::Events::Rule").values()
               if r["Properties"]["EventPattern"].get("source") == ["aws.ec2"]]
    assert rule["EventPattern"]["detail-type"] == list(CAPACITY_BLOCK_WARNINGS)
    assert rule["EventPattern"]["detail"] == {"capacity-reservation-id": ["cr-0f1e2d3c4b5a69788"]}
    (target,) = rule["Targets"]
    assert "EngineEvents" in json.dumps(target["Arn"])
