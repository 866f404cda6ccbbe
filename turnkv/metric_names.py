"""CloudWatch names shared by the emitters (router EMF lines, the engine node's CloudWatch agent) and the
CDK dashboard/alarms, so a renamed metric breaks a test instead of silently emptying a graph. Pure data.
"""

from __future__ import annotations

#: The router writes EMF lines to stdout (awslogs on Fargate) into this namespace.
ROUTER_NAMESPACE = "turnkv/Router"
#: The engine node's CloudWatch agent: Prometheus scrape of vLLM's /metrics (EMF) into this namespace.
ENGINE_NAMESPACE = "turnkv/Engine"
#: The CloudWatch agent's own GPU / EFA / host metrics.
AGENT_NAMESPACE = "CWAgent"

#: Dimensions.
DEPLOYMENT = "Deployment"
REUSE_OUTCOME = "ReuseOutcome"  # e.g. hit | miss | recompute | expired | mismatch (the router defines the set)
PROMPT_BUCKET = "PromptBucket"  # e.g. lt1k | 1k-8k | 8k-32k | ge32k
ROLE = "Role"  # prefill | decode
POOL = "Pool"

#: Router EMF metrics (units in brackets).
TTFT = "TTFT"  # [Milliseconds] per request, dims Deployment, ReuseOutcome, PromptBucket
REQUESTS = "Requests"  # [Count] dims Deployment, ReuseOutcome
ERRORS = "Errors"  # [Count] dims Deployment
REUSE_HIT = "ReuseHit"  # [Count] 1 when KV was reused (average = hit rate), dims Deployment
REUSED_TOKENS = "ReusedTokens"  # [Count] dims Deployment
KV_PULL_TIME = "KvPullTime"  # [Milliseconds] dims Deployment
PREFILL_TIME_SAVED = "PrefillTimeSaved"  # [Milliseconds] estimated, dims Deployment

#: vLLM Prometheus metrics the agent forwards (names as vLLM exports them).
VLLM_TTFT_SUM = "vllm:time_to_first_token_seconds_sum"
VLLM_TTFT_COUNT = "vllm:time_to_first_token_seconds_count"
VLLM_ITL_SUM = "vllm:inter_token_latency_seconds_sum"
VLLM_ITL_COUNT = "vllm:inter_token_latency_seconds_count"
VLLM_KV_USAGE = "vllm:kv_cache_usage_perc"
VLLM_RUNNING = "vllm:num_requests_running"
VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_NIXL_XFER_TIME_SUM = "vllm:nixl_xfer_time_seconds_sum"
VLLM_NIXL_XFER_TIME_COUNT = "vllm:nixl_xfer_time_seconds_count"
VLLM_NIXL_BYTES_SUM = "vllm:nixl_bytes_transferred_sum"
VLLM_NIXL_EXPIRED = "vllm:nixl_num_kv_expired_reqs"
VLLM_FORWARDED = (VLLM_TTFT_SUM, VLLM_TTFT_COUNT, VLLM_ITL_SUM, VLLM_ITL_COUNT, VLLM_KV_USAGE, VLLM_RUNNING,
                  VLLM_WAITING, VLLM_NIXL_XFER_TIME_SUM, VLLM_NIXL_XFER_TIME_COUNT, VLLM_NIXL_BYTES_SUM,
                  VLLM_NIXL_EXPIRED)

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
