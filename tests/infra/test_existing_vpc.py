"""Deploying into an existing VPC: nothing network-shaped is created, the given subnets are used, and the
templates stay nag- and lint-clean."""

from __future__ import annotations

import json

import pytest
from cfnlint.api import ManualArgs, lint_file

pytestmark = pytest.mark.infra


def test_no_vpc_is_created_and_the_given_subnets_are_used(existing_vpc):
    network = existing_vpc.template("network")["Resources"]
    assert [r["Type"] for r in network.values()] == ["AWS::SSM::Parameter"]
    assert next(iter(network.values()))["Properties"]["Value"] == "vpc-0123456789abcdef0"
    groups = existing_vpc.resources("serving", "AWS::AutoScaling::AutoScalingGroup")
    # engine AZ us-east-2b is the second AZ: its subnet, and only it
    assert {json.dumps(g["Properties"]["VPCZoneIdentifier"]) for g in groups.values()} == {
        json.dumps(["subnet-0bbbbbbbbbbbbbbb2"])}
    (lb,) = existing_vpc.resources("router", "AWS::ElasticLoadBalancingV2::LoadBalancer").values()
    assert lb["Properties"]["Scheme"] == "internal"
    assert sorted(lb["Properties"]["Subnets"]) == sorted(
        ["subnet-0aaaaaaaaaaaaaaa1", "subnet-0bbbbbbbbbbbbbbb2", "subnet-0ccccccccccccccc3"])
    sgs = existing_vpc.resources("serving", "AWS::EC2::SecurityGroup")
    assert {s["Properties"]["VpcId"] for s in sgs.values()} == {"vpc-0123456789abcdef0"}
    (alb_sg,) = [s for s in existing_vpc.resources("router", "AWS::EC2::SecurityGroup").values()
                 if "ALB" in s["Properties"]["GroupDescription"]]
    assert [r["CidrIp"] for r in alb_sg["Properties"]["SecurityGroupIngress"]] == ["10.1.0.0/16"]


def test_existing_vpc_templates_are_clean(existing_vpc):
    report = json.loads((existing_vpc.outdir / "validation-report.json").read_text())
    assert [v for p in report["pluginReports"] for v in p["violations"]] == []
    for stack in existing_vpc.templates:
        matches = lint_file(existing_vpc.outdir / f"{stack}.template.json", config=ManualArgs(regions=["us-east-2"]))
        assert [m.rule.id for m in matches] == [], stack


def test_a_brought_ami_skips_the_bake(existing_vpc):
    """``image.ami_id``: no image stack (nothing to bake), the launch templates name the AMI itself."""
    assert not any(name.endswith("-image") for name in existing_vpc.templates)
    assert existing_vpc.app.image is None
    templates = existing_vpc.resources("serving", "AWS::EC2::LaunchTemplate").values()
    assert {t["Properties"]["LaunchTemplateData"]["ImageId"] for t in templates} == {"ami-0123456789abcdef0"}
    params = existing_vpc.template("serving").get("Parameters", {}).values()
    assert not any("AWS::EC2::Image::Id" in p["Type"] for p in params)
