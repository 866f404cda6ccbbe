"""Across every template: no security group open to the world except the ALB listener when configured,
cdk-nag AwsSolutions with zero unacknowledged findings (each with a reason), cfn-lint clean, and one synth
with CDK's built-in CloudFormation validation on."""

from __future__ import annotations

import json

import pytest

from tests.infra import configs

pytestmark = pytest.mark.infra

WORLD = {"0.0.0.0/0", "::/0"}


def _world_ingress(synth) -> list[tuple[str, str, dict]]:
    """(stack, security group logical id, rule) for every ingress rule from anywhere."""
    found = []
    for stack, template in synth.templates.items():
        for lid, res in template["Resources"].items():
            rules = []
            if res["Type"] == "AWS::EC2::SecurityGroup":
                rules = [(lid, r) for r in res["Properties"].get("SecurityGroupIngress", [])]
            elif res["Type"] == "AWS::EC2::SecurityGroupIngress":
                rules = [(json.dumps(res["Properties"]["GroupId"]), res["Properties"])]
            for group, rule in rules:
                cidrs = (rule.get("CidrIp"), rule.get("CidrIpv6"))
                if any(isinstance(c, str) and c in WORLD for c in cidrs):
                    found.append((stack, group, rule))
    return found


def test_no_security_group_is_open_to_the_world(any_app):
    assert _world_ingress(any_app) == []


def test_only_the_alb_listener_opens_when_allowed_cidrs_say_so(open_router):
    found = _world_ingress(open_router)
    assert {(stack.rsplit("-", 1)[-1], rule["FromPort"]) for stack, _, rule in found} == {("router", 443),
                                                                                         ("router", 80)}
    groups = {group for _, group, _ in found}
    (alb_sg,) = groups
    desc = open_router.template("router")["Resources"][alb_sg]["Properties"]["GroupDescription"]
    assert "ALB" in desc


def test_egress_to_the_world_is_https_only(any_app):
    for stack, template in any_app.templates.items():
        for res in template["Resources"].values():
            rules = []
            if res["Type"] == "AWS::EC2::SecurityGroup":
                rules = res["Properties"].get("SecurityGroupEgress", [])
            elif res["Type"] == "AWS::EC2::SecurityGroupEgress":
                rules = [res["Properties"]]
            for rule in rules:
                if rule.get("CidrIp") == "0.0.0.0/0":
                    assert (rule["IpProtocol"], rule["FromPort"], rule["ToPort"]) == ("tcp", 443, 443), (stack, rule)


def _nag_report(synth) -> dict:
    report = json.loads((synth.outdir / "validation-report.json").read_text())
    (nag,) = [p for p in report["pluginReports"] if p["pluginName"] == "AwsSolutions"]
    return nag


def test_cdk_nag_has_no_unacknowledged_findings_and_every_acknowledgement_has_a_reason(any_app):
    nag = _nag_report(any_app)
    assert nag["violations"] == []
    assert nag["conclusion"] == "success"
    assert nag["suppressedViolations"], "acknowledgements are recorded"
    for v in nag["suppressedViolations"]:
        assert v["acknowledgedId"].startswith("AwsSolutions::AwsSolutions-")
        assert len(v["reason"]) > 40, v  # a sentence, not a shrug


def test_cdk_nag_fails_the_synth_on_an_unacknowledged_finding():
    import aws_cdk as cdk
    from aws_cdk import aws_ec2 as ec2
    from cdk_nag import AwsSolutionsChecks

    app = cdk.App(builtin_cloud_formation_validation=False)
    stack = cdk.Stack(app, "Probe", env=cdk.Environment(region="us-east-2"))
    vpc = ec2.Vpc.from_vpc_attributes(stack, "Vpc", vpc_id="vpc-12345678", availability_zones=["us-east-2a"])
    sg = ec2.SecurityGroup(stack, "Open", vpc=vpc)
    sg.add_ingress_rule(ec2.Peer.any_ipv4(), ec2.Port.tcp(22))
    cdk.Validations.of(app).add_plugins(AwsSolutionsChecks(app))
    with pytest.raises(Exception, match=r"ValidationFailed(.|\n)*AwsSolutions-EC23"):
        app.synth()


def test_open_listener_is_acknowledged_with_the_operator_reason(open_router):
    acked = [v for v in _nag_report(open_router)["suppressedViolations"]
             if v["ruleName"] == "AwsSolutions-EC23" and "router" in v["acknowledgedAt"]]
    assert acked and "explicitly" in acked[0]["reason"]


def test_cfn_lint_is_clean_on_every_template(any_app):
    from cfnlint.api import ManualArgs, lint_file

    region = any_app.app.config.region
    for stack in any_app.templates:
        path = any_app.outdir / f"{stack}.template.json"
        matches = lint_file(path, config=ManualArgs(regions=[region]))
        assert [f"{m.rule.id} {m.message} ({m.path})" for m in matches] == [], stack


def test_cfn_lint_catches_a_wrong_interface_type(tmp_path, gpu):
    """The lint test can fail: a misspelled interface type is caught by the schema (not efa_only, per notes)."""
    from cfnlint.api import ManualArgs, lint_file

    name = next(s for s in gpu.templates if s.endswith("-serving"))
    template = json.loads(json.dumps(gpu.templates[name]))
    lt = next(r for r in template["Resources"].values() if r["Type"] == "AWS::EC2::LaunchTemplate")
    lt["Properties"]["LaunchTemplateData"]["InstanceType"] = "p5en.96xlarge"
    path = tmp_path / "broken.template.json"
    path.write_text(json.dumps(template))
    assert lint_file(path, config=ManualArgs(regions=["us-east-2"]))


def test_synth_with_builtin_validation(tmp_path_factory, image_sources):
    from tests.infra.conftest import synthesize

    synth = synthesize(configs.GPU, tmp_path_factory.mktemp("validated"), image_sources, validation=True)
    report = json.loads((synth.outdir / "validation-report.json").read_text())
    failures = [(p["pluginName"], v["ruleName"]) for p in report["pluginReports"] for v in p.get("violations", [])
                if v.get("severity") in ("error", "fatal")]
    assert failures == []
    assert len(synth.templates) == 6
