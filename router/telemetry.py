"""Router observability: Prometheus metrics (``/metrics``), one CloudWatch EMF line per request, and
the request id in every log line (a context variable read by a logging filter)."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from router import savings
from router.outcomes import ReuseOutcome
from turnkv import metric_names as mn
from turnkv import router_env, versions

#: Why a request did or did not reuse the previous turn's KV: the ``reuse`` label values of the TTFT histogram and
#: the reuse counter, and the EMF ``ReuseOutcome`` dimension (``router.outcomes.ReuseOutcome`` says what each means).
OUTCOMES = tuple(ReuseOutcome)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30, 60)
#: Whole requests: a long stream runs for minutes.
_DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
#: Gaps between streamed chunks (vLLM's inter-token latency buckets, up to 80 s).
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
#: ``turnkv_router_request_duration_seconds{outcome}``: how a request ended, from its HTTP status.
DURATION_OUTCOMES = ("ok", "client_error", "disconnected", "server_error")


def duration_outcome(status: int) -> str:
    """The ``outcome`` label of a request that ended with ``status`` (499: the client went away)."""
    if status == 499:
        return "disconnected"
    if status >= 500 or status == 0:
        return "server_error"
    return "client_error" if status >= 400 else "ok"

#: The request being served (set by the handler); every log record carries it.
request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        return True


def setup_logging(level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


class Metrics:
    def __init__(self) -> None:
        # No ``*_created`` series beside every counter and histogram child (a second series per child that nothing
        # reads). prometheus_client's switch is process-wide; this registry is the only one in the router's process.
        disable_created_metrics()
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("turnkv_router_requests", "Requests by route and HTTP status.",
                                ["route", "status"], registry=r)
        self.request_duration = Histogram("turnkv_router_request_duration_seconds",
                                          "Time from a request's arrival to the end of its reply (a stream's last "
                                          "byte), by route and outcome (ok, client_error, disconnected, "
                                          "server_error).", ["route", "outcome"], buckets=_DURATION_BUCKETS,
                                          registry=r)
        self.inter_token_latency = Histogram("turnkv_router_inter_token_latency_seconds",
                                             "Streamed replies: the gap between successive chunks relayed to the "
                                             "client after the first token (a chunk carries the tokens of one or "
                                             "more engine steps).", buckets=_ITL_BUCKETS, registry=r)
        self.build_info = Gauge("turnkv_router_build_info",
                                "1, labelled with the turnkv release and the vLLM and NIXL releases it ships with.",
                                ["version", "vllm", "nixl"], registry=r)
        self.build_info.labels(versions.TURNKV, versions.VLLM_GPU, versions.NIXL).set(1)
        self.ttft = Histogram("turnkv_router_time_to_first_token_seconds",
                              "Router-side time to first token, by reuse outcome.", ["reuse"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.reuse = Counter("turnkv_router_reuse_decisions", "Reuse decisions by outcome.", ["reuse"], registry=r)
        self.reused_tokens = Counter("turnkv_router_reused_tokens", "Prompt tokens pulled from decode's KV.",
                                     registry=r)
        self.prefill_cached_tokens = Counter("turnkv_router_prefill_cached_tokens",
                                             "Prompt tokens prefill found in its own prefix cache (neither computed "
                                             "nor pulled).", registry=r)
        self.fork_reads = Counter("turnkv_router_fork_reads",
                                  "Replays of a stored turn another request of the same history already read (forks, "
                                  "subagents, retries within decode's fork_window).", registry=r)
        self.leg = Histogram("turnkv_router_leg_seconds", "Latency of the prefill leg and decode's first byte.",
                             ["leg"], buckets=_LATENCY_BUCKETS, registry=r)
        self.token_mismatches = Counter("turnkv_router_token_mismatches",
                                        "Reuse cut short by prefill's token proof, by cause.", ["cause"], registry=r)
        self.offer_refusals = Counter("turnkv_router_offer_refusals",
                                      "Replayed offers prefill refused to read, by its reason (turnkv.wire).",
                                      ["reason"], registry=r)
        self.retries = Counter("turnkv_router_retries", "Leg retries by leg and reason.", ["leg", "reason"],
                               registry=r)
        self.engine_errors = Counter("turnkv_router_engine_errors", "Engine failures by role and kind.",
                                     ["role", "kind"], registry=r)
        self.engine_healthy = Gauge("turnkv_router_engine_healthy", "1 when the engine is in the pool.",
                                    ["role", "engine"], registry=r)
        self.engine_outstanding = Gauge("turnkv_router_engine_outstanding", "Requests in flight per engine.",
                                        ["role", "engine"], registry=r)
        self.engines = Gauge("turnkv_router_engines", "Engines known, by role and health.", ["role", "healthy"],
                             registry=r)
        self.conversations = Gauge("turnkv_router_conversations", "Conversations held in the store.", registry=r)
        self.store_seconds = Histogram("turnkv_router_store_seconds", "Conversation store call latency.", ["op"],
                                       buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5), registry=r)
        self.store_errors = Counter("turnkv_router_store_errors", "Conversation store calls that failed or timed out.",
                                    ["op"], registry=r)
        self.client_disconnects = Counter("turnkv_router_client_disconnects",
                                          "Requests whose client went away (both legs aborted).", registry=r)
        self.auth_failures = Counter("turnkv_router_auth_failures", "Requests refused for a bad API key.",
                                     registry=r)
        self.params_reloads = Counter("turnkv_router_params_reloads", "SSM re-reads by result.", ["result"],
                                      registry=r)
        self.retention_refused = Counter("turnkv_router_retention_refused",
                                         "Conversation turns not retained: the tenant's retention limits.",
                                         registry=r)
        self.admission_refused = Counter("turnkv_router_admission_refused",
                                         "Requests refused by a router limit (429, 413, 408), by the limit's name "
                                         "(router: max_inflight, tenant: tenant_max_inflight, else the tunable).",
                                         ["limit"], registry=r)
        self.fair_queue_waits = Counter("turnkv_router_fair_queue_waits",
                                        "Requests that waited in the prefill pool's fair queue (prefill_fair_tokens) "
                                        "before going to the engines.", registry=r)
        self.fair_queue_waiting = Gauge("turnkv_router_fair_queue_waiting",
                                        "Requests waiting in the prefill pool's fair queue now.", registry=r)
        self.decode_queue_waits = Counter("turnkv_router_decode_queue_waits",
                                          "Requests that waited in the decode pool's fair queue "
                                          "(decode_fair_sequences) before going to the engines.", registry=r)
        self.decode_queue_waiting = Gauge("turnkv_router_decode_queue_waiting",
                                          "Requests waiting in the decode pool's fair queue now.", registry=r)
        self.router_errors = Counter("turnkv_router_resource_errors",
                                     "Legs the router could not open for want of its own resources (EMFILE, ENFILE, "
                                     "EADDRNOTAVAIL, ENOBUFS): answered 503, the engine not counted as failed.",
                                     ["leg"], registry=r)
        self.slow_readers = Counter("turnkv_router_slow_readers",
                                    "Streams cut because the client did not read within write_timeout.", registry=r)
        self.migrations = Counter("turnkv_router_stream_migrations",
                                  "Streams continued on another decode engine after theirs died, by result.",
                                  ["result"], registry=r)
        self.session_hints = Counter("turnkv_router_session_hints",
                                     "Requests carrying a client session id (a hint: affinity and labels), "
                                     "by where it was read.", ["source"], registry=r)
        self.prefill_choices = Counter("turnkv_router_prefill_choices",
                                       "Prefill engine choices (retries included), by reason: affinity (the request's "
                                       "shared prefix's engine), load (its prefix's engine was over "
                                       "prefill_affinity_slack), no_key (no shared prefix, or affinity off).",
                                       ["reason"], registry=r)
        self.push_dispatch = Counter("turnkv_router_push_dispatches",
                                     "Push-mode dispatches: concurrent (identity known) or serial.", ["kind"],
                                     registry=r)
        self.several_sequences = Counter(
            "turnkv_router_several_sequences", "Requests of several sequences (n > 1, beam search, best_of, a list of "
            "prompts), which one P/D pair cannot serve, by how they were served: decode_alone or per_prompt "
            "(router.choices).", ["served"], registry=r)
        # What reuse saved (router.savings): prefill seconds and dollars per tenant, and per 1,000 turns.
        self.turns = Counter(mn.PROM_TURNS, "Requests served (turns), by tenant ('default' without API keys): the "
                             "denominator of the savings per 1,000 turns.", ["tenant"], registry=r)
        self.prefill_seconds_saved = Counter(
            mn.PROM_PREFILL_SECONDS_SAVED, "Prefill seconds reuse saved, by tenant: tokens pulled from decode x "
            "prefill's seconds per computed token as this router measures it (its prefill leg over the prompt tokens "
            "prefill computed, on turns that reused nothing; turnkv_router_prefill_seconds_per_token).", ["tenant"],
            registry=r)
        self.prefill_dollars_saved = Counter(
            mn.PROM_PREFILL_DOLLARS_SAVED, "Dollars of prefill time reuse saved, by tenant: the seconds saved at "
            "the prefill engine-hour price (turnkv_router_prefill_engine_price_per_hour; not counted while it is "
            "0, unknown).", ["tenant"], registry=r)
        self.prefill_seconds_per_token = Gauge(
            mn.PROM_PREFILL_SECONDS_PER_TOKEN, "Prefill seconds per computed prompt token, as measured by this "
            "router (an average over turns that reused nothing): the rate the savings are counted at.", registry=r)
        self.prefill_price = Gauge(
            mn.PROM_PREFILL_PRICE, "USD per prefill engine-hour the savings are priced at (the prefill pool's "
            "instance price over its engines per instance; 0: unknown).", registry=r)
        self.dollars_per_1k_turns = Gauge(
            mn.PROM_DOLLARS_PER_1K_TURNS, "Dollars of prefill time reuse saved per 1,000 turns since this router "
            "started, whole deployment (this replica's turns).", registry=r)
        self.tenant_dollars_per_1k_turns = Gauge(
            mn.PROM_TENANT_DOLLARS_PER_1K_TURNS, "Dollars of prefill time reuse saved per 1,000 of the tenant's "
            "turns since this router started.", ["tenant"], registry=r)

    def observe_pool(self, engines) -> None:
        counts: dict[tuple[str, str], int] = {}
        for e in engines:
            self.engine_healthy.labels(e.role, e.name).set(1 if e.healthy else 0)
            self.engine_outstanding.labels(e.role, e.name).set(e.outstanding)
            key = (e.role, "true" if e.healthy else "false")
            counts[key] = counts.get(key, 0) + 1
        for role in ("prefill", "decode"):
            for healthy in ("true", "false"):
                self.engines.labels(role, healthy).set(counts.get((role, healthy), 0))


# -- CloudWatch embedded metric format ---------------------------------------------------------------

NAMESPACE = os.environ.get(router_env.METRICS_NAMESPACE, "turnkv/Router")


def prompt_bucket(tokens: int) -> str:
    if tokens < 1000:
        return "lt1k"
    if tokens < 8000:
        return "1k-8k"
    if tokens < 32000:
        return "8k-32k"
    return "ge32k"


class PrefillRate:
    """Running estimate of prefill milliseconds per prompt token (from turns without reuse), to estimate
    the prefill time a reuse saved."""

    def __init__(self, alpha: float = 0.05) -> None:
        self.alpha = alpha
        self.ms_per_token = 0.0

    def observe(self, ms: float, tokens: int) -> None:
        if tokens <= 0:
            return
        rate = ms / tokens
        self.ms_per_token = rate if not self.ms_per_token else (1 - self.alpha) * self.ms_per_token + self.alpha * rate


@functools.lru_cache(maxsize=64)
def _directives(namespace: str, ttft: bool, prefill: bool, saved: bool, cost: bool = False) -> list[dict[str, Any]]:
    request_metrics = [{"Name": "Requests", "Unit": "Count"}]
    if ttft:
        request_metrics.insert(0, {"Name": "TTFT", "Unit": "Milliseconds"})
    deployment_metrics = [{"Name": "Errors", "Unit": "Count"}, {"Name": "ReuseHit", "Unit": "Count"},
                          {"Name": "ReusedTokens", "Unit": "Count"}]
    if prefill:
        deployment_metrics.append({"Name": "PrefillTime", "Unit": "Milliseconds"})
    # {Deployment} alone too: the whole deployment's TTFT percentiles (the alarm) cannot be summed from the
    # per-outcome series (percentiles do not add up).
    directives = [{"Namespace": namespace, "Dimensions": [[mn.DEPLOYMENT], [mn.DEPLOYMENT, mn.REUSE_OUTCOME],
                                                          [mn.DEPLOYMENT, mn.REUSE_OUTCOME, mn.PROMPT_BUCKET]],
                   "Metrics": request_metrics},
                  {"Namespace": namespace, "Dimensions": [[mn.DEPLOYMENT]], "Metrics": deployment_metrics}]
    if saved:  # what reuse saved, per deployment and per tenant (router.savings)
        saved_metrics = [{"Name": mn.PREFILL_TIME_SAVED, "Unit": "Milliseconds"}]
        if cost:
            saved_metrics.append({"Name": mn.PREFILL_COST_SAVED, "Unit": "None"})
        directives.append({"Namespace": namespace, "Dimensions": [[mn.DEPLOYMENT], [mn.DEPLOYMENT, mn.TENANT]],
                           "Metrics": saved_metrics})
    return directives


def emf_record(*, namespace: str, deployment: str, outcome: ReuseOutcome, prompt_tokens: int, ttft_ms: float | None,
               error: bool, reused_tokens: int, prefill_ms: float | None, saved_ms: float | None,
               fields: Mapping[str, Any], timestamp_ms: int | None = None, tenant: str = "",
               saved_dollars: float | None = None) -> dict[str, Any]:
    """One request as a CloudWatch EMF object (names match turnkv.metric_names on the infra side). What reuse saved
    (``saved_ms``, ``saved_dollars``: router.savings) is published per deployment and per ``tenant``."""
    record: dict[str, Any] = {
        "Deployment": deployment, "ReuseOutcome": outcome, "PromptBucket": prompt_bucket(prompt_tokens),
        "Requests": 1, "Errors": 1 if error else 0, "ReuseHit": 1 if outcome == ReuseOutcome.HIT else 0,
        "ReusedTokens": reused_tokens,
    }
    if ttft_ms is not None:
        record["TTFT"] = round(ttft_ms, 3)
    if prefill_ms is not None:
        record["PrefillTime"] = round(prefill_ms, 3)
    if saved_ms is not None:
        record[mn.PREFILL_TIME_SAVED] = round(saved_ms, 3)
        if saved_dollars is not None:
            record[mn.PREFILL_COST_SAVED] = saved_dollars
    record["_aws"] = {"Timestamp": timestamp_ms if timestamp_ms is not None else int(time.time() * 1000),
                      "CloudWatchMetrics": _directives(namespace, ttft_ms is not None, prefill_ms is not None,
                                                       saved_ms is not None,
                                                       saved_ms is not None and saved_dollars is not None)}
    record.update(fields)
    if saved_ms is not None:  # the dimension's value (after the fields: a field named like it must not replace it)
        record[mn.TENANT] = savings.tenant_label(tenant)
    return record


def registered_engines_records(*, namespace: str, deployment: str, counts: Mapping[str, int],
                               timestamp_ms: int | None = None) -> list[dict[str, Any]]:
    """Engines registered in Cloud Map per role (an EMF object per role): the alarm that sees a pool whose
    instances run but whose engines never serve (turnkv.metric_names.REGISTERED_ENGINES)."""
    stamp = timestamp_ms if timestamp_ms is not None else int(time.time() * 1000)
    directives = [{"Namespace": namespace, "Dimensions": [["Deployment", "Role"]],
                   "Metrics": [{"Name": "RegisteredEngines", "Unit": "Count"}]}]
    return [{"Deployment": deployment, "Role": role, "RegisteredEngines": n,
             "_aws": {"Timestamp": stamp, "CloudWatchMetrics": directives}} for role, n in sorted(counts.items())]


class EmfWriter:
    """EMF lines to stdout, batched: one write per ``flush_interval`` (or ``max_lines``), not one per request.
    CloudWatch (awslogs) reads the container's stdout line by line; the batching only saves syscalls."""

    def __init__(self, stream: Any = None, flush_interval: float = 0.5, max_lines: int = 256) -> None:
        self.stream = stream
        self.flush_interval = flush_interval
        self.max_lines = max_lines
        self._lines: list[bytes] = []
        self._timer: Any = None

    def emit(self, record: Mapping[str, Any]) -> None:
        self._lines.append(orjson.dumps(record))
        if len(self._lines) >= self.max_lines:
            self.flush()
        elif self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self.flush()
                return
            self._timer = loop.call_later(self.flush_interval, self.flush)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._lines:
            return
        data = b"\n".join(self._lines) + b"\n"
        self._lines.clear()
        stream = self.stream or sys.stdout
        try:
            buffer = getattr(stream, "buffer", None)
            if buffer is not None:
                buffer.write(data)
            else:
                stream.write(data.decode())
            stream.flush()
        except (OSError, ValueError):
            pass

