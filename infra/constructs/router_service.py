"""The router on ECS Fargate: its image (built from ``router/Dockerfile``), cluster, task (role, logs, container
with its command, environment and secrets) and service, and the service's autoscaling. Scope-preserving
(``infra.constructs``)."""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import Duration, RemovalPolicy, Stack
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_ecr_assets as ecr_assets
from aws_cdk import aws_ecs as ecs
from aws_cdk import aws_elasticloadbalancingv2 as elbv2
from aws_cdk import aws_iam as iam
from aws_cdk import aws_logs as logs
from aws_cdk import aws_secretsmanager as secretsmanager
from constructs import Construct

from infra.config import RouterDeploymentConfig
from infra.constructs.elasticache_store import VALKEY_USER, ElastiCacheStore
from infra.stacks.params import parameter_arn
from infra.wheel import REPO_ROOT
from turnkv import metric_names as mn
from turnkv import router_env

ROUTER_PORT = router_env.PORT
#: The router reads its store credentials from these (turnkv.router_env, as router.state.valkey does).
STORE_USERNAME_ENV = router_env.STORE_USERNAME
STORE_PASSWORD_ENV = router_env.STORE_PASSWORD
#: Router keep-alive beyond the ALB idle timeout (AWS: a target's keep-alive shorter than the load balancer's
#: idle timeout causes sporadic 502s).
KEEPALIVE_MARGIN_S = 60
#: Kept out of the router image's build context (CDK stages it in cdk.out, then docker reads it): every virtual
#: environment (`.venv`, and the side venvs `.venv-vllm029`, `.venv-aiperf`, `.venv-gpu-check`: gigabytes each), the
#: local stack's state and results, build output. Mirrors .dockerignore for `docker build -f router/Dockerfile .`.
DOCKER_EXCLUDES = [".git", ".venv*", "node_modules", "cdk.out", "build", "dist", ".turnkv", "results", "tests",
                   "**/__pycache__", "*.egg-info"]
#: Autoscaling targets: average CPU per task (percent) and ALB requests per task (per minute).
SCALE_CPU_PERCENT = 60
SCALE_REQUESTS_PER_TARGET = 200


@dataclass(frozen=True)
class RouterServiceProps:
    #: Deployment name (``TURNKV_DEPLOYMENT``, the log group and SSM paths) and resource-name prefix.
    deployment: str
    prefix: str
    region: str
    router: RouterDeploymentConfig
    vpc: ec2.IVpc
    subnets: ec2.SubnetSelection
    security_group: ec2.ISecurityGroup
    #: Clients' API keys (JSON list under ``keys``).
    api_keys: secretsmanager.ISecret
    #: The engines' offer secret: the router clears each offer it replays, and prefill reads only cleared offers
    #: (turnkv.wire), so an offer that bypassed the evictions feed is never read.
    offer_secret: secretsmanager.ISecret
    #: Engine discovery: the Cloud Map namespace and service the engines register in.
    namespace_name: str
    cloudmap_service: str
    #: The shared conversation store; None: each replica keeps its own (one replica only).
    store: ElastiCacheStore | None = None
    #: USD per prefill engine-hour (``DeploymentConfig.prefill_engine_price_per_hour``): the router prices the
    #: prefill time reuse saves at it; 0: unknown, seconds only.
    prefill_price_per_hour: float = 0.0
    #: Hosts media URLs may name (``DeploymentConfig.media_domains``, ``TURNKV_MEDIA_DOMAINS``); empty: any internet
    #: host, resolved and checked (router.media).
    media_domains: tuple[str, ...] = ()


class RouterService:
    """``image``, ``cluster``, ``task``, ``log_group``, ``container`` and ``service``; ``autoscale`` adds the
    service's scaling on CPU and on the target group's request count."""

    def __init__(self, scope: Construct, props: RouterServiceProps) -> None:
        rc = props.router
        self.image = ecr_assets.DockerImageAsset(
            scope, "Image", directory=str(REPO_ROOT), file="router/Dockerfile", exclude=DOCKER_EXCLUDES,
            platform=ecr_assets.Platform.LINUX_AMD64)
        self.cluster = ecs.Cluster(scope, "Cluster", vpc=props.vpc, cluster_name=props.prefix,
                                   container_insights_v2=ecs.ContainerInsights.ENHANCED)
        self.task = ecs.FargateTaskDefinition(scope, "Task", cpu=rc.cpu, memory_limit_mib=rc.memory_mib,
                                              runtime_platform=ecs.RuntimePlatform(
                                                  cpu_architecture=ecs.CpuArchitecture.X86_64,
                                                  operating_system_family=ecs.OperatingSystemFamily.LINUX))
        stack = Stack.of(scope)
        self.task.add_to_task_role_policy(iam.PolicyStatement(
            sid="ReadRouterTunables", actions=["ssm:GetParametersByPath", "ssm:GetParameters", "ssm:GetParameter"],
            resources=[parameter_arn(stack, props.deployment, "*"),
                       stack.format_arn(service="ssm", resource="parameter",
                                        resource_name=f"turnkv/{props.deployment}")]))
        self.task.add_to_task_role_policy(iam.PolicyStatement(
            sid="DiscoverEngines", actions=["servicediscovery:DiscoverInstances",
                                            "servicediscovery:DiscoverInstancesRevision"], resources=["*"]))
        self.log_group = logs.LogGroup(scope, "RouterLogs", log_group_name=f"/turnkv/{props.deployment}/router",
                                       retention=logs.RetentionDays.ONE_MONTH, removal_policy=RemovalPolicy.DESTROY)
        store_args = ["--store", props.store.url] if props.store is not None else []
        command = ["--host", "0.0.0.0", "--port", str(ROUTER_PORT),
                   "--discovery", "cloudmap", "--namespace", props.namespace_name,
                   "--service", props.cloudmap_service, "--region", props.region, *store_args,
                   # Outlast the ALB's idle timeout: a connection the ALB still reuses is never closed under it.
                   "--keepalive-timeout", str(rc.idle_timeout_s + KEEPALIVE_MARGIN_S)]
        container_secrets = {
            router_env.API_KEYS: ecs.Secret.from_secrets_manager(props.api_keys),
            router_env.OFFER_SECRET: ecs.Secret.from_secrets_manager(props.offer_secret),
        }
        environment = {router_env.DEPLOYMENT: props.deployment, router_env.REGION: props.region,
                       router_env.METRICS_NAMESPACE: mn.ROUTER_NAMESPACE}
        if props.prefill_price_per_hour > 0:
            environment[router_env.PREFILL_PRICE] = f"{props.prefill_price_per_hour:g}"
        if props.media_domains:
            environment[router_env.MEDIA_DOMAINS] = ",".join(props.media_domains)
        if props.store is not None:
            container_secrets[STORE_PASSWORD_ENV] = ecs.Secret.from_secrets_manager(
                props.store.credentials, "password")
            environment[STORE_USERNAME_ENV] = VALKEY_USER
        self.container = self.task.add_container(
            "router", image=ecs.ContainerImage.from_docker_image_asset(self.image), command=command,
            port_mappings=[ecs.PortMapping(container_port=ROUTER_PORT)],
            environment=environment,
            secrets=container_secrets,
            logging=ecs.LogDrivers.aws_logs(stream_prefix="router", log_group=self.log_group),
            health_check=ecs.HealthCheck(
                command=["CMD", "python", "-c",
                         f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{ROUTER_PORT}/health', "
                         "timeout=4)"],
                interval=Duration.seconds(15), timeout=Duration.seconds(5), retries=3,
                start_period=Duration.seconds(30)),
            readonly_root_filesystem=True, user="10001", stop_timeout=Duration.seconds(120))
        self.service = ecs.FargateService(
            scope, "Service", cluster=self.cluster, task_definition=self.task,
            vpc_subnets=props.subnets, security_groups=[props.security_group], assign_public_ip=False,
            circuit_breaker=ecs.DeploymentCircuitBreaker(rollback=True), min_healthy_percent=100,
            max_healthy_percent=200, health_check_grace_period=Duration.seconds(60))
        # No desired_count: with one in the template every deploy would reset the task count autoscaling chose
        # (ECS keeps the running count when DesiredCount is absent on update; registering the scalable target moves
        # the count into [router.replicas, router.max_replicas]: Application Auto Scaling's RegisterScalableTarget).
        self._router = rc

    def autoscale(self, target_group: elbv2.ApplicationTargetGroup) -> ecs.ScalableTaskCount:
        """Between ``router.replicas`` and ``router.max_replicas`` tasks, on CPU and on requests per task."""
        scaling = self.service.auto_scale_task_count(min_capacity=self._router.replicas,
                                                     max_capacity=self._router.max_replicas)
        scaling.scale_on_cpu_utilization("Cpu", target_utilization_percent=SCALE_CPU_PERCENT,
                                         scale_in_cooldown=Duration.minutes(5), scale_out_cooldown=Duration.minutes(1))
        scaling.scale_on_request_count("Requests", requests_per_target=SCALE_REQUESTS_PER_TARGET,
                                       target_group=target_group,
                                       scale_in_cooldown=Duration.minutes(5), scale_out_cooldown=Duration.minutes(1))
        return scaling
