"""What the real services refuse and moto accepts, read from the synthesized templates (issue 27).

Each rule is one AWS behaviour a first `cdk deploy --all` or `cdk destroy --all` on a real account would hit:
ElastiCache's user-group rule, S3's refusal to delete a bucket that holds objects, an Auto Scaling group that
never sees a dead engine, user data that stops before enabling its units, EC2's refusal of
AssociatePublicIpAddress with several interfaces, and Image Builder's 120-minute default step timeout.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from turnkv import metric_names as mn
from turnkv import node_env

pytestmark = pytest.mark.infra

RETAINED = {"Retain", "RetainExceptOnCreate", "Snapshot"}


def _flat(value: Any) -> str:
    """A template string value with every token (Ref, GetAtt, ...) as the placeholder TOKEN."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        if set(value) == {"Fn::Base64"}:
            return _flat(value["Fn::Base64"])
        if set(value) == {"Fn::Join"}:
            sep, parts = value["Fn::Join"]
            return sep.join(_flat(p) for p in parts)
        if set(value) == {"Fn::Sub"} and isinstance(value["Fn::Sub"], str):
            return value["Fn::Sub"]
    return "TOKEN"


def _all_resources(synth) -> dict[str, dict]:
    return {f"{stack}/{k}": v for stack, t in synth.templates.items() for k, v in t["Resources"].items()}


def _user_data(synth) -> list[str]:
    templates = synth.resources("serving", "AWS::EC2::LaunchTemplate").values()
    scripts = [_flat(t["Properties"]["LaunchTemplateData"]["UserData"]) for t in templates]
    assert scripts
    return scripts


def _alarm_metrics(synth) -> list[dict]:
    """Every metric an alarm watches (a plain alarm's own fields, or each MetricStat of a labelled one)."""
    out = []
    for alarm in synth.resources("observability", "AWS::CloudWatch::Alarm").values():
        props = alarm["Properties"]
        if "MetricName" in props:
            out.append(props)
        out += [m["MetricStat"]["Metric"] for m in props.get("Metrics", []) if "MetricStat" in m]
    return out


def test_valkey_users_all_authenticate(gpu):
    """ElastiCache RBAC: a Valkey user group takes only users with a password or IAM authentication."""
    users = gpu.resources("router", "AWS::ElastiCache::User")
    assert {u["Properties"]["UserName"] for u in users.values()} >= {"default"}
    for name, user in users.items():
        mode = user["Properties"].get("AuthenticationMode", {})
        assert mode.get("Type") in {"password", "iam"}, f"{name}: {mode}"
        if mode["Type"] == "password":
            assert mode.get("Passwords"), name
    default = next(u["Properties"] for u in users.values() if u["Properties"]["UserName"] == "default")
    assert default["AccessString"] == "off -@all"


@pytest.mark.parametrize("app", ["gpu", "push"])
def test_valkey_exists_exactly_when_more_than_one_router_replica_can(app, request):
    synth = request.getfixturevalue(app)
    caches = synth.resources("router", "AWS::ElastiCache::ServerlessCache")
    assert bool(caches) == synth.app.config.router.uses_valkey == (synth.app.config.router.max_replicas > 1)


def test_buckets_are_emptied_on_delete_or_retained_on_purpose(any_app):
    """S3 refuses to delete a bucket that holds objects: `cdk destroy` would stop there, with the engines up."""
    resources = _all_resources(any_app)
    auto_deleted = set()
    for res in resources.values():
        if res["Type"] == "Custom::S3AutoDeleteObjects":
            ref = res["Properties"]["BucketName"]
            auto_deleted.add(ref.get("Ref") if isinstance(ref, dict) else ref)
    buckets = {k: v for k, v in resources.items() if v["Type"] == "AWS::S3::Bucket"}
    assert buckets
    for key, bucket in buckets.items():
        logical = key.split("/", 1)[1]
        assert bucket.get("DeletionPolicy") in RETAINED or logical in auto_deleted, \
            f"{key}: DeletionPolicy {bucket.get('DeletionPolicy')} and no auto-delete"


def test_user_data_enables_every_unit_before_starting_any(any_app):
    """A failed start under `set -e` must not leave the register or metrics units un-enabled."""
    for script in _user_data(any_app):
        lines = [ln.strip() for ln in script.splitlines() if ln.strip().startswith("systemctl ")]
        assert not any("--now" in ln for ln in lines), lines
        enables = [i for i, ln in enumerate(lines) if ln.startswith("systemctl enable")]
        starts = [i for i, ln in enumerate(lines) if ln.startswith("systemctl start")]
        assert enables and starts and max(enables) < min(starts), lines
        enabled = {u for i in enables for u in lines[i].split()[2:]}
        started = {u for i in starts for u in lines[i].split()[2:] if not u.startswith("-")}
        assert started <= enabled
        assert {node_env.ENGINE_SERVICE, node_env.REGISTER_SERVICE, "turnkv-metrics.service"} <= enabled


def test_health_checks_see_the_engine(any_app):
    """The group's EC2 check sees only the instance: the node marks itself unhealthy when its boot fails or its
    engine never registers, and an alarm counts the engines registered per role."""
    for script in _user_data(any_app):
        assert "set-instance-health" in script and "--health-status Unhealthy" in script
        trap = re.search(r"^trap (\w+) EXIT$", script, re.M)
        assert trap, "user data has an exit trap"
        handler = re.search(rf"^{trap.group(1)}\(\) {{\n(.*?)^}}", script, re.M | re.S)
        assert handler and "mark_unhealthy" in handler.group(1), "user data's failure path marks the node unhealthy"
        register = script.split("turnkv: register this engine", 1)[1]
        failure = register.split("engine never became healthy", 1)[1].split("exit 1", 1)[0]
        assert "mark_unhealthy" in failure
    policies = any_app.resources("serving", "AWS::IAM::Policy")
    actions = {a for p in policies.values() for s in p["Properties"]["PolicyDocument"]["Statement"]
               for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])}
    assert "autoscaling:SetInstanceHealth" in actions
    watched = {d["Value"] for metric in _alarm_metrics(any_app) if metric.get("MetricName") == mn.REGISTERED_ENGINES
               for d in metric["Dimensions"] if d["Name"] == mn.ROLE}
    assert watched == {p.role.value for p in any_app.app.config.pools}


def test_no_public_ip_key_on_multi_interface_templates(any_app):
    """EC2 refuses AssociatePublicIpAddress on a launch template with several network interfaces."""
    for name, lt in any_app.resources("serving", "AWS::EC2::LaunchTemplate").items():
        interfaces = lt["Properties"]["LaunchTemplateData"]["NetworkInterfaces"]
        if len(interfaces) > 1:
            assert not any("AssociatePublicIpAddress" in i for i in interfaces), name


def test_bake_steps_have_timeouts(gpu):
    """Image Builder's default step timeout (120 min) is too tight for a NIXL source build: set each one."""
    components = gpu.resources("image", "AWS::ImageBuilder::Component")
    assert components
    for name, component in components.items():
        doc = yaml.safe_load(component["Properties"]["Data"])
        for phase in doc["phases"]:
            for step in phase["steps"]:
                assert isinstance(step.get("timeoutSeconds"), int) and step["timeoutSeconds"] > 0, \
                    f"{name}: {phase['name']}/{step['name']} has no timeoutSeconds"


def test_the_bake_falls_back_to_other_instance_types(gpu):
    """One build type in one default VPC: a fresh account without G/VT quota for it cannot bake."""
    infra = gpu.resources("image", "AWS::ImageBuilder::InfrastructureConfiguration")
    for name, cfg in infra.items():
        assert len(cfg["Properties"]["InstanceTypes"]) > 1, name
