"""Changes CloudFormation takes (issue 46): a documented config change never alters an export another stack imports.

CloudFormation refuses to update an output another stack imports, so a change that replaced the router's ALB
(``router.public``) or its listener (``certificate_arn``) used to stop the router stack's update. One extra synth
(cdk-nag off) of the ``push`` app with the documented changes at once, compared both ways with the session's
``push`` app: a change made and a change undone.
"""

from __future__ import annotations

import pytest

from infra import exports
from tests.infra import configs
from tests.infra.conftest import synthesize

pytestmark = pytest.mark.infra

CERTIFICATE = "arn:aws:acm:us-east-2:123456789012:certificate/12345678-1234-1234-1234-123456789012"

#: The documented day-two changes, at once: a certificate added, the ALB made public, a pool resized, the image
#: changed (a baked AMI to one the operator brings).
CHANGED = configs.variant(configs.PUSH, **{
    "router.certificate_arn": CERTIFICATE, "router.public": True, "router.allowed_cidrs": ["203.0.113.0/24"],
    "pools.0.count": 2, "image.ami_id": "ami-0123456789abcdef0"})


@pytest.fixture(scope="module")
def changed(tmp_path_factory, image_sources):
    return synthesize(CHANGED, tmp_path_factory.mktemp("changed"), image_sources, nag=False)


def test_the_comparison_sees_a_replaced_export():
    """The check itself: a removed export, a changed value, and a named resource whose properties change."""
    def app(alb_scheme: str, listener: bool) -> dict:
        outputs = {"Alb": {"Value": {"Fn::GetAtt": ["Alb", "LoadBalancerFullName"]}, "Export": {"Name": "r:Alb"}}}
        if listener:
            outputs["L"] = {"Value": {"Ref": "Listener"}, "Export": {"Name": "r:L"}}
        return {"r": {"Resources": {"Alb": {"Type": "AWS::ElasticLoadBalancingV2::LoadBalancer",
                                            "Properties": {"Scheme": alb_scheme}}},
                      "Outputs": outputs},
                "o": {"Resources": {"D": {"Properties": {"a": {"Fn::ImportValue": "r:Alb"},
                                                          "b": [{"Fn::ImportValue": "r:L"}] if listener else []}}}}}

    assert exports.broken_imports(app("internal", True), app("internal", True)) == []
    problems = exports.broken_imports(app("internal", True), app("internet-facing", False))
    assert problems == ["r:Alb (from r, imported by o): Alb (AWS::ElasticLoadBalancingV2::LoadBalancer) changes, "
                        "and a replaced resource changes the exported value",
                        "r:L (from r, imported by o): removed"]


@pytest.mark.parametrize("direction", ["made", "undone"])
def test_documented_changes_alter_no_imported_export(push, changed, direction):
    before, after = (push, changed) if direction == "made" else (changed, push)
    assert exports.imported(before.templates), "the app imports nothing: the comparison checks nothing"
    assert exports.broken_imports(before.templates, after.templates) == []


def test_the_observability_stack_imports_nothing(push):
    """The dashboard and alarms read the router's ALB, target group and service names from SSM
    (``DeploymentConfig.stack_output_parameter``), resolved at each deploy of the observability stack."""
    stack = next(name for name in push.templates if name.endswith("-observability"))
    assert stack not in {s for users in exports.imported(push.templates).values() for s in users}
    parameters = push.template("observability")["Parameters"]
    names = {p["Default"] for p in parameters.values() if p["Type"].startswith("AWS::SSM::Parameter::Value")}
    assert {f"/turnkv/push/outputs/router/{key}" for key in
            ("alb-full-name", "target-group-full-name", "cluster-name", "service-name")} <= names

