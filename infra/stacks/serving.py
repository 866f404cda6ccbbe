"""Serving: the engine pools on EFA. Cluster placement group, the EFA security group (all traffic to and
from itself), one EFA launch template + Auto Scaling group per pool, a least-privilege instance role,
user data (``infra.bootstrap``), Cloud Map registration and deregistration on termination."""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping

from aws_cdk import ArnFormat, Duration, RemovalPolicy, Stack
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_logs as logs
from aws_cdk import aws_secretsmanager as secretsmanager
from aws_cdk import aws_servicediscovery as servicediscovery
from aws_cdk import aws_sns as sns
from aws_cdk import aws_sns_subscriptions as subscriptions
from constructs import Construct

from infra import bootstrap, roll
from infra.config import DeploymentConfig
from infra.constructs.engine_group import EngineGroup, EngineGroupProps, group_logical_id, group_name
from infra.instances import INSTANCE_TYPES
from infra.lambdas import DEREGISTER
from infra.stacks.network import NetworkStack, https_egress
from infra.stacks.params import LAMBDA_RUNTIME, parameter_arn
from turnkv import metric_names as mn
from turnkv import node_env

CLOUDMAP_SERVICE = "engines"
#: EventBridge detail types of EC2's Capacity Block expiration warning (the user guide spells it both ways).
CAPACITY_BLOCK_WARNINGS = ("Capacity Block Expiration Warning", "Capacity Block Reservation Expiration Warning")


class ServingStack(Stack):
    def __init__(self, scope: Construct, construct_id: str, *, config: DeploymentConfig, network: NetworkStack,
                 images: Mapping[str, ec2.IMachineImage], **kwargs) -> None:
        super().__init__(scope, construct_id, **kwargs)
        self.config = config
        vpc = network.vpc
        subnet = network.engine_subnet()

        # The deployment's cluster placement group, for the pools that launch into it (no reservation: a reserved
        # pool launches into the group its reservation was made in, or into none; infra.constructs.engine_group).
        self.placement_group: ec2.PlacementGroup | None = None
        if any(p.joins_deployment_placement_group for p in config.pools):
            self.placement_group = ec2.PlacementGroup(
                self, "PlacementGroup", strategy=ec2.PlacementGroupStrategy.CLUSTER,
                placement_group_name=f"{config.prefix}-engines")

        self.security_group = ec2.SecurityGroup(
            self, "EfaSecurityGroup", vpc=vpc, allow_all_outbound=False,
            description="turnkv engines: EFA (all traffic to and from itself), HTTPS out to AWS APIs")
        self.security_group.add_ingress_rule(self.security_group, ec2.Port.all_traffic(), "EFA and NIXL: itself")
        self.security_group.add_egress_rule(self.security_group, ec2.Port.all_traffic(), "EFA and NIXL: itself")
        https_egress(self.security_group, network, "AWS APIs, weights, model hubs via NAT")

        self.namespace = servicediscovery.HttpNamespace(
            self, "Namespace", name=config.prefix, description=f"turnkv {config.name} engines")
        self.cloudmap_service = self.namespace.create_service(
            "Engines", name=CLOUDMAP_SERVICE,
            description="vLLM engines; attributes: role, engine_id, side_channel_host, side_channel_port, "
                        "tp_size, http_port")

        key = kms.Key(self, "TopicKey", enable_key_rotation=True, removal_policy=RemovalPolicy.DESTROY,
                      description=f"turnkv {config.name} engine notifications")
        # Auto Scaling publishes through its service-linked role, which may not exist yet in a fresh account:
        # allow this account's principals to use the key only via SNS in this region.
        key.add_to_resource_policy(iam.PolicyStatement(
            sid="PublishViaSns", principals=[iam.AnyPrincipal()],
            actions=["kms:GenerateDataKey*", "kms:Decrypt"], resources=["*"],
            conditions={"StringEquals": {"kms:CallerAccount": self.account,
                                         "kms:ViaService": f"sns.{self.region}.amazonaws.com"}}))
        self.events_topic = sns.Topic(self, "EngineEvents", master_key=key, enforce_ssl=True,
                                      display_name=f"turnkv {config.name} engine pool events")
        if config.alarm_email:
            self.events_topic.add_subscription(subscriptions.EmailSubscription(config.alarm_email))
        self._capacity_block_warnings(key)

        self.log_group_name = bootstrap.engine_log_group(config)
        self.log_group = logs.LogGroup(self, "EngineLogs", log_group_name=self.log_group_name,
                                       retention=logs.RetentionDays.ONE_MONTH, removal_policy=RemovalPolicy.DESTROY)
        # The deployment's offer secret: decode engines sign the KV offers they return with it and prefill
        # engines read only offers it verifies (turnkv.wire). Every engine writes it to its offer-secret file
        # before the engine starts; without it offers are unsigned and every turn is recomputed.
        self.offer_secret = secretsmanager.Secret(
            self, "OfferSecret", secret_name=f"{config.prefix}/engine-offer-secret",
            description="turnkv KV offer signing key (HMAC): engines sign and verify, the router clears replays",
            generate_secret_string=secretsmanager.SecretStringGenerator(
                exclude_punctuation=True, password_length=64),
            removal_policy=RemovalPolicy.DESTROY)
        self.role = self._instance_role()

        self.pools: dict[str, EngineGroup] = {}
        #: Engines each pool's instances run (``DeploymentConfig.engines_per_node``), and the HTTP ports the router
        #: reaches on the engines (``node_env.http_ports``: one per engine a node runs).
        self.engines_per_node = {pool.name: config.engines_per_node(pool) for pool in config.pools}
        self.http_ports = node_env.http_ports(max(self.engines_per_node.values(), default=1))
        for pool in config.pools:
            profile = INSTANCE_TYPES[pool.instance_type]
            script = bootstrap.checked_user_data(bootstrap.pool_bootstrap(
                config, pool, cloudmap_service_id=self.cloudmap_service.service_id,
                log_group=self.log_group.log_group_name, signal_stack=self.stack_name,
                signal_resource=group_logical_id(pool.name), offer_secret_id=self.offer_secret.secret_arn),
                stand_ins=self._user_data_stand_ins())
            self.pools[pool.name] = EngineGroup(self, f"Pool-{pool.name}", EngineGroupProps(
                pool=pool, deployment_prefix=config.prefix, vpc=vpc, subnet=subnet,
                machine_image=images[profile.flavor.value], user_data=ec2.UserData.custom(script), role=self.role,
                security_group=self.security_group, placement_group=self.placement_group,
                notifications_topic=self.events_topic))
        self._roll_one_group_at_a_time()
        self._deregistration()

    def _roll_one_group_at_a_time(self) -> None:
        """Each group after the one before it in ``infra.roll.roll_order`` (prefill pools, then decode pools): a
        resource that depends on another is updated only after that one's update completed, its rolling update
        included; without the chain CloudFormation rolls the groups in parallel and a role of one-node pools
        is empty while they boot."""
        ordered = [self.pools[p.name].group for p in roll.roll_order(self.config.pools)]
        for before, after in itertools.pairwise(ordered):
            after.node.default_child.add_dependency(before.node.default_child)  # type: ignore[union-attr]

    def _capacity_block_warnings(self, key: kms.Key) -> None:
        """A Capacity Block ends on its date: EC2 sends an EventBridge event 40 minutes before, and starts
        terminating its instances 10 minutes later (EC2 user guide, "Monitor Capacity Blocks using EventBridge").
        The warning goes to the engine events topic (alarm_email), naming the reservation, so the pool can be moved
        (a new block id, or a reservation) before it empties."""
        blocks = sorted({p.capacity_reservation_id for p in self.config.pools
                         if p.capacity_block and p.capacity_reservation_id})
        if not blocks:
            return
        key.grant(iam.ServicePrincipal("events.amazonaws.com"), "kms:GenerateDataKey*", "kms:Decrypt")
        events.Rule(
            self, "CapacityBlockExpiring",
            description="turnkv: a Capacity Block of an engine pool ends in 40 minutes",
            event_pattern=events.EventPattern(
                source=["aws.ec2"], detail_type=list(CAPACITY_BLOCK_WARNINGS),
                detail={"capacity-reservation-id": blocks}),
            targets=[targets.SnsTopic(self.events_topic)])

    def _user_data_stand_ins(self) -> dict[str, str]:
        """The longest values the user data's deploy-time tokens take (``bootstrap.deploy_time_stand_ins``)."""
        return bootstrap.deploy_time_stand_ins(self.config)

    def model_token_arn(self, secret: str) -> str:
        """The gated model's token secret as an IAM resource: an ARN as given; a name as the ARN Secrets Manager
        gives it (the name, then ``-`` and six random characters, matched by ``??????``)."""
        if secret.startswith("arn:"):
            return secret
        return self.format_arn(service="secretsmanager", resource="secret", resource_name=f"{secret}-??????",
                               arn_format=ArnFormat.COLON_RESOURCE_NAME)

    def _instance_role(self) -> iam.Role:
        config = self.config
        role = iam.Role(self, "EngineRole", assumed_by=iam.ServicePrincipal("ec2.amazonaws.com"),
                        description="turnkv engine node: read tunables, register in Cloud Map, publish metrics")
        role.add_to_policy(iam.PolicyStatement(
            sid="ReadTunables", actions=["ssm:GetParametersByPath", "ssm:GetParameters", "ssm:GetParameter"],
            resources=[parameter_arn(self, config.name, "*"),
                       self.format_arn(service="ssm", resource="parameter",
                                       resource_name=f"turnkv/{config.name}")]))
        role.add_to_policy(iam.PolicyStatement(
            sid="CloudMap", actions=["servicediscovery:RegisterInstance", "servicediscovery:DeregisterInstance"],
            resources=[self.cloudmap_service.service_arn]))
        role.add_to_policy(iam.PolicyStatement(
            sid="SignalRollingUpdate", actions=["cloudformation:SignalResource"],
            resources=[self.format_arn(service="cloudformation", resource="stack",
                                       resource_name=f"{self.stack_name}/*")]))
        role.add_to_policy(iam.PolicyStatement(
            sid="MarkUnhealthy", actions=["autoscaling:SetInstanceHealth"],
            resources=[self.format_arn(service="autoscaling", resource="autoScalingGroup",
                                       resource_name=f"*:autoScalingGroupName/{group_name(config.prefix, p.name)}")
                       for p in config.pools]))
        role.add_to_policy(iam.PolicyStatement(
            sid="CompleteDrain", actions=["autoscaling:CompleteLifecycleAction"],
            resources=[self.format_arn(service="autoscaling", resource="autoScalingGroup",
                                       resource_name=f"*:autoScalingGroupName/{group_name(config.prefix, p.name)}")
                       for p in config.pools]))
        role.add_to_policy(iam.PolicyStatement(
            sid="ReadOfferSecret", actions=["secretsmanager:GetSecretValue"],
            resources=[self.offer_secret.secret_arn]))
        if config.model.hf_token_secret:
            role.add_to_policy(iam.PolicyStatement(
                sid="ReadModelToken", actions=["secretsmanager:GetSecretValue"],
                resources=[self.model_token_arn(config.model.hf_token_secret)]))
        role.add_to_policy(iam.PolicyStatement(
            sid="PublishMetrics", actions=["cloudwatch:PutMetricData"], resources=["*"],
            conditions={"StringEquals": {"cloudwatch:namespace": [mn.AGENT_NAMESPACE, mn.ENGINE_NAMESPACE]}}))
        role.add_to_policy(iam.PolicyStatement(
            sid="AgentDescribe", actions=["ec2:DescribeTags", "ec2:DescribeVolumes"], resources=["*"]))
        role.add_to_policy(iam.PolicyStatement(
            sid="Logs", actions=["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams",
                                 "logs:PutRetentionPolicy"],
            resources=[self.log_group.log_group_arn, f"{self.log_group.log_group_arn}:*"]))
        role.add_to_policy(iam.PolicyStatement(
            sid="SessionManager",
            actions=["ssm:UpdateInstanceInformation", "ssmmessages:CreateControlChannel",
                     "ssmmessages:CreateDataChannel", "ssmmessages:OpenControlChannel",
                     "ssmmessages:OpenDataChannel", "ec2messages:AcknowledgeMessage", "ec2messages:DeleteMessage",
                     "ec2messages:FailMessage", "ec2messages:GetEndpoint", "ec2messages:GetMessages",
                     "ec2messages:SendReply"],
            resources=["*"]))
        if config.model.s3_uri:
            bucket, _, prefix = config.model.s3_uri[len("s3://"):].partition("/")
            role.add_to_policy(iam.PolicyStatement(
                sid="ReadWeights", actions=["s3:GetObject"],
                resources=[f"arn:{self.partition}:s3:::{bucket}/{prefix}*"]))
            role.add_to_policy(iam.PolicyStatement(
                sid="ListWeights", actions=["s3:ListBucket"], resources=[f"arn:{self.partition}:s3:::{bucket}"],
                conditions={"StringLike": {"s3:prefix": [f"{prefix}*"]}}))
        return role

    def _deregistration(self) -> None:
        """ASG terminate lifecycle hook -> EventBridge -> Lambda: deregister from Cloud Map at once (even from a node
        that cannot answer). The node's drain agent completes the action once its streams finished; the hook's
        timeout continues it otherwise (``infra.roll``)."""
        config = self.config
        log_group = logs.LogGroup(self, "DeregisterLogs", retention=logs.RetentionDays.ONE_MONTH,
                                  removal_policy=RemovalPolicy.DESTROY)
        role = iam.Role(self, "DeregisterRole", assumed_by=iam.ServicePrincipal("lambda.amazonaws.com"))
        role.add_to_policy(iam.PolicyStatement(
            actions=["servicediscovery:DeregisterInstance"], resources=[self.cloudmap_service.service_arn]))
        role.add_to_policy(iam.PolicyStatement(
            actions=["logs:CreateLogStream", "logs:PutLogEvents"], resources=[f"{log_group.log_group_arn}:*"]))
        self.deregister_function = lambda_.Function(
            self, "Deregister", runtime=LAMBDA_RUNTIME, handler="index.handler",
            code=lambda_.Code.from_inline(DEREGISTER.read_text()), role=role, timeout=Duration.seconds(30),
            log_group=log_group,
            # ENGINES_PER_NODE: each of a node's engines is its own Cloud Map instance; the Lambda takes them all out.
            environment={"SERVICE_ID": self.cloudmap_service.service_id,
                         "ENGINES_PER_NODE": json.dumps({p.group_name: self.engines_per_node[name]
                                                         for name, p in self.pools.items()}, sort_keys=True)},
            description=f"turnkv {config.name}: deregister terminating engines from Cloud Map")
        events.Rule(
            self, "TerminateRule",
            description="turnkv engine terminate lifecycle action",
            event_pattern=events.EventPattern(
                source=["aws.autoscaling"], detail_type=["EC2 Instance-terminate Lifecycle Action"],
                detail={"AutoScalingGroupName": [p.group_name for p in self.pools.values()]}),
            targets=[targets.LambdaFunction(self.deregister_function, retry_attempts=4)])
