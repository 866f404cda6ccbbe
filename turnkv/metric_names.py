"""CloudWatch names shared by the emitters (router EMF lines, the engine node's CloudWatch agent) and the
CDK dashboard/alarms, so a renamed metric breaks a test instead of silently emptying a graph. Pure data.
"""

from __future__ import annotations

#: The router writes EMF lines to stdout (awslogs on Fargate) into this namespace.
ROUTER_NAMESPACE = "turnkv/Router"
#: The engine node's metrics bridge (``turnkv.emf_bridge``): vLLM's Prometheus /metrics turned into EMF lines
#: for the CloudWatch agent's listener (the agent's own Prometheus input drops histograms).
ENGINE_NAMESPACE = "turnkv/Engine"
#: The CloudWatch agent's own GPU / EFA / host metrics.
AGENT_NAMESPACE = "CWAgent"

#: Dimensions.
DEPLOYMENT = "Deployment"
REUSE_OUTCOME = "ReuseOutcome"  # hit | miss | recompute | ...: the values of router.outcomes.ReuseOutcome
PROMPT_BUCKET = "PromptBucket"  # e.g. lt1k | 1k-8k | 8k-32k | ge32k
ROLE = "Role"  # prefill | decode
POOL = "Pool"
#: One engine (its engine id: the instance id, plus ``-<slot>`` for a node's second and later engines). The bridge
#: of a node running several engines publishes each metric under :data:`ENGINE_DIMENSIONS` too, so the node's
#: engines are told apart; the dashboards and alarms read :data:`ENGINE_ROLE_DIMENSIONS`.
ENGINE_ID = "EngineId"
#: The engine bridge's dimension sets: every metric under ``{Deployment, Role}`` (what the dashboards and alarms
#: aggregate by, over all of a role's engines) and, when the bridge knows its engine, ``{Deployment, Role,
#: EngineId}`` as well (an EMF metric is published once per dimension set of its directive).
ENGINE_ROLE_DIMENSIONS = (DEPLOYMENT, ROLE)
ENGINE_DIMENSIONS = (*ENGINE_ROLE_DIMENSIONS, ENGINE_ID)

#: Router EMF metrics (units in brackets).
TTFT = "TTFT"  # [Milliseconds] per request, dims {Deployment}, {+ReuseOutcome}, {+ReuseOutcome, PromptBucket}
REQUESTS = "Requests"  # [Count] same dimension sets as TTFT
ERRORS = "Errors"  # [Count] dims Deployment
REUSE_HIT = "ReuseHit"  # [Count] 1 when KV was reused (average = hit rate), dims Deployment
REUSED_TOKENS = "ReusedTokens"  # [Count] dims Deployment
PREFILL_TIME = "PrefillTime"  # [Milliseconds] the prefill leg (a KV pull included on reuse), dims Deployment
PREFILL_TIME_SAVED = "PrefillTimeSaved"  # [Milliseconds] estimated (router.savings), dims {Deployment}, {+Tenant}
#: [None: US dollars] PrefillTimeSaved at the prefill engine-hour price, dims {Deployment}, {Deployment, Tenant};
#: absent while the price is unknown. Dollars per 1,000 turns: 1000 x Sum(PrefillCostSaved) / Sum(Requests).
PREFILL_COST_SAVED = "PrefillCostSaved"
#: The tenant (its API key's name; "default" without keys): the savings' second dimension set.
TENANT = "Tenant"
#: [Count] engines registered in Cloud Map, per role, as each router replica's discovery sees them (one record
#: per role and discovery round), dims {Deployment, Role}. An engine registers only once its /health answers.
REGISTERED_ENGINES = "RegisteredEngines"

#: The router's own Prometheus /metrics for what reuse saved (router.savings; label tenant where named).
PROM_TURNS = "turnkv_router_turns"  # counter, label tenant (exposed as ..._total)
PROM_PREFILL_SECONDS_SAVED = "turnkv_router_prefill_seconds_saved"  # counter, label tenant
PROM_PREFILL_DOLLARS_SAVED = "turnkv_router_prefill_dollars_saved"  # counter, label tenant
PROM_PREFILL_SECONDS_PER_TOKEN = "turnkv_router_prefill_seconds_per_token"  # gauge: the measured rate
PROM_PREFILL_PRICE = "turnkv_router_prefill_engine_price_per_hour"  # gauge, USD
PROM_DOLLARS_PER_1K_TURNS = "turnkv_router_prefill_dollars_saved_per_1k_turns"  # gauge, whole deployment
PROM_TENANT_DOLLARS_PER_1K_TURNS = "turnkv_router_tenant_prefill_dollars_saved_per_1k_turns"  # gauge, label tenant

#: vLLM Prometheus metric families the bridge reads (names as vLLM 0.32 exports them).
VLLM_TTFT = "vllm:time_to_first_token_seconds"  # histogram
VLLM_ITL = "vllm:inter_token_latency_seconds"  # histogram
VLLM_KV_USAGE = "vllm:kv_cache_usage_perc"  # gauge, 0..1
VLLM_RUNNING = "vllm:num_requests_running"  # gauge
VLLM_WAITING = "vllm:num_requests_waiting"  # gauge
VLLM_NIXL_XFER_TIME = "vllm:nixl_xfer_time_seconds"  # histogram
VLLM_NIXL_BYTES = "vllm:nixl_bytes_transferred"  # histogram (its sum: bytes moved)
VLLM_NIXL_EXPIRED = "vllm:nixl_num_kv_expired_reqs"  # counter
#: turnkv's retention tiers (connector.stats): counters with a tier or reason label, gauges of bytes held.
VLLM_PULLS = "vllm:turnkv_pulls"  # counter, label tier (prefill)
VLLM_RETENTION_PLACED = "vllm:turnkv_retention_placed"  # counter, label tier (decode)
VLLM_RETENTION_REFUSALS = "vllm:turnkv_retention_refusals"  # counter, label reason (decode)
VLLM_RETENTION_EVICTIONS = "vllm:turnkv_retention_evictions"  # counter, label reason (decode)
VLLM_HOST_MOVES = "vllm:turnkv_host_moves"  # counter (decode)
VLLM_FORK_HOLDS = "vllm:turnkv_fork_holds"  # counter (decode): read turns kept for forks
VLLM_RETAINED_BYTES = "vllm:turnkv_retained_bytes"  # gauge, both tiers (decode)
VLLM_HOST_RETAINED_BYTES = "vllm:turnkv_host_retained_bytes"  # gauge (decode)
VLLM_HOST_POOL_BYTES = "vllm:turnkv_host_pool_bytes"  # gauge (decode)
#: The host tier as configured and as granted at engine start (decode): granted < configured means the node refused
#: the registration plan and the pool shrank, 0 that the tier is off (connector.host_tier).
VLLM_HOST_TIER_CONFIGURED_BYTES = "vllm:turnkv_host_tier_configured_bytes"  # gauge (decode)
VLLM_HOST_TIER_GRANTED_BYTES = "vllm:turnkv_host_tier_granted_bytes"  # gauge (decode)
VLLM_DECISIONS = "vllm:turnkv_decisions"  # counter, label decision (prefill): offers pulled or recomputed
VLLM_INLINE_PLANS = "vllm:turnkv_inline_plans"  # counter, label reason (prefill): pulls read inline or why not
#: Every check of the bytes a READ brought against decode's seal (connector.fingerprint), per rank: ok, mismatch
#: (the blocks were recomputed), unverifiable (layouts that cannot be compared).
VLLM_FINGERPRINT_CHECKS = "vllm:turnkv_fingerprint_checks"  # counter, label result (prefill)
VLLM_FINGERPRINT_MISMATCHES = "vllm:turnkv_fingerprint_mismatches"  # counter, label path (prefill): blocks refused
FINGERPRINT_RESULTS = ("ok", "mismatch", "unverifiable")
READ_PATHS = ("device", "host", "inline")
TIERS = ("device", "host")
REFUSAL_REASONS = ("too_large", "full")
EVICTION_REASONS = ("idle", "shrunk", "read")
DECISIONS = ("pull", "recompute")
#: Why a pull is or is not read inline (connector.inline.plan's reasons).
INLINE_REASONS = ("inline", "off", "engine", "no-estimate", "slow", "whole-prompt", "runner", "offload")

#: What the bridge publishes per interval (dims Deployment, Role; and Deployment, Role, EngineId on a node of
#: several engines), units in brackets.
ENGINE_TTFT = "EngineTTFT"  # [Milliseconds] mean over the interval
ENGINE_TTFT_P99 = "EngineTTFTp99"  # [Milliseconds] estimated from the histogram buckets
ENGINE_ITL = "EngineITL"  # [Milliseconds] mean
ENGINE_ITL_P99 = "EngineITLp99"  # [Milliseconds]
KV_CACHE_USAGE = "KvCacheUsage"  # [Percent]
REQUESTS_RUNNING = "RequestsRunning"  # [Count]
REQUESTS_WAITING = "RequestsWaiting"  # [Count]
NIXL_XFER_TIME = "NixlXferTime"  # [Milliseconds] mean
NIXL_XFER_TIME_P99 = "NixlXferTimep99"  # [Milliseconds]
NIXL_BYTES = "NixlBytes"  # [Bytes] moved during the interval
NIXL_EXPIRED = "NixlExpiredReqs"  # [Count] reads declined because D's blocks were about to expire
RETAINED_BYTES = "RetainedBytes"  # [Bytes] decode's retained turns, both tiers
HOST_RETAINED_BYTES = "HostRetainedBytes"  # [Bytes] decode's retained turns in its host tier
HOST_POOL_BYTES = "HostPoolBytes"  # [Bytes] decode's host-tier pool
HOST_TIER_CONFIGURED_BYTES = "HostTierConfiguredBytes"  # [Bytes] host tier asked for at engine start
HOST_TIER_GRANTED_BYTES = "HostTierGrantedBytes"  # [Bytes] host tier allocated, pinned and registered
HOST_MOVES = "HostMoves"  # [Count] turns copied from device to host


def pulls(tier: str) -> str:
    """[Count] offers prefill pulled from decode's ``tier`` (device | host)."""
    return f"Pulls{tier.capitalize()}"


def retained(tier: str) -> str:
    """[Count] finished turns decode retained in ``tier``."""
    return f"Retained{tier.capitalize()}"


def refused(reason: str) -> str:
    """[Count] finished turns decode did not retain, by reason (too_large | full)."""
    return "RetentionRefused" + "".join(w.capitalize() for w in reason.split("_"))


def evicted(reason: str) -> str:
    """[Count] retained turns decode evicted, by reason (idle | shrunk)."""
    return f"RetentionEvicted{reason.capitalize()}"

#: CloudWatch agent metric names (nvidia_gpu and efa sections).
GPU_UTIL = "nvidia_smi_utilization_gpu"
GPU_MEMORY_USED = "nvidia_smi_memory_used"
EFA_RDMA_READ_BYTES = "efa_rdma_read_bytes"
EFA_RDMA_WRITE_BYTES = "efa_rdma_write_bytes"
EFA_RETRANS_PKTS = "efa_retrans_pkts"
EFA_UNRESPONSIVE = "efa_unresponsive_remote_events"
EFA_MEASUREMENTS = (EFA_RDMA_READ_BYTES, EFA_RDMA_WRITE_BYTES, "efa_rdma_write_recv_bytes", "efa_rx_bytes",
                    "efa_tx_bytes", "efa_rx_dropped", EFA_RETRANS_PKTS, "efa_retrans_bytes",
                    "efa_retrans_timeout_events", EFA_UNRESPONSIVE, "efa_impaired_remote_conn_events")
