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
REUSE_OUTCOME = "ReuseOutcome"  # e.g. hit | miss | recompute | expired | mismatch (the router defines the set)
PROMPT_BUCKET = "PromptBucket"  # e.g. lt1k | 1k-8k | 8k-32k | ge32k
ROLE = "Role"  # prefill | decode
POOL = "Pool"

#: Router EMF metrics (units in brackets).
TTFT = "TTFT"  # [Milliseconds] per request, dims {Deployment}, {+ReuseOutcome}, {+ReuseOutcome, PromptBucket}
REQUESTS = "Requests"  # [Count] same dimension sets as TTFT
ERRORS = "Errors"  # [Count] dims Deployment
REUSE_HIT = "ReuseHit"  # [Count] 1 when KV was reused (average = hit rate), dims Deployment
REUSED_TOKENS = "ReusedTokens"  # [Count] dims Deployment
PREFILL_TIME = "PrefillTime"  # [Milliseconds] the prefill leg (a KV pull included on reuse), dims Deployment
PREFILL_TIME_SAVED = "PrefillTimeSaved"  # [Milliseconds] estimated, dims Deployment

#: vLLM Prometheus metric families the bridge reads (names as vLLM 0.32 exports them).
VLLM_TTFT = "vllm:time_to_first_token_seconds"  # histogram
VLLM_ITL = "vllm:inter_token_latency_seconds"  # histogram
VLLM_KV_USAGE = "vllm:kv_cache_usage_perc"  # gauge, 0..1
VLLM_RUNNING = "vllm:num_requests_running"  # gauge
VLLM_WAITING = "vllm:num_requests_waiting"  # gauge
VLLM_NIXL_XFER_TIME = "vllm:nixl_xfer_time_seconds"  # histogram
VLLM_NIXL_BYTES = "vllm:nixl_bytes_transferred"  # histogram (its sum: bytes moved)
VLLM_NIXL_EXPIRED = "vllm:nixl_num_kv_expired_reqs"  # counter

#: What the bridge publishes per interval (dims Deployment, Role), units in brackets.
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
