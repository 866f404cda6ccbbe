"""cfn-lint exceptions, written into the templates so a plain ``cfn-lint`` run is clean, each with its reason."""

from __future__ import annotations

import aws_cdk as cdk
import jsii
from constructs import IConstruct

#: check -> why it does not apply to these templates.
TEMPLATE_EXCEPTIONS = {
    "W3010": "Availability zones are configuration, not an accident: an EFA pool, its placement group and its "
             "capacity reservation live in one named AZ (network.availability_zones / availability_zone).",
}
RESOURCE_EXCEPTIONS = {
    "W3005": "aws-cdk-lib adds DependsOn on a Lambda function's role on purpose (the role's policy must exist "
             "before the first invocation); the redundancy is harmless.",
}


@jsii.implements(cdk.IAspect)
class _LambdaDependsOn:
    def visit(self, node: IConstruct) -> None:
        if isinstance(node, cdk.CfnResource) and node.cfn_resource_type == "AWS::Lambda::Function":
            node.add_metadata("cfn-lint", {"config": {"ignore_checks": sorted(RESOURCE_EXCEPTIONS)}})


def apply(stack: cdk.Stack, *, azs: bool = False) -> None:
    cdk.Aspects.of(stack).add(_LambdaDependsOn())
    checks = {**RESOURCE_EXCEPTIONS, **(TEMPLATE_EXCEPTIONS if azs else {})}
    if azs:
        stack.template_options.metadata = {
            "cfn-lint": {"config": {"ignore_checks": sorted(TEMPLATE_EXCEPTIONS)}},
            "turnkv:cfn-lint-exceptions": checks,
        }
