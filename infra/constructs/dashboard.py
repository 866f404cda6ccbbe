"""Dashboard building blocks in the style of cdk-monitoring-constructs: metric factories (one per source)
and segments that turn them into rows of widgets. Names come from ``turnkv.metric_names``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from aws_cdk import Duration
from aws_cdk import aws_cloudwatch as cw

from turnkv import metric_names as mn

PERIOD = Duration.minutes(1)


class RouterLoadBalancerMetrics:
    """The ALB, target group and ECS service metrics the dashboard and alarms read, by the names the router stack
    publishes in SSM (``infra.stacks.router.ROUTER_OUTPUTS``; the observability stack resolves them at each of its
    deploys), so no CloudFormation export ties the two stacks: a replaced ALB or listener would make the router
    stack's update fail on an export another stack imports. Same metric names, statistics and dimensions as
    aws-cdk-lib's own ``metrics``."""

    def __init__(self, names: Mapping[str, str]) -> None:
        """``names``: ``infra.stacks.router.ROUTER_OUTPUTS``' keys -> their values (deploy-time tokens)."""
        self._alb = {"LoadBalancer": names["alb-full-name"]}
        self._targets = {**self._alb, "TargetGroup": names["target-group-full-name"]}
        self._service = {"ClusterName": names["cluster-name"], "ServiceName": names["service-name"]}

    @staticmethod
    def _metric(namespace: str, name: str, dims: dict[str, str], statistic: str,
                period: Duration | None = None) -> cw.Metric:
        return cw.Metric(namespace=namespace, metric_name=name, dimensions_map=dims, statistic=statistic,
                         period=period or Duration.minutes(5))

    def request_count(self, period: Duration | None = None) -> cw.Metric:
        return self._metric("AWS/ApplicationELB", "RequestCount", self._alb, "Sum", period)

    def elb_5xx(self, period: Duration | None = None) -> cw.Metric:
        return self._metric("AWS/ApplicationELB", "HTTPCode_ELB_5XX_Count", self._alb, "Sum", period)

    def target_5xx(self, period: Duration | None = None) -> cw.Metric:
        return self._metric("AWS/ApplicationELB", "HTTPCode_Target_5XX_Count", self._targets, "Sum", period)

    def healthy_host_count(self, period: Duration | None = None) -> cw.Metric:
        return self._metric("AWS/ApplicationELB", "HealthyHostCount", self._targets, "Average", period)

    def unhealthy_host_count(self, period: Duration | None = None) -> cw.Metric:
        return self._metric("AWS/ApplicationELB", "UnHealthyHostCount", self._targets, "Average", period)

    def service(self, name: str) -> cw.Metric:
        """``CPUUtilization`` or ``MemoryUtilization`` of the router service."""
        return self._metric("AWS/ECS", name, self._service, "Average")


@dataclass(frozen=True)
class RouterMetricFactory:
    """The router's EMF metrics (``turnkv/Router``)."""

    deployment: str

    def _search(self, metric: str, stat: str, dims: tuple[str, ...], label: str) -> cw.MathExpression:
        schema = ",".join((mn.ROUTER_NAMESPACE, mn.DEPLOYMENT, *dims))
        expression = (f"SEARCH('{{{schema}}} MetricName=\"{metric}\" {mn.DEPLOYMENT}=\"{self.deployment}\"', "
                      f"'{stat}', {int(PERIOD.to_seconds())})")
        return cw.MathExpression(expression=expression, label=label, period=PERIOD, using_metrics={})

    def metric(self, name: str, stat: str, label: str | None = None) -> cw.Metric:
        return cw.Metric(namespace=mn.ROUTER_NAMESPACE, metric_name=name,
                         dimensions_map={mn.DEPLOYMENT: self.deployment}, statistic=stat, period=PERIOD,
                         label=label or f"{name} {stat}")

    def registered_engines(self, role: str, stat: str = "Minimum") -> cw.Metric:
        """Engines of ``role`` registered in Cloud Map, as the routers' discovery sees them."""
        return cw.Metric(namespace=mn.ROUTER_NAMESPACE, metric_name=mn.REGISTERED_ENGINES,
                         dimensions_map={mn.DEPLOYMENT: self.deployment, mn.ROLE: role}, statistic=stat,
                         period=PERIOD, label=f"{role} engines registered")

    def ttft_by_outcome(self, stat: str) -> cw.MathExpression:
        return self._search(mn.TTFT, stat, (mn.REUSE_OUTCOME,), f"TTFT {stat}")

    def ttft_by_bucket(self, stat: str) -> cw.MathExpression:
        return self._search(mn.TTFT, stat, (mn.REUSE_OUTCOME, mn.PROMPT_BUCKET), f"TTFT {stat}")

    def requests_by_outcome(self) -> cw.MathExpression:
        return self._search(mn.REQUESTS, "Sum", (mn.REUSE_OUTCOME,), "requests")

    def by_tenant(self, name: str, stat: str, label: str) -> cw.MathExpression:
        return self._search(name, stat, (mn.TENANT,), label)

    def dollars_per_1k_turns(self, period: Duration = PERIOD) -> cw.MathExpression:
        """Dollars of prefill time reuse saved per 1,000 turns (router.savings): the saving priced at the prefill
        engine-hour, over every request (turns that saved nothing included)."""
        cost = cw.Metric(namespace=mn.ROUTER_NAMESPACE, metric_name=mn.PREFILL_COST_SAVED,
                         dimensions_map={mn.DEPLOYMENT: self.deployment}, statistic="Sum", period=period)
        turns = cw.Metric(namespace=mn.ROUTER_NAMESPACE, metric_name=mn.REQUESTS,
                          dimensions_map={mn.DEPLOYMENT: self.deployment}, statistic="Sum", period=period)
        return cw.MathExpression(expression="1000 * FILL(c, 0) / t", label="$ saved per 1k turns", period=period,
                                 using_metrics={"c": cost, "t": turns})


@dataclass(frozen=True)
class EngineMetricFactory:
    """Engine metrics from the node's EMF bridge (``turnkv/Engine``) and the agent's GPU/EFA metrics, per role."""

    deployment: str

    def engine(self, name: str, role: str, stat: str = "Average", label: str | None = None) -> cw.Metric:
        return cw.Metric(namespace=mn.ENGINE_NAMESPACE, metric_name=name, statistic=stat, period=PERIOD,
                         dimensions_map={mn.DEPLOYMENT: self.deployment, mn.ROLE: role},
                         label=label or f"{role} {name} {stat}")

    def agent(self, name: str, role: str, stat: str = "Average") -> cw.Metric:
        return cw.Metric(namespace=mn.AGENT_NAMESPACE, metric_name=name, statistic=stat, period=PERIOD,
                         dimensions_map={mn.DEPLOYMENT: self.deployment, mn.ROLE: role})


def _graph(title: str, left: list[cw.IMetric], *, width: int = 8, unit: str = "", right: list[cw.IMetric] | None = None,
           stacked: bool = False) -> cw.GraphWidget:
    return cw.GraphWidget(title=title, left=left, right=right or [], width=width, height=6, stacked=stacked,
                          left_y_axis=cw.YAxisProps(label=unit, show_units=False, min=0))


def router_segment(f: RouterMetricFactory) -> list[list[cw.IWidget]]:
    hit_rate = cw.MathExpression(expression="100 * h", label="reuse hit rate %", period=PERIOD,
                                 using_metrics={"h": f.metric(mn.REUSE_HIT, "Average")})
    return [
        [cw.TextWidget(markdown=f"## Router ({f.deployment}): time to first token and KV reuse", width=24, height=1)],
        [_graph("TTFT p50 by reuse outcome", [f.ttft_by_outcome("p50")], unit="ms"),
         _graph("TTFT p90 by reuse outcome", [f.ttft_by_outcome("p90")], unit="ms"),
         _graph("TTFT p99 by reuse outcome", [f.ttft_by_outcome("p99")], unit="ms")],
        [_graph("TTFT p50 by outcome and prompt length", [f.ttft_by_bucket("p50")], unit="ms"),
         _graph("TTFT p99 by outcome and prompt length", [f.ttft_by_bucket("p99")], unit="ms"),
         cw.SingleValueWidget(title="Reuse hit rate (1 h)", metrics=[hit_rate], width=8, height=6,
                              period=Duration.hours(1))],
        [_graph("Reuse hit rate", [hit_rate], unit="%"),
         _graph("Reused tokens", [f.metric(mn.REUSED_TOKENS, "Sum", "reused tokens")], unit="tokens"),
         _graph("Prefill leg time and prefill time saved",
                [f.metric(mn.PREFILL_TIME, "p50", "prefill leg p50"),
                 f.metric(mn.PREFILL_TIME, "p99", "prefill leg p99"),
                 f.metric(mn.PREFILL_TIME_SAVED, "Average", "prefill time saved (avg)")], unit="ms")],
        [_graph("Requests by reuse outcome", [f.requests_by_outcome()], stacked=True, unit="requests"),
         _graph("Router errors", [f.metric(mn.ERRORS, "Sum", "errors")], unit="errors")],
        savings_row(f),
    ]


def savings_row(f: RouterMetricFactory) -> list[cw.IWidget]:
    """What reuse saved, in money (router.savings): dollars per 1,000 turns at the prefill engine-hour price, and
    prefill time and dollars saved per tenant."""
    seconds = cw.MathExpression(expression="FILL(s, 0) / 1000", label="prefill seconds saved", period=PERIOD,
                                using_metrics={"s": f.metric(mn.PREFILL_TIME_SAVED, "Sum")})
    return [
        cw.SingleValueWidget(title="Reuse savings: $ per 1k turns (24 h)",
                             metrics=[f.dollars_per_1k_turns(Duration.hours(24))], width=6, height=6,
                             period=Duration.hours(24)),
        _graph("Reuse savings: $ per 1k turns", [f.dollars_per_1k_turns()], width=6, unit="$",
               right=[seconds]),
        _graph("Prefill time saved by tenant", [f.by_tenant(mn.PREFILL_TIME_SAVED, "Sum", "ms saved")], width=6,
               stacked=True, unit="ms"),
        _graph("Prefill $ saved by tenant", [f.by_tenant(mn.PREFILL_COST_SAVED, "Sum", "$ saved")], width=6,
               stacked=True, unit="$"),
    ]


def engine_segment(f: EngineMetricFactory, roles: tuple[str, ...], gpu: bool) -> list[list[cw.IWidget]]:
    rows: list[list[cw.IWidget]] = [
        [cw.TextWidget(markdown="## Engines: vLLM, NIXL, accelerators, EFA", width=24, height=1)]]
    def pair(mean: str, p99: str, r: str) -> list[cw.IMetric]:
        return [f.engine(mean, r, "Average", f"{r} mean"), f.engine(p99, r, "Maximum", f"{r} p99 (worst engine)")]

    rows.append([
        _graph("Engine TTFT", [m for r in roles for m in pair(mn.ENGINE_TTFT, mn.ENGINE_TTFT_P99, r)], unit="ms"),
        _graph("Inter-token latency", [m for r in roles for m in pair(mn.ENGINE_ITL, mn.ENGINE_ITL_P99, r)],
               unit="ms"),
        _graph("KV cache usage", [f.engine(mn.KV_CACHE_USAGE, r, "Maximum") for r in roles], unit="%"),
    ])
    rows.append([
        _graph("NIXL transfer time",
               [m for r in roles for m in pair(mn.NIXL_XFER_TIME, mn.NIXL_XFER_TIME_P99, r)], unit="ms",
               right=[f.engine(mn.NIXL_EXPIRED, r, "Sum", f"{r} expired reads") for r in roles]),
        _graph("NIXL bytes transferred", [f.engine(mn.NIXL_BYTES, r, "Sum") for r in roles], unit="bytes"),
        _graph("Requests running / waiting",
               [f.engine(mn.REQUESTS_RUNNING, r) for r in roles] + [f.engine(mn.REQUESTS_WAITING, r) for r in roles]),
    ])
    rows.append(retention_row(f))
    accel = ([_graph("GPU utilization", [f.agent(mn.GPU_UTIL, r) for r in roles], unit="%")] if gpu else [])
    rows.append([
        *accel,
        _graph("EFA RDMA bytes", [f.agent(mn.EFA_RDMA_READ_BYTES, r, "Sum") for r in roles]
               + [f.agent(mn.EFA_RDMA_WRITE_BYTES, r, "Sum") for r in roles], unit="bytes"),
        _graph("EFA retransmits / unresponsive remotes", [f.agent(mn.EFA_RETRANS_PKTS, r, "Sum") for r in roles]
               + [f.agent(mn.EFA_UNRESPONSIVE, r, "Sum") for r in roles]),
    ])
    return rows


def retention_row(f: EngineMetricFactory) -> list[cw.IWidget]:
    """Decode's retention tiers (connector.retention): where reuse came from, what each tier holds, and what was
    moved, refused or evicted, by reason."""
    return [
        _graph("Reuse by tier (prefill pulls)", [f.engine(mn.pulls(t), "prefill", "Sum", f"pulled from {t}")
                                                 for t in mn.TIERS], stacked=True, unit="pulls"),
        _graph("Retained KV by tier", [f.engine(mn.RETAINED_BYTES, "decode", "Maximum", "both tiers"),
                                       f.engine(mn.HOST_RETAINED_BYTES, "decode", "Maximum", "host tier"),
                                       f.engine(mn.HOST_POOL_BYTES, "decode", "Maximum", "host pool size")],
               unit="bytes", right=[f.engine(mn.HOST_MOVES, "decode", "Sum", "moved device -> host")]),
        _graph("Retention refusals and evictions by reason",
               [f.engine(mn.refused(r), "decode", "Sum", f"refused: {r}") for r in mn.REFUSAL_REASONS]
               + [f.engine(mn.evicted(r), "decode", "Sum", f"evicted: {r}") for r in mn.EVICTION_REASONS],
               unit="turns"),
    ]
