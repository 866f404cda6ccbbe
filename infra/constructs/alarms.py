"""The deployment's alarms, each notifying one action (the observability stack's SNS topic) on alarm and on OK.
Thresholds come from the config (``alarms``: ``infra.config.AlarmsConfig``). Scope-preserving
(``infra.constructs``): alarm ``X`` is named ``<prefix>-X`` and keeps the logical id it had when the stack made
it inline."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from aws_cdk import Duration
from aws_cdk import aws_cloudwatch as cw
from constructs import Construct

from infra.config import AlarmsConfig
from infra.constructs.dashboard import EngineMetricFactory, RouterLoadBalancerMetrics, RouterMetricFactory
from turnkv import metric_names as mn


@dataclass(frozen=True)
class PoolSize:
    """An engine pool as its alarm sees it: its Auto Scaling group and the engines it holds."""

    group_name: str
    count: int


@dataclass(frozen=True)
class AlarmsProps:
    #: Alarm-name prefix (DeploymentConfig.prefix).
    prefix: str
    thresholds: AlarmsConfig
    action: cw.IAlarmAction
    router_metrics: RouterMetricFactory
    engine_metrics: EngineMetricFactory
    #: The router's target group (5xx, unhealthy tasks), by the names the router stack publishes.
    targets: RouterLoadBalancerMetrics
    #: Engine roles in the deployment (sorted) and how many engines each role's pools hold.
    wanted: Mapping[str, int]
    #: Pool name -> its size, for PoolBelowDesired-<pool>.
    pools: Mapping[str, PoolSize]


class DeploymentAlarms:
    """``alarms``: router TTFT and errors, ALB 5xx, unhealthy router tasks, and per role KV cache full, EFA
    unresponsive peers and engines not registered, decode's host tier short of its budget, and per pool fewer
    in-service instances than its size."""

    def __init__(self, scope: Construct, props: AlarmsProps) -> None:
        self._scope, self._props = scope, props
        self.alarms: list[cw.Alarm] = []
        t, rf, ef, tg = props.thresholds, props.router_metrics, props.engine_metrics, props.targets
        self._alarm("RouterTtftP99", rf.metric(mn.TTFT, "p99"), t.ttft_p99_ms,
                    f"Router p99 time to first token above {t.ttft_p99_ms} ms for 3 of 5 minutes")
        self._alarm("RouterErrors", rf.metric(mn.ERRORS, "Sum"), t.errors_per_minute,
                    f"More than {t.errors_per_minute} router errors a minute")
        self._alarm("Alb5xx", tg.target_5xx(period=Duration.minutes(1)), t.errors_per_minute,
            f"More than {t.errors_per_minute} 5xx a minute from the router tasks")
        self._alarm("RouterUnhealthy", tg.unhealthy_host_count(period=Duration.minutes(1)), 0,
                    "A router task fails its /health check")
        for role in props.wanted:
            self._alarm(f"KvCacheFull-{role}", ef.engine(mn.KV_CACHE_USAGE, role, "Maximum"),
                        t.kv_cache_usage_percent,
                        f"{role} engines' KV cache above {t.kv_cache_usage_percent}%: retained blocks crowd out new "
                        f"requests (lower decoder_kv_blocks_ttl or add decode capacity)", periods=10)
            self._alarm(f"EfaUnresponsive-{role}", ef.agent(mn.EFA_UNRESPONSIVE, role, "Sum"), 0,
                        f"{role} engines report unresponsive EFA peers for 5 minutes in a row (security group, "
                        "placement or a failing node; a peer replaced in a rolling update shows for a minute or two)",
                        periods=5, datapoints=5)
        if "decode" in props.wanted:
            # A decode engine that pinned less host tier than configured (the node refused the registration plan
            # and the pool shrank) or none (the tier is off): it serves, retaining fewer turns (connector.host_tier).
            short = cw.MathExpression(
                expression="configured - granted", label="decode host tier short of its budget (bytes)",
                period=Duration.minutes(1),
                using_metrics={"configured": ef.engine(mn.HOST_TIER_CONFIGURED_BYTES, "decode", "Maximum"),
                               "granted": ef.engine(mn.HOST_TIER_GRANTED_BYTES, "decode", "Minimum")})
            self._alarm("HostTierShort-decode", short, 0,
                        "A decode engine registered less host tier than host_kv_budget_mib asks (or none): the node "
                        "refused the registration plan (EFA page or region limits, locked-memory limit, hugepages). "
                        "See the engine log's 'turnkv: host tier' lines and `turnkv doctor`.", periods=3, datapoints=3)
        for role, want in props.wanted.items():
            # What the group's EC2 health check cannot see: instances that run but whose engines never serve
            # (an engine registers in Cloud Map only once its /health answers). Missing data: no router reports.
            self._alarm(f"EnginesNotRegistered-{role}", rf.registered_engines(role), want,
                        f"Fewer {role} engines registered in Cloud Map than the {want} its pools hold (an engine "
                        "that does not serve; the node marks itself unhealthy and is replaced)",
                        periods=6, comparison=cw.ComparisonOperator.LESS_THAN_THRESHOLD)
        for name, pool in props.pools.items():
            self._alarm(f"PoolBelowDesired-{name}", cw.Metric(
                namespace="AWS/AutoScaling", metric_name="GroupInServiceInstances", statistic="Minimum",
                period=Duration.minutes(5), dimensions_map={"AutoScalingGroupName": pool.group_name}),
                pool.count, f"Pool {name} has fewer in-service engines than {pool.count} "
                            "for 15 minutes (capacity, EFA or boot failure; one node being replaced is back sooner)",
                periods=3, datapoints=3, comparison=cw.ComparisonOperator.LESS_THAN_THRESHOLD)

    def _alarm(self, alarm_id: str, metric: cw.IMetric, threshold: float, description: str, periods: int = 5,
               comparison: cw.ComparisonOperator = cw.ComparisonOperator.GREATER_THAN_THRESHOLD,
               datapoints: int | None = None) -> None:
        """``datapoints`` of ``periods`` breaching (default: all but two). Short windows name it: with 3 periods the
        default would be 1 of 3, an alarm on any single datapoint."""
        a = cw.Alarm(self._scope, alarm_id, metric=metric, threshold=threshold, evaluation_periods=periods,
                     datapoints_to_alarm=datapoints or max(1, periods - 2), comparison_operator=comparison,
                     treat_missing_data=cw.TreatMissingData.NOT_BREACHING,
                     alarm_name=f"{self._props.prefix}-{alarm_id}", alarm_description=description)
        a.add_alarm_action(self._props.action)
        a.add_ok_action(self._props.action)
        self.alarms.append(a)
