"""Router stack: Fargate service from router/Dockerfile, ALB (listeners, idle timeout, health checks),
autoscaling, Valkey only with more than one replica, API keys in Secrets Manager, security groups."""

from __future__ import annotations

import json
import re

import pytest
from aws_cdk.assertions import Match

from infra.wheel import REPO_ROOT

pytestmark = pytest.mark.infra


def _lb_attributes(synth) -> dict[str, str]:
    (lb,) = synth.resources("router", "AWS::ElasticLoadBalancingV2::LoadBalancer").values()
    return {a["Key"]: a["Value"] for a in lb["Properties"]["LoadBalancerAttributes"]}


def test_alb_idle_timeout_is_long_enough_for_streams(any_app):
    attrs = _lb_attributes(any_app)
    assert int(attrs["idle_timeout.timeout_seconds"]) == any_app.app.config.router.idle_timeout_s >= 900
    assert attrs["access_logs.s3.enabled"] == "true"
    assert attrs["routing.http.drop_invalid_header_fields.enabled"] == "true"


def test_https_listener_with_certificate_and_redirect(gpu):
    listeners = {ln["Properties"]["Port"]: ln["Properties"]
                 for ln in gpu.resources("router", "AWS::ElasticLoadBalancingV2::Listener").values()}
    assert set(listeners) == {80, 443}
    https = listeners[443]
    assert https["Protocol"] == "HTTPS"
    assert https["Certificates"] == [{"CertificateArn": gpu.app.config.router.certificate_arn}]
    assert https["DefaultActions"][0]["Type"] == "forward"
    assert https["SslPolicy"].startswith("ELBSecurityPolicy-TLS13")
    assert listeners[80]["DefaultActions"][0]["Type"] == "redirect"
    assert listeners[80]["DefaultActions"][0]["RedirectConfig"]["Protocol"] == "HTTPS"
    (lb,) = gpu.resources("router", "AWS::ElasticLoadBalancingV2::LoadBalancer").values()
    assert lb["Properties"]["Scheme"] == "internet-facing"


def test_http_listener_without_certificate_on_an_internal_alb(push):
    found = push.resources("router", "AWS::ElasticLoadBalancingV2::Listener")
    listeners = [ln["Properties"] for ln in found.values()]
    assert [(ln["Port"], ln["Protocol"], ln["DefaultActions"][0]["Type"]) for ln in listeners] == [
        (80, "HTTP", "forward")]
    (lb,) = push.resources("router", "AWS::ElasticLoadBalancingV2::LoadBalancer").values()
    assert lb["Properties"]["Scheme"] == "internal"


def test_target_group_health_checks_the_router(any_app):
    any_app.assertions("router").has_resource_properties("AWS::ElasticLoadBalancingV2::TargetGroup", {
        "HealthCheckPath": "/health", "Port": 8000, "Protocol": "HTTP", "TargetType": "ip",
        "Matcher": {"HttpCode": "200"}})


def _container(synth) -> dict:
    (task,) = synth.resources("router", "AWS::ECS::TaskDefinition").values()
    (container,) = task["Properties"]["ContainerDefinitions"]
    return container


def _flat(value) -> str:
    """A CloudFormation string (maybe an Fn::Join) as text with <ref> for the references."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and "Fn::Join" in value:
        return "".join(_flat(v) for v in value["Fn::Join"][1])
    return "<ref>"


def test_container_runs_discovery_and_store_flags(gpu, push):
    gpu_cmd = [_flat(c) for c in _container(gpu)["Command"]]
    assert gpu_cmd[:4] == ["--host", "0.0.0.0", "--port", "8000"]
    joined = " ".join(gpu_cmd)
    assert "--discovery cloudmap --namespace turnkv-gpu --service engines --region us-east-2" in joined
    assert re.search(r"--store rediss://<ref>:<ref>", joined)
    assert "--store" not in " ".join(_flat(c) for c in _container(push)["Command"])
    env = {e["Name"]: e["Value"] for e in _container(gpu)["Environment"]}
    assert env["TURNKV_DEPLOYMENT"] == "gpu" and env["AWS_REGION"] == "us-east-2"
    secrets = {s["Name"] for s in _container(gpu)["Secrets"]}
    # the store's password only with Valkey; the engines' offer secret always (the router clears its replays)
    assert secrets == {"TURNKV_API_KEYS", "TURNKV_STORE_PASSWORD", "TURNKV_OFFER_SECRET"}
    assert {s["Name"] for s in _container(push)["Secrets"]} == {"TURNKV_API_KEYS", "TURNKV_OFFER_SECRET"}
    c = _container(gpu)
    assert c["User"] == "10001" and c["ReadonlyRootFilesystem"] is True
    # the deploy config's media allow-list reaches the router (absent: any internet host, checked)
    push_env = {e["Name"]: e["Value"] for e in _container(push)["Environment"]}
    assert push_env["TURNKV_MEDIA_DOMAINS"] == "images.example.com,cdn.example.net"
    assert "TURNKV_MEDIA_DOMAINS" not in env
    assert "/health" in " ".join(c["HealthCheck"]["Command"])


def test_valkey_only_with_more_than_one_replica(gpu, push):
    gpu.assertions("router").has_resource_properties("AWS::ElastiCache::ServerlessCache", {
        "Engine": "valkey", "SecurityGroupIds": Match.any_value(), "SubnetIds": Match.any_value()})
    push.assertions("router").resource_count_is("AWS::ElastiCache::ServerlessCache", 0)


def test_api_keys_in_secrets_manager(any_app):
    any_app.assertions("router").has_resource_properties("AWS::SecretsManager::Secret", {
        "Name": f"{any_app.app.config.prefix}/router-api-keys", "GenerateSecretString": Match.any_value()})


def test_service_autoscaling_bounds(gpu):
    t = gpu.assertions("router")
    t.has_resource_properties("AWS::ECS::Service", {"LaunchType": "FARGATE",
                                                   "NetworkConfiguration": {"AwsvpcConfiguration": {
                                                       "AssignPublicIp": "DISABLED"}}})
    t.has_resource_properties("AWS::ApplicationAutoScaling::ScalableTarget", {"MinCapacity": 2, "MaxCapacity": 6})
    t.resource_count_is("AWS::ApplicationAutoScaling::ScalingPolicy", 2)


def test_router_reaches_engines_only_on_their_http_port(any_app):
    ingress = [r["Properties"] for r in any_app.resources("router", "AWS::EC2::SecurityGroupIngress").values()]
    to_engines = [r for r in ingress if r.get("Description") == "turnkv router to engines"]
    assert len(to_engines) == 1 and to_engines[0]["FromPort"] == to_engines[0]["ToPort"] == 8000
    assert "Fn::ImportValue" in json.dumps(to_engines[0]["GroupId"])


def test_alb_listener_admits_only_the_allowed_cidrs(gpu, push):
    def alb_ingress(synth):
        (sg_id,) = [k for k, v in synth.resources("router", "AWS::EC2::SecurityGroup").items()
                    if "ALB" in v["Properties"]["GroupDescription"]]
        return synth.template("router")["Resources"][sg_id]["Properties"]["SecurityGroupIngress"]

    assert {(r["CidrIp"], r["FromPort"]) for r in alb_ingress(gpu)} == {("203.0.113.0/24", 443), ("203.0.113.0/24", 80)}
    # no CIDRs configured on an internal ALB: the VPC's own range only
    assert {(r["CidrIp"], r["FromPort"]) for r in alb_ingress(push)} == {("10.40.0.0/16", 80)}


def test_dockerfile_builds_the_router_without_engines():
    text = (REPO_ROOT / "router" / "Dockerfile").read_text()
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim$", text, re.M)
    assert 'ENTRYPOINT ["turnkv", "router", "serve"]' in text
    assert re.search(r"^USER 10001$", text, re.M) and "useradd --system --uid 10001" in text
    assert "HEALTHCHECK" in text and "/health" in text
    install = [ln for ln in text.splitlines() if "pip install" in ln or "pip wheel" in ln]
    assert install and not any("[engines" in ln or "vllm" in ln or "nixl" in ln for ln in install)
    ignore = (REPO_ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git", "cdk.out", "node_modules"} <= set(ignore)


def test_image_asset_is_built_from_the_repository_root(gpu):
    manifest = json.loads((gpu.outdir / f"{gpu.app.router.artifact_id}.assets.json").read_text())
    (image,) = manifest["dockerImages"].values()
    assert image["source"]["dockerFile"] == "router/Dockerfile"
    staged = gpu.outdir / image["source"]["directory"]
    assert (staged / "router" / "Dockerfile").is_file() and (staged / "turnkv" / "params.py").is_file()
    assert not (staged / ".venv").exists() and not (staged / "tests").exists()
    # side venvs (make test builds .venv-vllm029 before this synth) stay out too: staged, each is gigabytes
    assert not [p.name for p in staged.iterdir() if p.name.startswith(".venv")]


def test_every_virtual_environment_is_kept_out_of_the_router_image_context():
    from fnmatch import fnmatch

    from infra.stacks.router import DOCKER_EXCLUDES

    ignore = (REPO_ROOT / ".dockerignore").read_text().split()
    for venv in (".venv", ".venv-vllm029", ".venv-aiperf", ".venv-gpu-check"):
        assert any(fnmatch(venv, pattern) for pattern in DOCKER_EXCLUDES), venv
        assert any(fnmatch(venv, pattern) for pattern in ignore), venv


def test_router_keepalive_outlasts_the_alb_idle_timeout(any_app):
    """AWS: a target closing idle connections before the load balancer does causes sporadic 502s."""
    (lb,) = any_app.resources("router", "AWS::ElasticLoadBalancingV2::LoadBalancer").values()
    attrs = {a["Key"]: a["Value"] for a in lb["Properties"]["LoadBalancerAttributes"]}
    idle = int(attrs["idle_timeout.timeout_seconds"])
    (task,) = any_app.resources("router", "AWS::ECS::TaskDefinition").values()
    (container,) = task["Properties"]["ContainerDefinitions"]
    command = container["Command"]
    keepalive = float(command[command.index("--keepalive-timeout") + 1])
    assert keepalive > idle >= any_app.app.config.router.idle_timeout_s


def test_valkey_requires_an_rbac_user_over_tls(gpu):
    """Authentication on top of TLS: a user group whose default user is off, the router's own user with a
    generated password from Secrets Manager, handed to the task as a secret under the names the router reads."""
    from infra.stacks import router as router_stack
    from router.state import valkey

    (cache,) = gpu.resources("router", "AWS::ElastiCache::ServerlessCache").values()
    (group_id, group), = gpu.resources("router", "AWS::ElastiCache::UserGroup").items()
    assert cache["Properties"]["UserGroupId"] == {"Ref": group_id}
    users = gpu.resources("router", "AWS::ElastiCache::User")
    by_name = {u["Properties"]["UserName"]: u["Properties"] for u in users.values()}
    assert by_name["default"]["AccessString"].startswith("off")
    router_user = by_name[router_stack.VALKEY_USER]
    assert router_user["AuthenticationMode"]["Type"] == "password"
    assert "resolve:secretsmanager" in json.dumps(router_user["AuthenticationMode"]["Passwords"])
    assert sorted(json.dumps(u) for u in group["Properties"]["UserIds"]) == sorted(
        json.dumps({"Ref": lid}) for lid in users)
    container = _container(gpu)
    assert {"Name": router_stack.STORE_USERNAME_ENV, "Value": router_stack.VALKEY_USER} in container["Environment"]
    assert router_stack.STORE_PASSWORD_ENV in {s["Name"] for s in container["Secrets"]}
    assert (router_stack.STORE_USERNAME_ENV, router_stack.STORE_PASSWORD_ENV) == (valkey.USERNAME_ENV,
                                                                                  valkey.PASSWORD_ENV)
    assert "rediss://" in json.dumps(container["Command"])
