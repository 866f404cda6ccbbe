"""Deployment configs the infra tests synthesize (plain mappings, as cdk.json or a YAML file would hold)."""

from __future__ import annotations

import copy

#: A concrete account, as the CDK CLI sets CDK_DEFAULT_ACCOUNT whenever credentials exist.
ACCOUNT = "123456789012"

GPU = {
    "name": "gpu",
    "region": "us-east-2",
    "availability_zone": "us-east-2a",
    "network": {"availability_zones": ["us-east-2a", "us-east-2b"], "cidr": "10.40.0.0/16"},
    "model": {"id": "Qwen/Qwen3-32B", "served_model_name": "qwen3-32b", "tensor_parallel_size": 8,
              "max_model_len": 32768, "s3_uri": "s3://turnkv-test-weights/qwen3-32b/",
              # engine settings (turnkv.engine_settings): Qwen3 serving tool calls, fp8 KV
              "kv_cache_dtype": "fp8", "tool_call_parser": "hermes", "reasoning_parser": "qwen3",
              "extra_args": ["--max-num-batched-tokens=8192"]},
    "connector": {"mode": "pull", "bidirectional": True},
    "pools": [
        {"name": "prefill", "role": "prefill", "instance_type": "p5en.48xlarge", "count": 2,
         "capacity_reservation_id": "cr-0a1b2c3d4e5f60718"},
        {"name": "decode", "role": "decode", "instance_type": "p5.48xlarge", "count": 2, "allow_on_demand": True},
        {"name": "decode-block", "role": "decode", "instance_type": "p5e.48xlarge", "count": 1,
         "capacity_reservation_id": "cr-0f1e2d3c4b5a69788", "capacity_block": True},
    ],
    "router": {"replicas": 2, "max_replicas": 6, "public": True, "allowed_cidrs": ["203.0.113.0/24"],
               "certificate_arn": "arn:aws:acm:us-east-2:123456789012:certificate/"
                                  "12345678-1234-1234-1234-123456789012"},
    "alarm_email": "oncall@example.com",
    #: Initial tunables: written to SSM by the params stack in place of the catalog's defaults.
    "tunables": {"retained_kv_share": 0.4},
}

#: The second app: push mode, a NAT (weights from Hugging Face), an internal HTTP ALB, one router replica.
#: (Trainium pools are refused by the config until the Neuron image can serve: tests/infra/test_config.py.)
PUSH = {
    "name": "push",
    "region": "us-east-2",
    "availability_zone": "us-east-2b",
    "network": {"availability_zones": ["us-east-2a", "us-east-2b", "us-east-2c"], "nat_gateways": 1},
    "model": {"id": "meta-llama/Llama-3.1-8B-Instruct", "tensor_parallel_size": 8, "max_model_len": 16384,
              # a gated model downloaded through the NAT: its token in Secrets Manager, by name
              "hf_token_secret": "turnkv/hf-token", "trust_remote_code": True},
    "connector": {"mode": "push", "bidirectional": True},
    "pools": [
        {"name": "prefill", "role": "prefill", "instance_type": "p5.48xlarge", "count": 1, "allow_on_demand": True},
        {"name": "decode", "role": "decode", "instance_type": "p5en.48xlarge", "count": 1, "allow_on_demand": True},
    ],
    "router": {"replicas": 1, "max_replicas": 1},
    # media URLs only from these hosts (the router's intake and the engines' --allowed-media-domains)
    "media_domains": ["Images.Example.com.", "cdn.example.net"],
}


def variant(base: dict, **changes) -> dict:
    """A deep copy with dotted-path changes, e.g. variant(GPU, **{"router.replicas": 0})."""
    out = copy.deepcopy(base)
    for dotted, value in changes.items():
        node = out
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
        if isinstance(node, list):
            node[int(leaf)] = value
        else:
            node[leaf] = value
    return out
