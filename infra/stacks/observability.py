"""Observability: the CloudWatch dashboard (router TTFT by reuse outcome and prompt length, reuse, KV pull
time, engines, GPUs, EFA, ALB) and alarms to an SNS topic."""

from __future__ import annotations

from aws_cdk import Duration, RemovalPolicy, Stack
from aws_cdk import aws_cloudwatch as cw
from aws_cdk import aws_cloudwatch_actions as cw_actions
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_sns as sns
from aws_cdk import aws_sns_subscriptions as subscriptions
from aws_cdk import aws_ssm as ssm
from constructs import Construct

from infra.config import DeploymentConfig
from infra.constructs.alarms import AlarmsProps, DeploymentAlarms, PoolSize
from infra.constructs.dashboard import (
    EngineMetricFactory,
    RouterLoadBalancerMetrics,
    RouterMetricFactory,
    engine_segment,
    router_segment,
)
from infra.instances import INSTANCE_TYPES, Flavor
from infra.stacks.router import ROUTER_OUTPUTS
from infra.stacks.serving import ServingStack


class ObservabilityStack(Stack):
    def __init__(self, scope: Construct, construct_id: str, *, config: DeploymentConfig, serving: ServingStack,
                 **kwargs) -> None:
        super().__init__(scope, construct_id, **kwargs)
        key = kms.Key(self, "AlarmTopicKey", enable_key_rotation=True, removal_policy=RemovalPolicy.DESTROY,
                      description=f"turnkv {config.name} alarms")
        key.grant_encrypt_decrypt(iam.ServicePrincipal("cloudwatch.amazonaws.com"))
        self.topic = sns.Topic(self, "Alarms", master_key=key, enforce_ssl=True,
                               display_name=f"turnkv {config.name} alarms")
        if config.alarm_email:
            self.topic.add_subscription(subscriptions.EmailSubscription(config.alarm_email))
        action = cw_actions.SnsAction(self.topic)

        roles = tuple(sorted({p.role.value for p in config.pools}))
        gpu = any(INSTANCE_TYPES[p.instance_type].flavor is Flavor.GPU for p in config.pools)
        rf = RouterMetricFactory(config.name)
        ef = EngineMetricFactory(config.name)
        alb = tg = RouterLoadBalancerMetrics({key: ssm.StringParameter.value_for_string_parameter(
            self, config.stack_output_parameter("router", key)) for key in ROUTER_OUTPUTS})

        rows = router_segment(rf) + engine_segment(ef, roles, gpu)
        rows.append([cw.TextWidget(markdown="## Load balancer and router tasks", width=24, height=1)])
        rows.append([
            cw.GraphWidget(title="ALB requests and 5xx", width=8, height=6,
                           left=[alb.request_count(period=Duration.minutes(1))],
                           right=[alb.elb_5xx(period=Duration.minutes(1)), tg.target_5xx(period=Duration.minutes(1))]),
            cw.GraphWidget(title="Healthy / unhealthy router tasks", width=8, height=6,
                           left=[tg.healthy_host_count(), tg.unhealthy_host_count()]),
            cw.GraphWidget(title="Router CPU / memory", width=8, height=6,
                           left=[alb.service("CPUUtilization"), alb.service("MemoryUtilization")]),
        ])
        # Engines that serve, next to what the pools hold: what EnginesNotRegistered-<role> alarms on.
        # Each instance runs engines_per_node engines, each registered on its own.
        wanted = {role: sum(p.count * config.engines_per_node(p) for p in config.pools if p.role.value == role)
                  for role in roles}
        rows.append([cw.GraphWidget(
            title="Engines registered in Cloud Map (lines: what the pools hold)", width=24, height=6,
            left=[rf.registered_engines(role) for role in roles],
            left_annotations=[cw.HorizontalAnnotation(value=want, label=f"{role} pools: {want}")
                              for role, want in wanted.items()])])
        self.dashboard = cw.Dashboard(self, "Dashboard", dashboard_name=config.prefix, widgets=rows,
                                      default_interval=Duration.hours(3))

        # Thresholds: the config's ``alarms`` section (infra.config.AlarmsConfig).
        self.alarms: list[cw.Alarm] = DeploymentAlarms(self, AlarmsProps(
            prefix=config.prefix, thresholds=config.alarms, action=action, router_metrics=rf, engine_metrics=ef,
            targets=tg, wanted=wanted,
            pools={name: PoolSize(pool.group_name, pool.pool.count) for name, pool in serving.pools.items()})).alarms
