"""Prometheus metrics of the router (``/metrics``), named after Prometheus conventions."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: Why a request did or did not reuse the previous turn's KV.
OUTCOMES = ("hit", "miss", "mismatch", "token_mismatch", "disabled", "store_error", "none")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30, 60)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("turnkv_router_requests", "Requests by route and HTTP status.",
                                ["route", "status"], registry=r)
        self.ttft = Histogram("turnkv_router_time_to_first_token_seconds",
                              "Router-side time to first token, by reuse outcome.", ["reuse"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.reuse = Counter("turnkv_router_reuse_decisions", "Reuse decisions by outcome.", ["reuse"], registry=r)
        self.reused_tokens = Counter("turnkv_router_reused_tokens", "Prompt tokens pulled from decode's KV.",
                                     registry=r)
        self.leg = Histogram("turnkv_router_leg_seconds", "Latency of the prefill leg and decode's first byte.",
                             ["leg"], buckets=_LATENCY_BUCKETS, registry=r)
        self.token_mismatches = Counter("turnkv_router_token_mismatches",
                                        "Reuse cut short by prefill's token proof, by cause.", ["cause"], registry=r)
        self.engine_errors = Counter("turnkv_router_engine_errors", "Engine failures by role and kind.",
                                     ["role", "kind"], registry=r)
        self.engine_healthy = Gauge("turnkv_router_engine_healthy", "1 when the engine passes health checks.",
                                    ["role", "engine"], registry=r)
        self.conversations = Gauge("turnkv_router_conversations", "Conversations held in the store.", registry=r)
        self.store_seconds = Histogram("turnkv_router_store_seconds", "Conversation store call latency.", ["op"],
                                       buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5), registry=r)
