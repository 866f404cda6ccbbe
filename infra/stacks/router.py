"""Router: the KV-cache-aware proxy on ECS Fargate (image from ``router/Dockerfile``) behind an ALB (HTTPS
with a certificate, HTTP otherwise; long idle timeout; /health checks), autoscaling, ElastiCache Serverless
(Valkey) for shared conversation state whenever more than one replica can exist (``router.max_replicas`` > 1),
API keys in Secrets Manager."""

from __future__ import annotations

from aws_cdk import CfnOutput, RemovalPolicy, Stack
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_secretsmanager as secretsmanager
from aws_cdk import aws_ssm as ssm
from constructs import Construct

from infra.config import DeploymentConfig
from infra.constructs.elasticache_store import (  # noqa: F401  (re-exported)
    VALKEY_DEFAULT_ACCESS,
    VALKEY_PORT,
    VALKEY_USER,
    ElastiCacheStore,
    ElastiCacheStoreProps,
)
from infra.constructs.router_access import RouterAccess, RouterAccessProps
from infra.constructs.router_alb import RouterAlb, RouterAlbProps
from infra.constructs.router_service import (  # noqa: F401  (re-exported: the router's facts, where tests read them)
    DOCKER_EXCLUDES,
    KEEPALIVE_MARGIN_S,
    ROUTER_PORT,
    STORE_PASSWORD_ENV,
    STORE_USERNAME_ENV,
    RouterService,
    RouterServiceProps,
)
from infra.stacks.network import NetworkStack
from infra.stacks.serving import CLOUDMAP_SERVICE, ServingStack

#: What the router stack publishes for the observability stack (``DeploymentConfig.stack_output_parameter``,
#: under ``router``): key -> description. SSM, never an export: toggling ``router.public`` replaces the ALB and
#: adding a certificate replaces the listener, and CloudFormation refuses to change an export another stack imports.
ROUTER_OUTPUTS: dict[str, str] = {
    "alb-full-name": "the router ALB's full name (the LoadBalancer dimension of its metrics)",
    "target-group-full-name": "the router target group's full name (the TargetGroup dimension)",
    "cluster-name": "the router's ECS cluster (the ClusterName dimension)",
    "service-name": "the router's ECS service (the ServiceName dimension)",
}


class RouterStack(Stack):
    """Built from scope-preserving constructs (``infra.constructs``): the logical ids are the ones the inline
    constructor had."""

    def __init__(self, scope: Construct, construct_id: str, *, config: DeploymentConfig, network: NetworkStack,
                 serving: ServingStack, **kwargs) -> None:
        super().__init__(scope, construct_id, **kwargs)
        self.config = config
        rc = config.router
        vpc = network.vpc
        private = ec2.SubnetSelection(subnets=network.private_subnets)

        access = RouterAccess(self, RouterAccessProps(
            network=network, engines=serving.security_group,
            client_cidrs=tuple(rc.allowed_cidrs or (config.network.vpc_cidr,)), https=bool(rc.certificate_arn),
            engine_ports=serving.http_ports))
        self.alb_sg = access.alb_sg
        self.router_sg = access.router_sg

        self.api_keys = secretsmanager.Secret(
            self, "ApiKeys", secret_name=f"{config.prefix}/router-api-keys",
            description="turnkv router API keys (JSON list under 'keys'); clients send one as a Bearer token",
            generate_secret_string=secretsmanager.SecretStringGenerator(
                secret_string_template='{"keys": []}', generate_string_key="initial", exclude_punctuation=True,
                password_length=48),
            removal_policy=RemovalPolicy.DESTROY)

        self.store: ElastiCacheStore | None = None
        if rc.uses_valkey:
            self.store = ElastiCacheStore(self, ElastiCacheStoreProps(
                prefix=config.prefix, vpc=vpc, subnets=tuple(network.private_subnets), clients=self.router_sg))
            self.valkey_credentials = self.store.credentials
            self.valkey_default_credentials = self.store.default_credentials
        self.valkey = self.store.cache if self.store is not None else None

        router = RouterService(self, RouterServiceProps(
            deployment=config.name, prefix=config.prefix, region=config.region, router=rc, vpc=vpc,
            subnets=private, security_group=self.router_sg, api_keys=self.api_keys,
            offer_secret=serving.offer_secret, namespace_name=serving.namespace.namespace_name,
            cloudmap_service=CLOUDMAP_SERVICE, store=self.store,
            prefill_price_per_hour=config.prefill_engine_price_per_hour(), media_domains=config.media_domains))
        self.container = router.container
        self.service = router.service

        lb = RouterAlb(self, RouterAlbProps(
            vpc=vpc, public=rc.public,
            subnets=ec2.SubnetSelection(subnet_type=ec2.SubnetType.PUBLIC) if rc.public else private,
            security_group=self.alb_sg, idle_timeout_s=rc.idle_timeout_s, service=self.service,
            certificate_arn=rc.certificate_arn))
        self.alb = lb.alb
        self.target_group = lb.target_group
        self.listener = lb.listener
        CfnOutput(self, "AlbDnsName", value=self.alb.load_balancer_dns_name,
                  description="The router's ALB: turnkv smoke --url http(s)://<this> (HTTPS: your certificate's "
                              "DNS name, pointed at this)")

        router.autoscale(self.target_group)

        values = {"alb-full-name": self.alb.load_balancer_full_name,
                  "target-group-full-name": self.target_group.target_group_full_name,
                  "cluster-name": self.service.cluster.cluster_name, "service-name": self.service.service_name}
        assert values.keys() == ROUTER_OUTPUTS.keys()
        for key, value in values.items():
            ssm.StringParameter(self, f"Output-{key}", parameter_name=config.stack_output_parameter("router", key),
                                string_value=value, description=f"turnkv {config.name}: {ROUTER_OUTPUTS[key]}")
        # What the observability stack imported before it read SSM, still exported: a deployment made before can
        # update (this stack deploys first, while its observability stack still imports them); nothing imports
        # them afterwards, so a later change may drop or alter them.
        for legacy in (*values.values(), self.listener.listener_arn):
            self.export_value(legacy)
