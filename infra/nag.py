"""cdk-nag (AwsSolutions) on every synth, and every acknowledgement with its reason.

cdk-nag 3 acknowledges one finding at a time (``Rule[Finding]``), on the narrowest construct that
carries it. Synth fails (``ValidationFailed``) on any finding not listed here, so a new wildcard or an open
security group cannot slip in unnoticed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import aws_cdk as cdk
from cdk_nag import AwsSolutionsChecks
from constructs import IConstruct

if TYPE_CHECKING:
    from infra.app import TurnkvApp

PACK = "AwsSolutions"


def ack(scope: IConstruct, rule: str, reason: str, finding: str | None = None) -> None:
    """Acknowledge ``AwsSolutions-<rule>`` (``[finding]``) on ``scope`` and everything under it."""
    rule_id = f"{PACK}::{PACK}-{rule}" + (f"[{finding}]" if finding else "")
    cdk.Validations.of(scope).acknowledge(cdk.Acknowledgment(id=rule_id, reason=reason))


def account_token(stack: cdk.Stack) -> str:
    """How cdk-nag prints the account in an ARN of ``stack``: the number itself when the stack has a concrete
    account (``account:`` in the config, or ``CDK_DEFAULT_ACCOUNT`` as the CDK CLI sets it whenever credentials
    exist), else the pseudo parameter ``<AWS::AccountId>`` (environment-agnostic synth)."""
    return "<AWS::AccountId>" if cdk.Token.is_unresolved(stack.account) else stack.account


def _logical(construct: IConstruct) -> str:
    """The token cdk-nag prints for a resource's ARN: ``<LogicalId.Arn>``."""
    stack = cdk.Stack.of(construct)
    return stack.get_logical_id(construct.node.default_child)  # type: ignore[arg-type]


def apply(app: cdk.App, t: TurnkvApp) -> None:
    cdk.Validations.of(app).add_plugins(AwsSolutionsChecks(app))
    config = t.config
    region = config.region
    # Every stack of the app shares one environment (infra.app.build), so one account rendering fits all.
    account = account_token(t.serving)
    ssm_prefix = f"arn:<AWS::Partition>:ssm:{region}:{account}:parameter/turnkv/{config.name}/*"
    assets_bucket = f"arn:<AWS::Partition>:s3:::cdk-hnb659fds-assets-{account}-{region}/*"

    # --- image (absent when the config brings its own AMI)
    if t.image is not None:
        _image(t.image, assets_bucket)

    # --- network (the S3 prefix list lookup exists only when the VPC has no NAT)
    network = t.network
    lookup = network.node.try_find_child("S3PrefixList")
    if lookup is not None:
        ack(lookup, "IAM5", "ec2:DescribeManagedPrefixLists (the S3 prefix list lookup that narrows egress) has no "
                            "resource-level permissions.", "Resource::*")
        provider = network.node.try_find_child("AWS679f53fac002430cb0da5b7982bd2287")
        if provider is not None:
            ack(provider, "IAM4", "aws-cdk-lib's AwsCustomResource provider function: basic execution role for its "
                                  "own CloudWatch logs.",
                "Policy::arn:<AWS::Partition>:iam::aws:policy/service-role/AWSLambdaBasicExecutionRole")
            ack(provider, "L1", "aws-cdk-lib's AwsCustomResource provider function; aws-cdk-lib picks its runtime.")

    # --- params
    keeper_role = t.params.node.find_child("KeepTunablesRole")
    ack(keeper_role, "IAM5", "The tunables keeper reads the deployment's live tunables (every one under "
                             "/turnkv/<deployment>/) to keep the operator's values across upgrades.",
        f"Resource::{ssm_prefix}")
    ack(keeper_role, "IAM5", "The function's own log group; streams are created per invocation container.",
        f"Resource::<{_logical(t.params.node.find_child('KeepTunablesLogs'))}.Arn>:*")

    # --- serving
    serving = t.serving
    engine_role = serving.role
    ack(engine_role, "IAM5", "Engines read every tunable of their deployment (the params sync reads the whole "
                             "/turnkv/<deployment>/ path).", f"Resource::{ssm_prefix}")
    ack(engine_role, "IAM5", "cloudwatch:PutMetricData (limited by a cloudwatch:namespace condition to the turnkv "
                             "and agent namespaces), ec2:DescribeTags/DescribeVolumes (CloudWatch agent) and the "
                             "Session Manager channel actions have no resource-level permissions.", "Resource::*")
    ack(engine_role, "IAM5", "cloudformation:SignalResource on this serving stack only; a stack ARN ends in an id "
                             "generated at creation.",
        f"Resource::arn:<AWS::Partition>:cloudformation:{region}:{account}:stack/{serving.stack_name}/*")
    ack(engine_role, "IAM5", "Log streams of the engines' own log group are named per instance at run time.",
        f"Resource::<{_logical(serving.log_group)}.Arn>:*")
    if config.model.s3_uri:
        bucket_prefix = config.model.s3_uri[len("s3://"):]
        ack(engine_role, "IAM5", "Engines read the model weights under the configured S3 prefix (read-only).",
            f"Resource::arn:<AWS::Partition>:s3:::{bucket_prefix}*")
    ack(serving.offer_secret, "SMG4", "The engines' offer signing key: every engine of the deployment must hold the "
                                      "same value, and running engines read it once at boot, so a rotation Lambda "
                                      "would split the fleet. Rotate by changing the secret, then replacing the "
                                      "engines (cdk deploy rolls them); offers signed with the old key are "
                                      "recomputed, never read.")
    dereg_role = serving.node.find_child("DeregisterRole")
    for pool in serving.pools.values():
        ack(engine_role, "IAM5", "autoscaling:SetInstanceHealth and CompleteLifecycleAction on this deployment's "
                                 "engine groups, each by name: a node whose engine fails or never serves marks itself "
                                 "unhealthy, and a node being terminated completes the drain hook once drained. A "
                                 "group ARN embeds a generated id.",
            f"Resource::arn:<AWS::Partition>:autoscaling:{region}:{account}:autoScalingGroup/*:"
            f"autoScalingGroupName/{pool.group_name}")
    ack(dereg_role, "IAM5", "The function's own log group; streams are created per invocation container.",
        f"Resource::<{_logical(serving.node.find_child('DeregisterLogs'))}.Arn>:*")

    # --- router
    router = t.router
    task = router.node.find_child("Task")
    ack(task, "ECS2", "Only non-secret settings (deployment name, region, metrics namespace) are plain environment "
                      "variables; the API keys come from Secrets Manager.")
    ack(task.node.find_child("ExecutionRole"), "IAM5", "ecr:GetAuthorizationToken has no resource-level "
                                                       "permissions (pulling the image itself is scoped to the "
                                                       "repository).", "Resource::*")
    task_role = task.node.find_child("TaskRole")
    ack(task_role, "IAM5", "servicediscovery:DiscoverInstances has no resource-level permissions.", "Resource::*")
    ack(task_role, "IAM5", "The router reads its deployment's tunables (the router scope under the same path).",
        f"Resource::{ssm_prefix}")
    credentials = getattr(router, "valkey_credentials", None)
    if credentials is not None:
        ack(credentials, "SMG4", "The router's Valkey (ElastiCache RBAC) password: rotating it means updating the "
                                 "ElastiCache user and restarting the router tasks together, which a deploy does "
                                 "(change the secret, then cdk deploy); there is no rotation Lambda for ElastiCache "
                                 "users.")
    default_credentials = getattr(router, "valkey_default_credentials", None)
    if default_credentials is not None:
        ack(default_credentials, "SMG4", "The Valkey default user's password: the user is switched off (off -@all) "
                                         "and nothing reads the password; it exists because ElastiCache takes only "
                                         "users with a password or IAM authentication into a user group.")
    ack(router.api_keys, "SMG4", "Router API keys are issued to clients; a rotation Lambda cannot hand new keys to "
                                 "them. Operators rotate by adding a key, moving clients, removing the old one "
                                 "(docs/deploy-aws.md).")
    if any(c in ("0.0.0.0/0", "::/0") for c in config.router.allowed_cidrs):
        ack(router.alb_sg, "EC23", "The operator opened the ALB listener to the internet explicitly "
                                   "(router.allowed_cidrs lists 0.0.0.0/0 or ::/0); only the listener ports are open.")
    ack(router.node.find_child("AlbAccessLogs"), "S1", "This bucket is the ALB's access-log destination; logging "
                                                       "access to the log bucket itself would only log the logger.")


def _image(image, assets_bucket: str) -> None:
    build_role = image.node.find_child("BuildRole")
    for policy in ("AmazonSSMManagedInstanceCore", "EC2InstanceProfileForImageBuilder"):
        ack(build_role, "IAM4", f"Image Builder build instances need {policy} (AWS's documented instance-profile "
                                "policies for Image Builder; the build instance lives only for the bake).",
            f"Policy::arn:<AWS::Partition>:iam::aws:policy/{policy}")
    s3_read_reason = ("Granted by Asset.grantRead / Bucket.grantRead: read-only object actions on one asset object "
                      "and the wheel prefix of this stack's bucket.")
    for action in ("s3:GetObject*", "s3:GetBucket*", "s3:List*"):
        ack(build_role, "IAM5", s3_read_reason, f"Action::{action}")
    ack(build_role, "IAM5", "Bucket.grantPut for Image Builder's log upload (multipart abort on this log prefix "
                            "only).", "Action::s3:Abort*")
    ack(build_role, "IAM5", "The CDK asset bucket holds the scripts zip; its object key is a content hash known "
                            "only to the deployment tooling.", f"Resource::{assets_bucket}")
    ack(build_role, "IAM5", "Read access to this wheel's prefix (the digest directory) in the artifacts bucket.",
        f"Resource::<{_logical(image.node.find_child('Artifacts'))}.Arn>/{image.wheel_prefix}*")
    ack(build_role, "IAM5", "Image Builder writes its build logs under this prefix (one object per step).",
        f"Resource::<{_logical(image.node.find_child('BuildLogs'))}.Arn>/imagebuilder/*")
    for child in image.node.children:
        if child.node.id.startswith("Custom::CDKBucketDeployment"):
            why = ("CDK's BucketDeployment singleton (copies the wheel to a named key, which the AMI's connector "
                   "step requires); its role and runtime are managed by aws-cdk-lib.")
            ack(child, "L1", why + " The runtime is the one aws-cdk-lib bundles its AWS CLI layer for.")
            ack(child, "IAM4", why + " Basic execution role for its CloudWatch logs.",
                "Policy::arn:<AWS::Partition>:iam::aws:policy/service-role/AWSLambdaBasicExecutionRole")
            for action in ("s3:GetObject*", "s3:GetBucket*", "s3:List*", "s3:DeleteObject*", "s3:Abort*"):
                ack(child, "IAM5", why + " Read the source asset, write the destination bucket.", f"Action::{action}")
            ack(child, "IAM5", why + " Source: the CDK asset bucket.", f"Resource::{assets_bucket}")
            ack(child, "IAM5", why + " Destination: this stack's artifacts bucket.",
                f"Resource::<{_logical(image.node.find_child('Artifacts'))}.Arn>/*")
