"""Serving stack: placement group, EFA security group, EFA layouts per instance type, IMDSv2, encrypted
volumes, capacity reservations, instance role, Cloud Map, deregistration on termination."""

from __future__ import annotations

import itertools
import json

import pytest
from aws_cdk.assertions import Match

from infra.instances import INSTANCE_TYPES, efa_layout

pytestmark = pytest.mark.infra


def _launch_templates(synth) -> dict[str, dict]:
    """instance type -> LaunchTemplateData."""
    out = {}
    for res in synth.resources("serving", "AWS::EC2::LaunchTemplate").values():
        data = res["Properties"]["LaunchTemplateData"]
        out[data["InstanceType"]] = data
    return out


def test_placement_group_is_cluster(any_app):
    groups = any_app.resources("serving", "AWS::EC2::PlacementGroup")
    assert [g["Properties"]["Strategy"] for g in groups.values()] == ["cluster"]


@pytest.mark.parametrize(("app_name", "instance_type", "count"), [
    ("gpu", "p5en.48xlarge", 16), ("gpu", "p5.48xlarge", 32), ("gpu", "p5e.48xlarge", 32),
    ("push", "p5.48xlarge", 32), ("push", "p5en.48xlarge", 16),
])
def test_efa_interface_count_and_types_per_instance_type(request, app_name, instance_type, count):
    synth = request.getfixturevalue(app_name)
    interfaces = _launch_templates(synth)[instance_type]["NetworkInterfaces"]
    assert len(interfaces) == count == INSTANCE_TYPES[instance_type].efa_interfaces
    assert interfaces[0]["InterfaceType"] == "efa" and interfaces[0]["NetworkCardIndex"] == 0
    assert {i["InterfaceType"] for i in interfaces[1:]} == {"efa-only"}
    assert sorted(i["NetworkCardIndex"] for i in interfaces) == list(range(count))
    assert {i["DeviceIndex"] for i in interfaces} == {0}
    # No AssociatePublicIpAddress: private subnets, and EC2 refuses the key with several interfaces.
    assert all("AssociatePublicIpAddress" not in i and len(i["Groups"]) == 1 for i in interfaces)
    assert [(s.network_card_index, s.interface_type) for s in efa_layout(instance_type)] == [
        (i["NetworkCardIndex"], i["InterfaceType"]) for i in interfaces]


def test_launch_templates_require_imdsv2_encrypt_volumes_and_carry_groups_on_interfaces(any_app):
    for itype, data in _launch_templates(any_app).items():
        assert data["MetadataOptions"]["HttpTokens"] == "required", itype
        assert data["MetadataOptions"]["HttpPutResponseHopLimit"] == 1
        assert all(b["Ebs"]["Encrypted"] is True for b in data["BlockDeviceMappings"])
        assert "SecurityGroupIds" not in data and "SecurityGroups" not in data
        assert data["Monitoring"] == {"Enabled": True}
        assert set(data["ImageId"]) == {"Ref"}


def test_ami_id_resolves_from_ssm_at_deploy_time(gpu, push):
    for synth, flavors in ((gpu, {"gpu"}), (push, {"gpu"})):
        params = synth.template("serving")["Parameters"]
        ami = {p["Default"] for p in params.values() if p["Type"] == "AWS::SSM::Parameter::Value<AWS::EC2::Image::Id>"}
        assert ami == {f"/turnkv/{synth.app.config.name}/ami/{f}" for f in flavors}


def test_efa_security_group_allows_all_traffic_to_and_from_itself(any_app):
    t = any_app.template("serving")
    sg_id = next(k for k, v in t["Resources"].items()
                 if v["Type"] == "AWS::EC2::SecurityGroup" and "EFA" in v["Properties"]["GroupDescription"])
    ref = {"Fn::GetAtt": [sg_id, "GroupId"]}
    ingress = [r["Properties"] for r in t["Resources"].values() if r["Type"] == "AWS::EC2::SecurityGroupIngress"]
    egress = [r["Properties"] for r in t["Resources"].values() if r["Type"] == "AWS::EC2::SecurityGroupEgress"]
    assert any(r["IpProtocol"] == "-1" and r["SourceSecurityGroupId"] == ref and r["GroupId"] == ref
               for r in ingress)
    assert any(r["IpProtocol"] == "-1" and r["DestinationSecurityGroupId"] == ref and r["GroupId"] == ref
               for r in egress)
    inline_egress = t["Resources"][sg_id]["Properties"].get("SecurityGroupEgress", [])
    assert all(e.get("IpProtocol") != "-1" or "CidrIp" not in e for e in inline_egress), "no all-traffic egress"
    assert "SecurityGroupIngress" not in t["Resources"][sg_id]["Properties"]


def test_on_demand_reservation_is_targeted_on_the_group_without_placement_group(gpu):
    lts = _launch_templates(gpu)
    assert "Placement" not in lts["p5en.48xlarge"]
    asg = gpu.assertions("serving")
    asg.has_resource_properties("AWS::AutoScaling::AutoScalingGroup", {
        "AutoScalingGroupName": "turnkv-gpu-prefill",
        "CapacityReservationSpecification": {
            "CapacityReservationPreference": "capacity-reservations-only",
            "CapacityReservationTarget": {"CapacityReservationIds": ["cr-0a1b2c3d4e5f60718"]}},
        "MinSize": "2", "MaxSize": "2"})


def test_capacity_block_uses_market_type_and_target_in_the_launch_template(gpu):
    data = _launch_templates(gpu)["p5e.48xlarge"]
    assert data["InstanceMarketOptions"] == {"MarketType": "capacity-block"}
    assert data["CapacityReservationSpecification"] == {
        "CapacityReservationTarget": {"CapacityReservationId": "cr-0f1e2d3c4b5a69788"}}
    assert "Placement" not in data


def test_pools_without_reservation_join_the_placement_group(gpu, push):
    for synth, itype in ((gpu, "p5.48xlarge"), (push, "p5.48xlarge"), (push, "p5en.48xlarge")):
        data = _launch_templates(synth)[itype]
        assert "GroupName" in json.dumps(data["Placement"]), itype
        assert "CapacityReservationSpecification" not in data


def test_every_pool_is_one_group_in_the_engine_az_subnet(any_app):
    config = any_app.app.config
    groups = any_app.resources("serving", "AWS::AutoScaling::AutoScalingGroup")
    assert sorted(g["Properties"]["AutoScalingGroupName"] for g in groups.values()) == sorted(
        f"{config.prefix}-{p.name}" for p in config.pools)
    subnet = any_app.app.network.engine_subnet()
    assert subnet.availability_zone == config.availability_zone
    assert len({json.dumps(g["Properties"]["VPCZoneIdentifier"]) for g in groups.values()}) == 1
    for g in groups.values():
        assert len(g["Properties"]["VPCZoneIdentifier"]) == 1


def test_user_data_per_role_writes_the_contract_files(gpu):
    by_name = {}
    for res in gpu.resources("serving", "AWS::EC2::LaunchTemplate").values():
        ud = res["Properties"]["LaunchTemplateData"]["UserData"]["Fn::Base64"]
        text = ud if isinstance(ud, str) else "".join(p if isinstance(p, str) else "<ref>"
                                                      for p in ud["Fn::Join"][1])
        by_name[res["Properties"]["LaunchTemplateName"]] = text
    prefill = by_name["turnkv-gpu-prefill"]
    decode = by_name["turnkv-gpu-decode"]
    assert "TURNKV_ROLE=prefill" in prefill and "TURNKV_ROLE=decode" in decode
    for text in (prefill, decode):
        assert "TURNKV_BACKENDS=LIBFABRIC" in text
        assert "VLLM_NIXL_SIDE_CHANNEL_HOST" in text and "local-ipv4" in text
        assert "/opt/turnkv/venv/bin/turnkv params sync --deployment gpu --region us-east-2" in text
        assert "systemctl start turnkv-engine.service" in text
        assert "systemctl start turnkv-params-sync.timer" in text
        assert "servicediscovery register-instance" in text and "<ref>" in text  # the Cloud Map service id
        assert "TURNKV_MODEL_S3_URI=s3://turnkv-test-weights/qwen3-32b/" in text


def test_instance_role_is_least_privilege(any_app):
    policies = any_app.resources("serving", "AWS::IAM::Policy")
    statements = [s for p in policies.values() for s in p["Properties"]["PolicyDocument"]["Statement"]]
    for s in statements:
        actions = s["Action"] if isinstance(s["Action"], list) else [s["Action"]]
        assert not any(a == "*" or a.endswith(":*") for a in actions), s
    put_metrics = next(s for s in statements if s.get("Sid") == "PublishMetrics")
    assert put_metrics["Condition"]["StringEquals"]["cloudwatch:namespace"]
    roles = any_app.resources("serving", "AWS::IAM::Role")
    assert all("ManagedPolicyArns" not in r["Properties"] for r in roles.values())


def test_cloud_map_namespace_service_and_deregistration(any_app):
    t = any_app.assertions("serving")
    name = any_app.app.config.prefix
    t.has_resource_properties("AWS::ServiceDiscovery::HttpNamespace", {"Name": name})
    t.has_resource_properties("AWS::ServiceDiscovery::Service", {"Name": "engines"})
    t.has_resource_properties("AWS::AutoScaling::LifecycleHook", {
        "LifecycleTransition": "autoscaling:EC2_INSTANCE_TERMINATING", "DefaultResult": "CONTINUE"})
    t.resource_count_is("AWS::AutoScaling::LifecycleHook", len(any_app.app.config.pools))
    t.has_resource_properties("AWS::Events::Rule", {"EventPattern": {
        "source": ["aws.autoscaling"], "detail-type": ["EC2 Instance-terminate Lifecycle Action"],
        "detail": {"AutoScalingGroupName": [f"{name}-{p.name}" for p in any_app.app.config.pools]}}})
    t.has_resource_properties("AWS::Lambda::Function", {
        "Handler": "index.handler", "Environment": {"Variables": {"SERVICE_ID": Match.any_value()}}})


def test_engine_events_go_to_an_encrypted_topic(gpu):
    t = gpu.assertions("serving")
    t.has_resource_properties("AWS::SNS::Topic", {"KmsMasterKeyId": Match.any_value()})
    t.has_resource_properties("AWS::SNS::Subscription", {"Protocol": "email", "Endpoint": "oncall@example.com"})


def test_a_new_launch_template_rolls_over_one_engine_at_a_time(gpu):
    """A new AMI or new user data replaces the engines one at a time, each only after the previous one signalled
    that it serves: pools without a reservation surge one instance (all stay in service), reserved pools replace
    in place (count - 1 stay in service)."""
    groups = gpu.resources("serving", "AWS::AutoScaling::AutoScalingGroup")
    expected = {"EngineGroupPrefill": (2, 2, 1), "EngineGroupDecode": (2, 3, 2), "EngineGroupDecodeBlock": (1, 1, 0)}
    assert set(groups) == set(expected)
    for lid, (size, max_size, in_service) in expected.items():
        group = groups[lid]
        rolling = group["UpdatePolicy"]["AutoScalingRollingUpdate"]
        assert (int(group["Properties"]["MinSize"]), int(group["Properties"]["MaxSize"])) == (size, max_size), lid
        assert int(rolling["MinInstancesInService"]) == in_service < max_size, lid
        assert int(rolling["MaxBatchSize"]) == 1 and rolling["WaitOnResourceSignals"] is True
        assert rolling["PauseTime"] == "PT1H"
        assert "DesiredCapacity" not in group["Properties"]
    # The node sends that signal once registered, naming its group; its role may send it to this stack only.
    user_data = json.dumps(gpu.resources("serving", "AWS::EC2::LaunchTemplate"))
    for lid in expected:
        assert f"--logical-resource-id '{lid}'" in user_data
    policies = json.dumps(gpu.resources("serving", "AWS::IAM::Policy"))
    assert "cloudformation:SignalResource" in policies


def test_a_reservation_made_in_a_cluster_placement_group_launches_into_it(gpu_account):
    """EC2: an On-Demand Capacity Reservation created in a cluster placement group is used only by instances
    launched into that group; the pool names it (pools[].placement_group) and keeps the reservation target."""
    lts = _launch_templates(gpu_account)
    assert lts["p5en.48xlarge"]["Placement"] == {"GroupName": "odcr-cluster"}
    assert "Placement" not in lts["p5e.48xlarge"]  # the Capacity Block places its instances itself
    assert "GroupName" in json.dumps(lts["p5.48xlarge"]["Placement"])  # no reservation: the deployment's group
    gpu_account.assertions("serving").has_resource_properties("AWS::AutoScaling::AutoScalingGroup", {
        "AutoScalingGroupName": "turnkv-gpu-prefill",
        "CapacityReservationSpecification": {
            "CapacityReservationPreference": "capacity-reservations-only",
            "CapacityReservationTarget": {"CapacityReservationIds": ["cr-0a1b2c3d4e5f60718"]}}})


def _egress(synth, role: str) -> list[dict]:
    rules = []
    for res in synth.template(role)["Resources"].values():
        if res["Type"] == "AWS::EC2::SecurityGroup":
            rules += res["Properties"].get("SecurityGroupEgress", [])
        elif res["Type"] == "AWS::EC2::SecurityGroupEgress":
            rules.append(res["Properties"])
    return rules


def test_without_nat_egress_is_the_vpc_and_the_s3_prefix_list_only(gpu, push):
    for role in ("serving", "router"):
        rules = _egress(gpu, role)
        assert not [r for r in rules if r.get("CidrIp") == "0.0.0.0/0"], role
        assert any(r.get("CidrIp") == "10.40.0.0/16" and r["FromPort"] == 443 for r in rules), role
        (s3,) = [r for r in rules if "DestinationPrefixListId" in r]
        assert s3["FromPort"] == s3["ToPort"] == 443 and "Fn::ImportValue" in s3["DestinationPrefixListId"]
        # With a NAT (model hubs), HTTPS anywhere.
        assert any(r.get("CidrIp") == "0.0.0.0/0" and r["FromPort"] == 443 for r in _egress(push, role)), role
    (lookup,) = gpu.resources("network", "Custom::AWS").values()
    assert "com.amazonaws.us-east-2.s3" in json.dumps(lookup["Properties"])
    assert push.resources("network", "Custom::AWS") == {}


def test_engines_get_the_deployments_offer_secret_before_they_start(any_app):
    """Decode signs its KV offers and prefill reads only verified ones (turnkv.wire): without the shared secret
    on every engine, offers go unsigned and every turn is recomputed, so the deploy must provide it."""
    secrets = any_app.resources("serving", "AWS::SecretsManager::Secret")
    (secret_id, secret), = ((k, v) for k, v in secrets.items() if k.startswith("OfferSecret"))
    assert secret["Properties"]["GenerateSecretString"]["PasswordLength"] >= 32
    policies = any_app.resources("serving", "AWS::IAM::Policy")
    statements = [s for p in policies.values() for s in p["Properties"]["PolicyDocument"]["Statement"]]
    read = next(s for s in statements if s.get("Sid") == "ReadOfferSecret")
    assert read["Action"] == "secretsmanager:GetSecretValue" and read["Resource"] == {"Ref": secret_id}
    for res in any_app.resources("serving", "AWS::EC2::LaunchTemplate").values():
        ud = res["Properties"]["LaunchTemplateData"]["UserData"]["Fn::Base64"]
        parts = ud["Fn::Join"][1]
        text = "".join(p if isinstance(p, str) else "<ref>" for p in parts)
        assert {"Ref": secret_id} in parts  # the secret's ARN, resolved at deploy time
        fetch = text.index("secretsmanager get-secret-value")
        assert "TURNKV_OFFER_SECRET_FILE=/etc/turnkv/offer-secret" in text
        assert "refusing to start the engine" in text[fetch:]
        assert fetch < text.index("systemctl start turnkv-engine.service")


def _user_data_by_group(synth) -> dict[str, str]:
    out = {}
    for res in synth.resources("serving", "AWS::EC2::LaunchTemplate").values():
        ud = res["Properties"]["LaunchTemplateData"]["UserData"]["Fn::Base64"]
        text = ud if isinstance(ud, str) else "".join(p if isinstance(p, str) else "<ref>" for p in ud["Fn::Join"][1])
        out[res["Properties"]["LaunchTemplateName"]] = text
    return out


def test_tp4_on_p5en_runs_two_engines_per_node_each_registered_and_reached_on_its_port(tp4):
    """TP 4 on 8-GPU nodes: two engines per instance (GPUs 0-3 and 4-7, HTTP 8000 and 8001, side channels 5600
    and 5604), each its own Cloud Map instance; the router reaches both ports; the Lambda deregisters both."""
    assert tp4.app.serving.engines_per_node == {"prefill": 2, "decode": 2, "decode-block": 2}
    for name, text in _user_data_by_group(tp4).items():
        assert "CUDA_VISIBLE_DEVICES 0,1,2,3" in text and "CUDA_VISIBLE_DEVICES 4,5,6,7" in text, name
        assert "TURNKV_PORT 8001 TURNKV_SIDE_CHANNEL_PORT 5604" in text, name
        assert "systemctl start turnkv-engine@{0..1}.service" in text, name
        assert '--instance-id "$CLOUDMAP_ID"' in text and "TURNKV_TP_SIZE=4" in text, name
    ingress = [r["Properties"] for r in tp4.resources("router", "AWS::EC2::SecurityGroupIngress").values()
               if r["Properties"].get("Description") == "turnkv router to engines"]
    assert [(r["FromPort"], r["ToPort"]) for r in ingress] == [(8000, 8001)]
    egress = [r for r in _egress(tp4, "router") if r.get("Description") == "to the engines' HTTP ports"]
    assert [(r["FromPort"], r["ToPort"]) for r in egress] == [(8000, 8001)]
    (function,) = [f for f in tp4.resources("serving", "AWS::Lambda::Function").values()
                   if "ENGINES_PER_NODE" in json.dumps(f)]
    assert json.loads(function["Properties"]["Environment"]["Variables"]["ENGINES_PER_NODE"]) == {
        "turnkv-gpu-decode": 2, "turnkv-gpu-decode-block": 2, "turnkv-gpu-prefill": 2}


def test_tp8_keeps_one_engine_per_node_and_the_launch_template_of_before(gpu):
    assert gpu.app.serving.engines_per_node == {"prefill": 1, "decode": 1, "decode-block": 1}
    for name, text in _user_data_by_group(gpu).items():
        assert "turnkv-engine@" not in text and "CUDA_VISIBLE_DEVICES" not in text, name
        assert "systemctl start turnkv-engine.service" in text, name
    ingress = [r["Properties"] for r in gpu.resources("router", "AWS::EC2::SecurityGroupIngress").values()
               if r["Properties"].get("Description") == "turnkv router to engines"]
    assert [(r["FromPort"], r["ToPort"]) for r in ingress] == [(8000, 8000)]


def test_the_registration_alarm_counts_every_engine_a_node_runs(tp4, gpu):
    """EnginesNotRegistered-<role> compares Cloud Map's engines with what the pools hold: engines, not instances."""
    for synth, per_node in ((tp4, 2), (gpu, 1)):
        alarms = {a["Properties"]["AlarmName"]: a["Properties"]
                  for a in synth.resources("observability", "AWS::CloudWatch::Alarm").values()}
        assert alarms["turnkv-gpu-EnginesNotRegistered-prefill"]["Threshold"] == 2 * per_node
        assert alarms["turnkv-gpu-EnginesNotRegistered-decode"]["Threshold"] == 3 * per_node


def test_the_models_engine_settings_ride_in_every_engines_env_file(gpu, push):
    """Deploy config ``model`` -> the launch template's user data (engine.env) on every pool: the Qwen3 example's
    tool-call and reasoning parsers and fp8 KV on the pull app, remote code and the token's secret on push."""
    for synth, expect in ((gpu, {"TURNKV_KV_CACHE_DTYPE=fp8", "TURNKV_TOOL_CALL_PARSER=hermes",
                                 "TURNKV_REASONING_PARSER=qwen3", "TURNKV_EXTRA_ARGS=--max-num-batched-tokens=8192"}),
                          (push, {"TURNKV_TRUST_REMOTE_CODE=true", "TURNKV_HF_TOKEN_SECRET=turnkv/hf-token"})):
        texts = _user_data_by_group(synth)
        assert texts
        for name, text in texts.items():
            lines = set(text.splitlines())
            assert expect <= lines, (name, expect - lines)
    assert not any("TURNKV_HF_TOKEN_SECRET" in t for t in _user_data_by_group(gpu).values())


def test_only_a_deployment_with_a_model_token_may_read_that_one_secret(gpu, push):
    """The token's secret, given by name, is granted as Secrets Manager names it (name, '-', six characters):
    GetSecretValue on that secret alone, in the stack's region and account. No token: no grant."""
    def grant(synth):
        statements = [s for p in synth.resources("serving", "AWS::IAM::Policy").values()
                      for s in p["Properties"]["PolicyDocument"]["Statement"]]
        return [s for s in statements if s.get("Sid") == "ReadModelToken"]

    (statement,) = grant(push)
    assert statement["Action"] == "secretsmanager:GetSecretValue" and statement["Effect"] == "Allow"
    parts = statement["Resource"]["Fn::Join"][1]
    text = "".join(p if isinstance(p, str) else "<ref>" for p in parts)
    assert text == "arn:<ref>:secretsmanager:us-east-2:<ref>:secret:turnkv/hf-token-??????", text
    assert [p for p in parts if not isinstance(p, str)] == [{"Ref": "AWS::Partition"}, {"Ref": "AWS::AccountId"}]
    assert grant(gpu) == []


def test_groups_roll_one_after_another_and_each_node_drains_on_its_hook(gpu):
    """Issue 46: prefill pools roll first, then decode pools, one group at a time (a DependsOn chain: CloudFormation
    updates a resource after those it depends on); the terminate hook waits for the node's drain (the pool's
    drain_timeout_s and the hook's margin) and continues at its timeout; the node may complete it."""
    from infra import roll

    groups = gpu.resources("serving", "AWS::AutoScaling::AutoScalingGroup")
    order = ["EngineGroupPrefill", "EngineGroupDecode", "EngineGroupDecodeBlock"]
    for before, after in itertools.pairwise(order):
        assert before in groups[after].get("DependsOn", []), after
    assert not set(groups["EngineGroupPrefill"].get("DependsOn", [])) & set(order)
    hooks = gpu.resources("serving", "AWS::AutoScaling::LifecycleHook")
    assert len(hooks) == 3
    for hook in hooks.values():
        p = hook["Properties"]
        assert p["LifecycleHookName"] == "turnkv-drain" and p["DefaultResult"] == "CONTINUE"
        assert p["HeartbeatTimeout"] == 900 + roll.HOOK_MARGIN_S
        assert p["LifecycleTransition"] == "autoscaling:EC2_INSTANCE_TERMINATING"
    policies = json.dumps(gpu.resources("serving", "AWS::IAM::Policy"))
    assert '"Sid": "CompleteDrain"' in policies
    user_data = json.dumps(gpu.resources("serving", "AWS::EC2::LaunchTemplate"))
    assert "systemd-run -q -u turnkv-drain" in user_data and "engine drain --group turnkv-gpu-decode" in user_data
