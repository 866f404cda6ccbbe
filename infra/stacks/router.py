"""Router: the KV-cache-aware proxy on ECS Fargate (image from ``router/Dockerfile``) behind an ALB (HTTPS
with a certificate, HTTP otherwise; long idle timeout; /health checks), autoscaling, ElastiCache Serverless
(Valkey) for shared conversation state whenever more than one replica can exist (``router.max_replicas`` > 1),
API keys in Secrets Manager."""

from __future__ import annotations

from aws_cdk import Duration, RemovalPolicy, Stack
from aws_cdk import aws_certificatemanager as acm
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_ecr_assets as ecr_assets
from aws_cdk import aws_ecs as ecs
from aws_cdk import aws_elasticache as elasticache
from aws_cdk import aws_elasticloadbalancingv2 as elbv2
from aws_cdk import aws_iam as iam
from aws_cdk import aws_logs as logs
from aws_cdk import aws_s3 as s3
from aws_cdk import aws_secretsmanager as secretsmanager
from constructs import Construct

from infra.config import DeploymentConfig
from infra.stacks.network import NetworkStack, https_egress
from infra.stacks.params import parameter_arn
from infra.stacks.serving import CLOUDMAP_SERVICE, ServingStack
from infra.wheel import REPO_ROOT
from turnkv import metric_names as mn
from turnkv import node_env, router_env

ROUTER_PORT = router_env.PORT
VALKEY_PORT = 6379
VALKEY_USER = "turnkv-router"
#: The default user's access string: switched off, no command allowed.
VALKEY_DEFAULT_ACCESS = "off -@all"
#: The router reads its store credentials from these (turnkv.router_env, as router.state.valkey does).
STORE_USERNAME_ENV = router_env.STORE_USERNAME
STORE_PASSWORD_ENV = router_env.STORE_PASSWORD
#: Router keep-alive beyond the ALB idle timeout (AWS: a target's keep-alive shorter than the load balancer's
#: idle timeout causes sporadic 502s).
KEEPALIVE_MARGIN_S = 60
#: Beyond .dockerignore: never stage these into the image asset.
#: Kept out of the router image's build context (CDK stages it in cdk.out, then docker reads it): every virtual
#: environment (`.venv`, and the side venvs `.venv-vllm029`, `.venv-aiperf`, `.venv-gpu-check`: gigabytes each), the
#: local stack's state and results, build output. Mirrors .dockerignore for `docker build -f router/Dockerfile .`.
DOCKER_EXCLUDES = [".git", ".venv*", "node_modules", "cdk.out", "build", "dist", ".turnkv", "results", "tests",
                   "**/__pycache__", "*.egg-info"]


class RouterStack(Stack):
    def __init__(self, scope: Construct, construct_id: str, *, config: DeploymentConfig, network: NetworkStack,
                 serving: ServingStack, **kwargs) -> None:
        super().__init__(scope, construct_id, **kwargs)
        self.config = config
        rc = config.router
        vpc = network.vpc
        private = ec2.SubnetSelection(subnets=network.private_subnets)

        # --- security groups: clients -> ALB -> router -> engines (and Valkey)
        self.alb_sg = ec2.SecurityGroup(self, "AlbSecurityGroup", vpc=vpc, allow_all_outbound=False,
                                        description="turnkv ALB: the listener, from the allowed client CIDRs")
        listener_port = 443 if rc.certificate_arn else 80
        client_cidrs = rc.allowed_cidrs or (config.network.vpc_cidr,)
        for i, cidr in enumerate(client_cidrs):
            peer = ec2.Peer.ipv6(cidr) if ":" in cidr else ec2.Peer.ipv4(cidr)
            self.alb_sg.add_ingress_rule(peer, ec2.Port.tcp(listener_port), f"clients {i}")
            if rc.certificate_arn:
                self.alb_sg.add_ingress_rule(peer, ec2.Port.tcp(80), f"clients {i}: redirect to HTTPS")
        self.router_sg = ec2.SecurityGroup(self, "RouterSecurityGroup", vpc=vpc, allow_all_outbound=False,
                                           description="turnkv router tasks")
        self.router_sg.add_ingress_rule(self.alb_sg, ec2.Port.tcp(ROUTER_PORT), "from the ALB")
        self.alb_sg.add_egress_rule(self.router_sg, ec2.Port.tcp(ROUTER_PORT), "to the router tasks")
        https_egress(self.router_sg, network, "AWS APIs, ECR image layers")
        self.router_sg.add_egress_rule(serving.security_group, ec2.Port.tcp(node_env.DEFAULT_PORT),
                                       "to the engines' HTTP port")
        # The rule on the engines' group lives here (router -> serving dependency only, no cycle).
        ec2.CfnSecurityGroupIngress(
            self, "EngineFromRouter", group_id=serving.security_group.security_group_id, ip_protocol="tcp",
            from_port=node_env.DEFAULT_PORT, to_port=node_env.DEFAULT_PORT,
            source_security_group_id=self.router_sg.security_group_id, description="turnkv router to engines")

        # --- API keys
        self.api_keys = secretsmanager.Secret(
            self, "ApiKeys", secret_name=f"{config.prefix}/router-api-keys",
            description="turnkv router API keys (JSON list under 'keys'); clients send one as a Bearer token",
            generate_secret_string=secretsmanager.SecretStringGenerator(
                secret_string_template='{"keys": []}', generate_string_key="initial", exclude_punctuation=True,
                password_length=48),
            removal_policy=RemovalPolicy.DESTROY)

        # --- conversation store
        store_args: list[str] = []
        self.valkey: elasticache.CfnServerlessCache | None = None
        if rc.uses_valkey:
            valkey_sg = ec2.SecurityGroup(self, "ValkeySecurityGroup", vpc=vpc, allow_all_outbound=False,
                                          description="turnkv conversation store (Valkey): router only")
            valkey_sg.add_ingress_rule(self.router_sg, ec2.Port.tcp(VALKEY_PORT), "from the router")
            self.router_sg.add_egress_rule(valkey_sg, ec2.Port.tcp(VALKEY_PORT), "to Valkey")
            # Authentication (an RBAC user group) on top of TLS: the store also holds the conversation-key HMAC
            # secret. The router's user and password come from Secrets Manager; the default user is switched off.
            self.valkey_credentials = secretsmanager.Secret(
                self, "ValkeyCredentials", secret_name=f"{config.prefix}/valkey-router",
                description="turnkv router's Valkey (ElastiCache RBAC) user",
                generate_secret_string=secretsmanager.SecretStringGenerator(
                    secret_string_template=f'{{"username": "{VALKEY_USER}"}}', generate_string_key="password",
                    exclude_punctuation=True, password_length=64),
                removal_policy=RemovalPolicy.DESTROY)
            router_user = elasticache.CfnUser(
                self, "ValkeyRouterUser", engine="valkey", user_id=f"{config.prefix}-router", user_name=VALKEY_USER,
                access_string="on ~* +@all -@dangerous",
                authentication_mode={"Type": "password", "Passwords": [
                    self.valkey_credentials.secret_value_from_json("password").unsafe_unwrap()]})
            # ElastiCache takes only users with a password or IAM authentication into a Valkey user group; the
            # default user must be in it, so it gets a generated password nobody reads, and stays switched off.
            self.valkey_default_credentials = secretsmanager.Secret(
                self, "ValkeyDefaultCredentials", secret_name=f"{config.prefix}/valkey-default",
                description="turnkv Valkey default user's password (the user is switched off: off -@all)",
                generate_secret_string=secretsmanager.SecretStringGenerator(
                    exclude_punctuation=True, password_length=64),
                removal_policy=RemovalPolicy.DESTROY)
            default_user = elasticache.CfnUser(
                self, "ValkeyDefaultUser", engine="valkey", user_id=f"{config.prefix}-default", user_name="default",
                access_string=VALKEY_DEFAULT_ACCESS, authentication_mode={"Type": "password", "Passwords": [
                    self.valkey_default_credentials.secret_value.unsafe_unwrap()]})
            users = elasticache.CfnUserGroup(
                self, "ValkeyUsers", engine="valkey", user_group_id=f"{config.prefix}-state",
                user_ids=[default_user.ref, router_user.ref])
            self.valkey = elasticache.CfnServerlessCache(
                self, "Valkey", engine="valkey", serverless_cache_name=f"{config.prefix}-state",
                major_engine_version="8", description="turnkv router conversation state",
                security_group_ids=[valkey_sg.security_group_id], user_group_id=users.ref,
                subnet_ids=[s.subnet_id for s in network.private_subnets])
            store_args = ["--store", f"rediss://{self.valkey.attr_endpoint_address}:{self.valkey.attr_endpoint_port}"]

        # --- task
        image = ecr_assets.DockerImageAsset(
            self, "Image", directory=str(REPO_ROOT), file="router/Dockerfile", exclude=DOCKER_EXCLUDES,
            platform=ecr_assets.Platform.LINUX_AMD64)
        cluster = ecs.Cluster(self, "Cluster", vpc=vpc, cluster_name=config.prefix,
                              container_insights_v2=ecs.ContainerInsights.ENHANCED)
        task = ecs.FargateTaskDefinition(self, "Task", cpu=rc.cpu, memory_limit_mib=rc.memory_mib,
                                         runtime_platform=ecs.RuntimePlatform(
                                             cpu_architecture=ecs.CpuArchitecture.X86_64,
                                             operating_system_family=ecs.OperatingSystemFamily.LINUX))
        task.add_to_task_role_policy(iam.PolicyStatement(
            sid="ReadRouterTunables", actions=["ssm:GetParametersByPath", "ssm:GetParameters", "ssm:GetParameter"],
            resources=[parameter_arn(self, config.name, "*"),
                       self.format_arn(service="ssm", resource="parameter", resource_name=f"turnkv/{config.name}")]))
        task.add_to_task_role_policy(iam.PolicyStatement(
            sid="DiscoverEngines", actions=["servicediscovery:DiscoverInstances",
                                            "servicediscovery:DiscoverInstancesRevision"], resources=["*"]))
        log_group = logs.LogGroup(self, "RouterLogs", log_group_name=f"/turnkv/{config.name}/router",
                                  retention=logs.RetentionDays.ONE_MONTH, removal_policy=RemovalPolicy.DESTROY)
        command = ["--host", "0.0.0.0", "--port", str(ROUTER_PORT),
                   "--discovery", "cloudmap", "--namespace", serving.namespace.namespace_name,
                   "--service", CLOUDMAP_SERVICE, "--region", config.region, *store_args,
                   # Outlast the ALB's idle timeout: a connection the ALB still reuses is never closed under it.
                   "--keepalive-timeout", str(rc.idle_timeout_s + KEEPALIVE_MARGIN_S)]
        container_secrets = {
            router_env.API_KEYS: ecs.Secret.from_secrets_manager(self.api_keys),
            # The engines' offer secret: the router clears each offer it replays, and prefill reads only cleared
            # offers (turnkv.wire), so an offer that bypassed the evictions feed is never read.
            router_env.OFFER_SECRET: ecs.Secret.from_secrets_manager(serving.offer_secret),
        }
        environment = {router_env.DEPLOYMENT: config.name, router_env.REGION: config.region,
                       router_env.METRICS_NAMESPACE: mn.ROUTER_NAMESPACE}
        if self.valkey is not None:
            container_secrets[STORE_PASSWORD_ENV] = ecs.Secret.from_secrets_manager(
                self.valkey_credentials, "password")
            environment[STORE_USERNAME_ENV] = VALKEY_USER
        self.container = task.add_container(
            "router", image=ecs.ContainerImage.from_docker_image_asset(image), command=command,
            port_mappings=[ecs.PortMapping(container_port=ROUTER_PORT)],
            environment=environment,
            secrets=container_secrets,
            logging=ecs.LogDrivers.aws_logs(stream_prefix="router", log_group=log_group),
            health_check=ecs.HealthCheck(
                command=["CMD", "python", "-c",
                         f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{ROUTER_PORT}/health', "
                         "timeout=4)"],
                interval=Duration.seconds(15), timeout=Duration.seconds(5), retries=3,
                start_period=Duration.seconds(30)),
            readonly_root_filesystem=True, user="10001", stop_timeout=Duration.seconds(120))
        self.service = ecs.FargateService(
            self, "Service", cluster=cluster, task_definition=task, desired_count=rc.replicas,
            vpc_subnets=private, security_groups=[self.router_sg], assign_public_ip=False,
            circuit_breaker=ecs.DeploymentCircuitBreaker(rollback=True), min_healthy_percent=100,
            max_healthy_percent=200, health_check_grace_period=Duration.seconds(60))

        # --- ALB
        access_logs = s3.Bucket(
            self, "AlbAccessLogs", encryption=s3.BucketEncryption.S3_MANAGED, enforce_ssl=True,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL, removal_policy=RemovalPolicy.DESTROY,
            # The ALB writes logs into it: without emptying it first, `cdk destroy` fails on this stack and the
            # serving stack behind it (the GPU instances) keeps running.
            auto_delete_objects=True,
            object_ownership=s3.ObjectOwnership.BUCKET_OWNER_ENFORCED,
            lifecycle_rules=[s3.LifecycleRule(expiration=Duration.days(90))])
        self.alb = elbv2.ApplicationLoadBalancer(
            self, "Alb", vpc=vpc, internet_facing=rc.public, security_group=self.alb_sg,
            vpc_subnets=ec2.SubnetSelection(subnet_type=ec2.SubnetType.PUBLIC) if rc.public else private,
            idle_timeout=Duration.seconds(rc.idle_timeout_s), drop_invalid_header_fields=True,
            load_balancer_name=config.prefix)
        self.alb.log_access_logs(access_logs, prefix="alb")
        self.target_group = elbv2.ApplicationTargetGroup(
            self, "Targets", vpc=vpc, port=ROUTER_PORT, protocol=elbv2.ApplicationProtocol.HTTP,
            target_type=elbv2.TargetType.IP, targets=[self.service],
            deregistration_delay=Duration.seconds(120),
            health_check=elbv2.HealthCheck(path="/health", healthy_http_codes="200", interval=Duration.seconds(15),
                                           timeout=Duration.seconds(5), healthy_threshold_count=2,
                                           unhealthy_threshold_count=3))
        if rc.certificate_arn:
            certificate = acm.Certificate.from_certificate_arn(self, "Certificate", rc.certificate_arn)
            self.listener = self.alb.add_listener(
                "Https", port=443, protocol=elbv2.ApplicationProtocol.HTTPS, certificates=[certificate],
                ssl_policy=elbv2.SslPolicy.RECOMMENDED_TLS, open=False, default_target_groups=[self.target_group])
            self.alb.add_redirect(source_port=80, target_port=443, open=False)
        else:
            self.listener = self.alb.add_listener(
                "Http", port=80, protocol=elbv2.ApplicationProtocol.HTTP, open=False,
                default_target_groups=[self.target_group])

        # --- autoscaling
        scaling = self.service.auto_scale_task_count(min_capacity=rc.replicas, max_capacity=rc.max_replicas)
        scaling.scale_on_cpu_utilization("Cpu", target_utilization_percent=60,
                                         scale_in_cooldown=Duration.minutes(5), scale_out_cooldown=Duration.minutes(1))
        scaling.scale_on_request_count("Requests", requests_per_target=200, target_group=self.target_group,
                                       scale_in_cooldown=Duration.minutes(5), scale_out_cooldown=Duration.minutes(1))
