"""Observability: the CloudWatch dashboard (router TTFT by reuse outcome and prompt length, reuse, KV pull
time, engines, GPUs, EFA, ALB) and alarms to an SNS topic."""

from __future__ import annotations

from aws_cdk import Duration, RemovalPolicy, Stack
from aws_cdk import aws_cloudwatch as cw
from aws_cdk import aws_cloudwatch_actions as cw_actions
from aws_cdk import aws_elasticloadbalancingv2 as elbv2
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_sns as sns
from aws_cdk import aws_sns_subscriptions as subscriptions
from constructs import Construct

from infra.config import DeploymentConfig
from infra.constructs.dashboard import EngineMetricFactory, RouterMetricFactory, engine_segment, router_segment
from infra.instances import INSTANCE_TYPES, Flavor
from infra.stacks.router import RouterStack
from infra.stacks.serving import ServingStack
from turnkv import metric_names as mn

#: Alarm thresholds (router p99 TTFT in ms, 5xx per minute, engine KV cache usage in percent).
TTFT_P99_MS = 10_000
ALB_5XX_PER_MIN = 10
KV_USAGE_MAX_PERCENT = 95


class ObservabilityStack(Stack):
    def __init__(self, scope: Construct, construct_id: str, *, config: DeploymentConfig, serving: ServingStack,
                 router: RouterStack, **kwargs) -> None:
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
        alb = router.alb.metrics
        tg = router.target_group.metrics

        rows = router_segment(rf) + engine_segment(ef, roles, gpu)
        rows.append([cw.TextWidget(markdown="## Load balancer and router tasks", width=24, height=1)])
        rows.append([
            cw.GraphWidget(title="ALB requests and 5xx", width=8, height=6,
                           left=[alb.request_count(period=Duration.minutes(1))],
                           right=[alb.http_code_elb(code=elbv2.HttpCodeElb.ELB_5XX_COUNT, period=Duration.minutes(1)),
                                  tg.http_code_target(
                                      code=elbv2.HttpCodeTarget.TARGET_5XX_COUNT, period=Duration.minutes(1))]),
            cw.GraphWidget(title="Healthy / unhealthy router tasks", width=8, height=6,
                           left=[tg.healthy_host_count(), tg.unhealthy_host_count()]),
            cw.GraphWidget(title="Router CPU / memory", width=8, height=6,
                           left=[router.service.metric_cpu_utilization(), router.service.metric_memory_utilization()]),
        ])
        # Engines that serve, next to what the pools hold: what EnginesNotRegistered-<role> alarms on.
        wanted = {role: sum(p.count for p in config.pools if p.role.value == role) for role in roles}
        rows.append([cw.GraphWidget(
            title="Engines registered in Cloud Map (lines: what the pools hold)", width=24, height=6,
            left=[rf.registered_engines(role) for role in roles],
            left_annotations=[cw.HorizontalAnnotation(value=want, label=f"{role} pools: {want}")
                              for role, want in wanted.items()])])
        self.dashboard = cw.Dashboard(self, "Dashboard", dashboard_name=config.prefix, widgets=rows,
                                      default_interval=Duration.hours(3))

        self.alarms: list[cw.Alarm] = []

        def alarm(alarm_id: str, metric: cw.IMetric, threshold: float, description: str, periods: int = 5,
                  comparison: cw.ComparisonOperator = cw.ComparisonOperator.GREATER_THAN_THRESHOLD) -> None:
            a = cw.Alarm(self, alarm_id, metric=metric, threshold=threshold, evaluation_periods=periods,
                         datapoints_to_alarm=max(1, periods - 2), comparison_operator=comparison,
                         treat_missing_data=cw.TreatMissingData.NOT_BREACHING,
                         alarm_name=f"{config.prefix}-{alarm_id}", alarm_description=description)
            a.add_alarm_action(action)
            a.add_ok_action(action)
            self.alarms.append(a)

        alarm("RouterTtftP99", rf.metric(mn.TTFT, "p99"), TTFT_P99_MS,
              f"Router p99 time to first token above {TTFT_P99_MS} ms for 3 of 5 minutes")
        alarm("RouterErrors", rf.metric(mn.ERRORS, "Sum"), ALB_5XX_PER_MIN,
              f"More than {ALB_5XX_PER_MIN} router errors a minute")
        alarm("Alb5xx", tg.http_code_target(
            code=elbv2.HttpCodeTarget.TARGET_5XX_COUNT,
            period=Duration.minutes(1), statistic="Sum"), ALB_5XX_PER_MIN,
            f"More than {ALB_5XX_PER_MIN} 5xx a minute from the router tasks")
        alarm("RouterUnhealthy", tg.unhealthy_host_count(period=Duration.minutes(1)), 0,
              "A router task fails its /health check")
        for role in roles:
            alarm(f"KvCacheFull-{role}", ef.engine(mn.KV_CACHE_USAGE, role, "Maximum"), KV_USAGE_MAX_PERCENT,
                  f"{role} engines' KV cache above {KV_USAGE_MAX_PERCENT}%: retained blocks crowd out new requests "
                  f"(lower decoder_kv_blocks_ttl or add decode capacity)", periods=10)
            alarm(f"EfaUnresponsive-{role}", ef.agent(mn.EFA_UNRESPONSIVE, role, "Sum"), 0,
                  f"{role} engines report unresponsive EFA peers (security group, placement or a failing node)",
                  periods=3)
        for role in roles:
            # What the group's EC2 health check cannot see: instances that run but whose engines never serve
            # (an engine registers in Cloud Map only once its /health answers). Missing data: no router reports.
            want = wanted[role]
            alarm(f"EnginesNotRegistered-{role}", rf.registered_engines(role), want,
                  f"Fewer {role} engines registered in Cloud Map than the {want} its pools hold (an engine that "
                  "does not serve; the node marks itself unhealthy and is replaced)",
                  periods=6, comparison=cw.ComparisonOperator.LESS_THAN_THRESHOLD)
        for name, pool in serving.pools.items():
            alarm(f"PoolBelowDesired-{name}", cw.Metric(
                namespace="AWS/AutoScaling", metric_name="GroupInServiceInstances", statistic="Minimum",
                period=Duration.minutes(5), dimensions_map={"AutoScalingGroupName": pool.group_name}),
                pool.pool.count, f"Pool {name} has fewer in-service engines than {pool.pool.count} "
                                 "(capacity, EFA or boot failure)",
                periods=3, comparison=cw.ComparisonOperator.LESS_THAN_THRESHOLD)
