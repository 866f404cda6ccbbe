"""The router's Application Load Balancer: access-log bucket, the ALB (long idle timeout), the target group of
router tasks (/health checks) and the listener (HTTPS with a certificate, with HTTP redirected; HTTP
otherwise). Scope-preserving (``infra.constructs``)."""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import Duration, RemovalPolicy
from aws_cdk import aws_certificatemanager as acm
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_ecs as ecs
from aws_cdk import aws_elasticloadbalancingv2 as elbv2
from aws_cdk import aws_s3 as s3
from constructs import Construct

from turnkv import router_env

#: Elastic Load Balancing's largest target group deregistration delay.
MAX_DEREGISTRATION_DELAY_S = 3600


@dataclass(frozen=True)
class RouterAlbProps:
    vpc: ec2.IVpc
    #: Internet-facing (in ``subnets``: the public ones) or internal.
    public: bool
    subnets: ec2.SubnetSelection
    security_group: ec2.ISecurityGroup
    #: Also the target group's deregistration delay (up to ELB's 3600 s): a deploy or scale-in drains a task for
    #: as long as a stream may stay silent, instead of cutting streams at 120 s.
    idle_timeout_s: int
    #: The router tasks, registered by IP on the router's port.
    service: ecs.FargateService
    #: ACM certificate: HTTPS on 443, HTTP on 80 redirects; None: HTTP on 80.
    certificate_arn: str | None = None


class RouterAlb:
    """``access_logs``, ``alb``, ``target_group`` and ``listener``."""

    def __init__(self, scope: Construct, props: RouterAlbProps) -> None:
        self.access_logs = s3.Bucket(
            scope, "AlbAccessLogs", encryption=s3.BucketEncryption.S3_MANAGED, enforce_ssl=True,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL, removal_policy=RemovalPolicy.DESTROY,
            # The ALB writes logs into it: without emptying it first, `cdk destroy` fails on this stack and the
            # serving stack behind it (the GPU instances) keeps running.
            auto_delete_objects=True,
            object_ownership=s3.ObjectOwnership.BUCKET_OWNER_ENFORCED,
            lifecycle_rules=[s3.LifecycleRule(expiration=Duration.days(90))])
        self.alb = elbv2.ApplicationLoadBalancer(
            scope, "Alb", vpc=props.vpc, internet_facing=props.public, security_group=props.security_group,
            vpc_subnets=props.subnets, idle_timeout=Duration.seconds(props.idle_timeout_s),
            # No fixed name: CloudFormation replaces the ALB when router.public flips (Scheme), creating the new
            # one before deleting the old, which fails on a name taken (the DNS name is the stack's AlbDnsName output).
            drop_invalid_header_fields=True)
        self.alb.log_access_logs(self.access_logs, prefix="alb")
        self.target_group = elbv2.ApplicationTargetGroup(
            scope, "Targets", vpc=props.vpc, port=router_env.PORT, protocol=elbv2.ApplicationProtocol.HTTP,
            target_type=elbv2.TargetType.IP, targets=[props.service],
            deregistration_delay=Duration.seconds(min(props.idle_timeout_s, MAX_DEREGISTRATION_DELAY_S)),
            health_check=elbv2.HealthCheck(path="/health", healthy_http_codes="200", interval=Duration.seconds(15),
                                           timeout=Duration.seconds(5), healthy_threshold_count=2,
                                           unhealthy_threshold_count=3))
        if props.certificate_arn:
            certificate = acm.Certificate.from_certificate_arn(scope, "Certificate", props.certificate_arn)
            self.listener = self.alb.add_listener(
                "Https", port=443, protocol=elbv2.ApplicationProtocol.HTTPS, certificates=[certificate],
                ssl_policy=elbv2.SslPolicy.RECOMMENDED_TLS, open=False, default_target_groups=[self.target_group])
            self.alb.add_redirect(source_port=80, target_port=443, open=False)
        else:
            self.listener = self.alb.add_listener(
                "Http", port=80, protocol=elbv2.ApplicationProtocol.HTTP, open=False,
                default_target_groups=[self.target_group])
