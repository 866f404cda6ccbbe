"""A real fleet's memory ratios, scaled down to the local stack's tiny model (pure, no I/O).

The three-arm benchmark (``bench.pressure --arms``) must hold the local stack at the proportions a deployment has,
or the comparison says nothing about it: how much of the live conversations' context one prefill engine's cache
(device and offload tier) holds, against decode's retention room and host tier. Every figure of the target comes
from the planner's tables, never retyped here: the model's KV bytes per token (``turnkv.plan.architectures``), the
instance's HBM, memory utilization and the engine's KV cache after the weights (``turnkv.plan.hardware``), the
node's host memory and the host tier's share of it (``infra.instances``), and the share of decode's device cache
retention may use (``turnkv.params``' ``retained_kv_share`` default).

Scaling: the local turnkv prefill gets ``prefill_blocks`` KV blocks (its stand-in for the target prefill's HBM KV
cache); every other pool is that count times the target's ratio of the pool to one prefill engine's HBM KV cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from infra import instances
from turnkv import params
from turnkv.plan import architectures, hardware

MIB = 2**20


@dataclass(frozen=True)
class Target:
    """The fleet mimicked: ``prefill_nodes`` P and ``decode_nodes`` D instances, one engine of TP ``tp`` each."""

    model: str = "Qwen3-32B"
    instance: str = "p5en.48xlarge"
    tp: int = 8
    prefill_nodes: int = 1
    decode_nodes: int = 5
    #: Share of the prefill node's host memory a peer gives vLLM's CPU offloading tier: the same share turnkv's
    #: decode host tier takes of a decode node's (infra.instances.HOST_TIER_SHARE), so neither side gets more host
    #: memory per node than the other.
    offload_share: float = instances.HOST_TIER_SHARE
    host_tier_share: float = instances.HOST_TIER_SHARE
    retained_kv_share: float = float(params.BY_NAME["retained_kv_share"].default)

    @property
    def name(self) -> str:
        return f"{self.prefill_nodes}P{self.decode_nodes}D {self.instance} {self.model} TP{self.tp}"


@dataclass(frozen=True)
class Pools:
    """The target's KV pools, in tokens of its model, per role (all engines of the role together)."""

    kv_bytes_per_token: float
    prefill_hbm_tokens: float
    prefill_offload_tokens: float
    decode_hbm_tokens: float
    decode_retained_tokens: float
    decode_host_tokens: float
    sources: dict[str, str]

    def ratio(self, tokens: float) -> float:
        """A pool's size over one prefill engine's HBM KV cache."""
        return tokens / self.prefill_hbm_tokens

    def as_dict(self) -> dict[str, object]:
        return {"kv_bytes_per_token": self.kv_bytes_per_token,
                **{k: round(getattr(self, k)) for k in ("prefill_hbm_tokens", "prefill_offload_tokens",
                                                         "decode_hbm_tokens", "decode_retained_tokens",
                                                         "decode_host_tokens")},
                "ratios_to_prefill_hbm": {k: round(self.ratio(getattr(self, k)), 3) for k in (
                    "prefill_offload_tokens", "decode_hbm_tokens", "decode_retained_tokens", "decode_host_tokens")},
                "sources": self.sources}


def pools(target: Target = Target()) -> Pools:
    """The target's pools from the planner's and infra's tables."""
    model = architectures.load(target.model)
    inst = hardware.INSTANCES[target.instance]
    profile = instances.INSTANCE_TYPES[target.instance]
    per_token = model.kv_bytes_per_token()
    engine_kv = inst.kv_cache_bytes(target.tp, model.total_params() * model.weight_bytes_per_param)
    engines_per_node = max(1, inst.devices // target.tp)
    host_bytes = profile.host_memory_gib * 2**30
    offload = host_bytes * target.offload_share / engines_per_node
    host_tier = instances.host_tier_budget_mib(target.instance, target.tp, target.host_tier_share) * MIB
    decode_engines = target.decode_nodes * engines_per_node
    sources = {
        "kv_bytes_per_token": f"turnkv.plan.architectures {target.model} ({model.layers} layers x {model.kv_heads} KV "
                              f"heads x {model.head_dim} x K,V x {model.kv_dtype})",
        "engine_kv_cache": f"turnkv.plan.hardware {target.instance}: TP{target.tp} x {inst.hbm_bytes / 1e9:g} GB x "
                           f"{inst.memory_utilization} utilization - {target.model} weights",
        "host_memory": f"infra.instances {target.instance}: {profile.host_memory_gib} GiB per node",
        "offload_tier": f"{target.offload_share} of the prefill node's host memory (as the decode host tier's share)",
        "host_tier": f"infra.instances.host_tier_budget_mib ({target.host_tier_share} of a decode node's host memory)",
        "retained_kv_share": f"turnkv.params retained_kv_share default {target.retained_kv_share}",
    }
    return Pools(per_token, target.prefill_nodes * engine_kv / per_token,
                 target.prefill_nodes * offload / per_token, decode_engines * engine_kv / per_token,
                 decode_engines * engine_kv * target.retained_kv_share / per_token,
                 decode_engines * host_tier / per_token, sources)


@dataclass(frozen=True)
class LocalSizes:
    """The local stack at the target's ratios: exact block counts (``--num-gpu-blocks-override``) and the host
    tier, for the tiny model."""

    block_tokens: int
    block_bytes: int
    #: The stand-in for the target prefill's HBM KV cache: every other pool scales from it.
    prefill_hbm_blocks: int
    #: turnkv's prefill (prefix caching on, as deployed): its HBM, plus vLLM's CPU offloading tier as more prefix
    #: cache when it runs one (``prefill_offload``: a ``MultiConnector`` of turnkv's connector and the
    #: ``OffloadingConnector``, ``turnkv.engine_args``), the same as the peer's: "combine what helps".
    prefill_blocks: int
    #: The peer's prefill: HBM plus the offload tier as more prefix cache (vLLM's CPU offloading does not run on
    #: its CPU build: ``CPU Offloading is currently only supported on CUDA-alike and XPU GPUs``).
    peer_prefill_blocks: int
    #: The one local decode engine stands for every decode engine of the target.
    decode_blocks: int
    retained_kv_share: float
    host_kv_budget_mib: int

    def stack_fields(self) -> dict[str, object]:
        """``StackConfig`` fields (block overrides) and engine tunables that hold the stack at these sizes."""
        return {"prefill_blocks": self.prefill_blocks, "peer_prefill_blocks": self.peer_prefill_blocks,
                "decode_blocks": self.decode_blocks,
                "tunables": {"retained_kv_share": self.retained_kv_share,
                             "host_kv_budget_mib": self.host_kv_budget_mib}}

    def as_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def scale(target: Target = Target(), prefill_blocks: int = 16, block_tokens: int = 128,
          local_kv_bytes_per_token: float | None = None, prefill_offload: bool = True) -> LocalSizes:
    """The target's pools for a local prefill HBM cache of ``prefill_blocks`` blocks of ``block_tokens`` tokens of the
    tiny model (``architectures.tiny_local``, float32 as the engines run it). ``prefill_offload``: turnkv's prefill
    runs the CPU offloading tier the peer runs (as deployed by default), so both prefills hold the same cache and
    what differs is decode's retention and the pull."""
    if prefill_blocks < 1 or block_tokens < 1:
        raise ValueError("prefill_blocks and block_tokens must be at least 1")
    p = pools(target)
    per_token = local_kv_bytes_per_token or architectures.tiny_local().kv_bytes_per_token()
    block_bytes = int(per_token * block_tokens)
    host_blocks = prefill_blocks * p.ratio(p.decode_host_tokens)
    with_offload = round(prefill_blocks * (1 + p.ratio(p.prefill_offload_tokens)))
    return LocalSizes(
        block_tokens=block_tokens, block_bytes=block_bytes, prefill_hbm_blocks=prefill_blocks,
        prefill_blocks=with_offload if prefill_offload else prefill_blocks, peer_prefill_blocks=with_offload,
        decode_blocks=round(prefill_blocks * p.ratio(p.decode_hbm_tokens)),
        retained_kv_share=target.retained_kv_share,
        host_kv_budget_mib=math.ceil(host_blocks * block_bytes / MIB))


def fit(tokens_per_conversation: int, blocks: int, block_tokens: int) -> int:
    """Live conversations whose context ``blocks`` blocks hold (each conversation's blocks rounded up; at least 1)."""
    per = max(1, math.ceil(tokens_per_conversation / block_tokens))
    return max(1, blocks // per)
