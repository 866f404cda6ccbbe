"""Model architectures as the planner needs them: FLOPs per token, attention cost, KV bytes per token.

``from_config`` reads a Hugging Face ``config.json`` (dense, GQA, MLA as in DeepSeek/GLM-5, MoE with
routed + shared experts, DeepSeek sparse attention's indexer); the catalog holds the models the seeds
and the local stack use, their fields copied from the published configs. Pure: no I/O but ``load``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "fp8": 1,
               "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1}


class ModelError(ValueError):
    """A config the planner cannot read; the message names the missing field."""


@dataclass(frozen=True)
class ModelArch:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int  # q/k head dim (nope + rope for MLA)
    v_head_dim: int
    intermediate: int  # dense MLP width
    vocab: int
    dtype: str = "bfloat16"  # weights / GEMM precision
    kv_dtype: str = "bfloat16"
    # MLA (DeepSeek-V2/V3, GLM-5): latent KV of kv_lora_rank + rope dims per token per layer
    kv_lora_rank: int = 0
    qk_rope_dim: int = 0
    q_lora_rank: int = 0
    # MoE
    experts: int = 0
    experts_per_token: int = 0
    shared_experts: int = 0
    moe_intermediate: int = 0
    dense_layers: int = 0  # first layers with a dense MLP (first_k_dense_replace)
    # DeepSeek sparse attention (DSA): each query attends to index_topk keys chosen by an indexer
    index_topk: int = 0
    index_heads: int = 0
    index_head_dim: int = 0
    tie_embeddings: bool = False
    #: Longest sequence (prompt + reply) the model serves: ``max_position_embeddings`` of its config.json
    #: (what vLLM's ``max_model_len`` defaults to); 0 where the planner does not know it (not checked).
    max_context: int = 0

    # -- shape facts ---------------------------------------------------------------------------
    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def weight_bytes_per_param(self) -> float:
        return DTYPE_BYTES.get(self.dtype, 2)

    def _attn_params(self) -> int:
        h, n, d, dv = self.hidden, self.heads, self.head_dim, self.v_head_dim
        if self.mla:
            q = h * self.q_lora_rank + self.q_lora_rank * n * d if self.q_lora_rank else h * n * d
            kv = h * (self.kv_lora_rank + self.qk_rope_dim) + self.kv_lora_rank * n * (d - self.qk_rope_dim + dv)
            idx = (self.q_lora_rank or h) * self.index_heads * self.index_head_dim + h * self.index_head_dim \
                if self.index_topk else 0
            return q + kv + n * dv * h + idx
        return h * n * d + 2 * h * self.kv_heads * d + n * dv * h

    def _mlp_params(self, active: bool) -> tuple[int, int]:
        """(dense-layer MLP params, MoE-layer MLP params: all experts, or active ones only)."""
        dense = 3 * self.hidden * self.intermediate
        if not self.moe:
            return dense, dense
        experts = (self.experts_per_token if active else self.experts) + self.shared_experts
        return dense, 3 * self.hidden * self.moe_intermediate * experts + self.hidden * self.experts

    def linear_params(self, active: bool = True) -> int:
        """Parameters of every matmul a token passes through (no embeddings, no lm_head)."""
        dense, moe = self._mlp_params(active)
        moe_layers = self.layers - self.dense_layers if self.moe else 0
        return self.layers * self._attn_params() + (self.layers - moe_layers) * dense + moe_layers * moe

    def total_params(self) -> int:
        emb = self.vocab * self.hidden * (1 if self.tie_embeddings else 2)
        return self.linear_params(active=False) + emb

    def active_params(self) -> int:
        return self.linear_params(active=True) + self.vocab * self.hidden * (1 if self.tie_embeddings else 2)

    # -- cost ----------------------------------------------------------------------------------
    def linear_flops_per_token(self) -> float:
        return 2.0 * self.linear_params(active=True)

    def attention_flops(self, new_tokens: float, context_before: float) -> float:
        """Score and value FLOPs of ``new_tokens`` causal queries after ``context_before`` cached tokens.

        Each query at position p attends to p+1 keys (index_topk at most under DSA, plus the indexer's
        own dot products over every key)."""
        n, h = new_tokens, context_before
        keys = n * h + n * (n + 1) / 2  # sum over the new queries of the keys each one sees
        per_key = 2.0 * self.heads * (self.head_dim + self.v_head_dim)
        if self.index_topk:
            sparse_keys = n * np.minimum(h + n / 2, self.index_topk)  # mean keys per query, capped at top-k
            indexer = 2.0 * self.index_heads * self.index_head_dim * keys
            return self.layers * (per_key * np.minimum(keys, sparse_keys) + indexer)
        return self.layers * per_key * keys

    def prefill_flops(self, new_tokens: float, context_before: float = 0.0) -> float:
        return self.linear_flops_per_token() * new_tokens + self.attention_flops(new_tokens, context_before)

    def kv_bytes_per_token_layer(self) -> float:
        """KV cache bytes of one token in one layer, whole model (all heads)."""
        if self.mla:
            if self.kv_dtype == "fp8_ds_mla":  # vLLM's DSA layout: fp8 latent + 4 fp32 scales + bf16 rope
                latent = self.kv_lora_rank + 16 + 2 * self.qk_rope_dim
            else:
                latent = (self.kv_lora_rank + self.qk_rope_dim) * DTYPE_BYTES.get(self.kv_dtype, 2)
            indexer = self.index_head_dim + 4 if self.index_topk else 0  # fp8 key + fp32 scale
            return float(latent + indexer)
        return 2.0 * self.kv_heads * self.head_dim * DTYPE_BYTES.get(self.kv_dtype, 2)

    def kv_bytes_per_token(self) -> float:
        return self.layers * self.kv_bytes_per_token_layer()

    def kv_bytes_per_token_rank(self, tp: int) -> float:
        """Bytes one tensor-parallel rank holds (and moves) per token: GQA heads are split across ranks
        (replicated when there are fewer KV heads than ranks); MLA's latent is replicated on every rank."""
        if self.mla:
            return self.kv_bytes_per_token()
        heads = max(1.0, self.kv_heads / tp)
        return self.layers * 2.0 * heads * self.head_dim * DTYPE_BYTES.get(self.kv_dtype, 2)

    def kv_regions_per_layer(self) -> int:
        """Separate KV tensors per layer that a transfer addresses (K and V; MLA latent [+ indexer])."""
        if self.mla:
            return 2 if self.index_topk else 1
        return 2

    def with_dtypes(self, dtype: str | None = None, kv_dtype: str | None = None) -> ModelArch:
        return replace(self, dtype=dtype or self.dtype, kv_dtype=kv_dtype or self.kv_dtype)


def from_config(conf: dict[str, Any], name: str = "custom") -> ModelArch:
    """A ModelArch from a Hugging Face config.json (text config of multimodal models included)."""
    conf = conf.get("text_config", conf)

    def need(key: str, *alts: str) -> Any:
        for k in (key, *alts):
            if conf.get(k) is not None:
                return conf[k]
        raise ModelError(f"config.json has no {key!r}: is this a decoder-only language model?")

    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    kv_lora = int(conf.get("kv_lora_rank") or 0)
    dtype = str(conf.get("torch_dtype") or conf.get("dtype") or "bfloat16")
    quant = conf.get("quantization_config") or {}
    if str(quant.get("quant_method", "")).lower() == "fp8" or "fp8" in str(quant.get("fmt", "")).lower():
        dtype = "fp8"
    if kv_lora:
        rope, nope = int(conf.get("qk_rope_head_dim", 64)), int(conf.get("qk_nope_head_dim", 128))
        head_dim, v_dim, kv_heads = nope + rope, int(conf.get("v_head_dim", nope)), heads
    else:
        head_dim = int(conf.get("head_dim") or hidden // heads)
        v_dim, rope, kv_heads = head_dim, 0, int(conf.get("num_key_value_heads") or heads)
    experts = int(conf.get("n_routed_experts") or conf.get("num_experts") or conf.get("num_local_experts") or 0)
    return ModelArch(
        name=name, layers=int(need("num_hidden_layers")), hidden=hidden, heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, v_head_dim=v_dim, intermediate=int(need("intermediate_size")),
        vocab=int(need("vocab_size")), dtype=dtype, kv_dtype=dtype if dtype in ("float32", "bfloat16") else "bfloat16",
        kv_lora_rank=kv_lora, qk_rope_dim=rope, q_lora_rank=int(conf.get("q_lora_rank") or 0),
        experts=experts, experts_per_token=int(conf.get("num_experts_per_tok") or 0) if experts else 0,
        shared_experts=int(conf.get("n_shared_experts") or 0) if experts else 0,
        moe_intermediate=int(conf.get("moe_intermediate_size") or 0) if experts else 0,
        dense_layers=int(conf.get("first_k_dense_replace") or 0) if experts else 0,
        index_topk=int(conf.get("index_topk") or 0), index_heads=int(conf.get("index_n_heads") or 0),
        index_head_dim=int(conf.get("index_head_dim") or 0),
        tie_embeddings=bool(conf.get("tie_word_embeddings", False)),
        max_context=int(conf.get("max_position_embeddings") or 0),
    )


#: Built-in models, fields as in each model's published config.json on Hugging Face.
CATALOG: dict[str, ModelArch] = {
    # meta-llama/Llama-3.3-70B-Instruct: 80 layers, 8192 hidden, 64 heads / 8 KV heads, MLP 28672
    "Llama-3.3-70B-Instruct": ModelArch("Llama-3.3-70B-Instruct", layers=80, hidden=8192, heads=64, kv_heads=8,
                                        head_dim=128, v_head_dim=128, intermediate=28672, vocab=128256,
                                        max_context=131072),
    # meta-llama/Llama-3.1-405B-Instruct: 126 layers, 16384 hidden, 128 heads / 8 KV heads, MLP 53248. The held-out
    # trn2 row (turnkv/plan/data/neuron_measurements.json).
    "Llama-3.1-405B-Instruct": ModelArch("Llama-3.1-405B-Instruct", layers=126, hidden=16384, heads=128, kv_heads=8,
                                         head_dim=128, v_head_dim=128, intermediate=53248, vocab=128256,
                                         max_context=131072),
    # Qwen/Qwen3-32B: 64 layers, 5120 hidden, 64 heads / 8 KV heads of 128, MLP 25600
    "Qwen3-32B": ModelArch("Qwen3-32B", layers=64, hidden=5120, heads=64, kv_heads=8, head_dim=128,
                           v_head_dim=128, intermediate=25600, vocab=151936,
                           max_context=40960),
    # Qwen/Qwen3-8B: 36 layers, 4096 hidden, 32 heads / 8 KV heads of 128, MLP 12288, untied embeddings
    "Qwen3-8B": ModelArch("Qwen3-8B", layers=36, hidden=4096, heads=32, kv_heads=8, head_dim=128, v_head_dim=128,
                          intermediate=12288, vocab=151936, max_context=40960),
    # Llama2-7b and Llama2-70b as TensorRT-LLM's performance doc builds them for its H100 first-token table
    # (NVIDIA/TensorRT-LLM docs/source/performance.md @138f96d: --n_layer 32 --n_head 32 --n_embd 4096
    # --inter_size 11008 --vocab_size 32000; --n_layer 80 --n_head 64 --n_kv_head 8 --n_embd 8192 --inter_size
    # 28672 --vocab_size 32000), the same shapes as meta-llama/Llama-2-7b-hf and -70b-hf's config.json. Held-out
    # GPU rows only (turnkv/plan/data/gpu_measurements.json).
    "Llama-2-7B": ModelArch("Llama-2-7B", layers=32, hidden=4096, heads=32, kv_heads=32, head_dim=128, v_head_dim=128,
                            intermediate=11008, vocab=32000, max_context=4096),
    "Llama-2-70B": ModelArch("Llama-2-70B", layers=80, hidden=8192, heads=64, kv_heads=8, head_dim=128,
                             v_head_dim=128, intermediate=28672, vocab=32000, max_context=4096),
    # zai-org/GLM-5-FP8 (GlmMoeDsaForCausalLM, 744B total / 40B active): 78 layers (+1 MTP, not served
    # here), 6144 hidden, 64 heads, MLA (q_lora 2048, kv_lora 512, nope 192 + rope 64, v 256), 256
    # routed experts (8 active) + 1 shared of 2048, first 3 layers dense (12288), DSA indexer 32 x 128,
    # top-2048. vLLM stores its KV as fp8_ds_mla (656 bytes per token per layer) plus the indexer's keys.
    "GLM-5-FP8": ModelArch("GLM-5-FP8", layers=78, hidden=6144, heads=64, kv_heads=64, head_dim=256, v_head_dim=256,
                           intermediate=12288, vocab=154880, dtype="fp8", kv_dtype="fp8_ds_mla", kv_lora_rank=512,
                           qk_rope_dim=64, q_lora_rank=2048, experts=256, experts_per_token=8, shared_experts=1,
                           moe_intermediate=2048, dense_layers=3, index_topk=2048, index_heads=32,
                           index_head_dim=128),
}


def tiny_local() -> ModelArch:
    """The local stack's tiny model (turnkv.local.model.ModelSpec), float32 as the engines run it."""
    from turnkv.local.model import ModelSpec

    s = ModelSpec()
    return ModelArch("tiny-local", layers=s.num_hidden_layers, hidden=s.hidden_size, heads=s.num_attention_heads,
                     kv_heads=s.num_key_value_heads, head_dim=s.head_dim, v_head_dim=s.head_dim,
                     intermediate=s.intermediate_size, vocab=s.vocab_words + 50, dtype=s.dtype, kv_dtype=s.dtype,
                     max_context=s.max_position_embeddings)


def names() -> list[str]:
    return [*CATALOG, "tiny-local"]


#: Hugging Face ids of the catalog's models, as a deploy config's ``model.id`` names them (infra/config.py).
HF_IDS = {"Qwen/Qwen3-32B": "Qwen3-32B", "Qwen/Qwen3-8B": "Qwen3-8B",
          "meta-llama/Llama-3.3-70B-Instruct": "Llama-3.3-70B-Instruct", "zai-org/GLM-5-FP8": "GLM-5-FP8",
          "meta-llama/Llama-3.1-405B-Instruct": "Llama-3.1-405B-Instruct",
          "meta-llama/Llama-2-7b-hf": "Llama-2-7B", "meta-llama/Llama-2-70b-hf": "Llama-2-70B"}


def catalog_name(spec: str) -> str | None:
    """The catalog name ``spec`` means, as the deploy path names models: a catalog name, a Hugging Face id
    (``Qwen/Qwen3-32B``) or a served name (``qwen3-32b``), any case; None when it names none."""
    wanted = spec.strip().lower()
    by_lower = {n.lower(): n for n in names()} | {k.lower(): v for k, v in HF_IDS.items()}
    if wanted in by_lower:
        return by_lower[wanted]
    tail = wanted.rsplit("/", 1)[-1]  # an org we do not list, or a served name with a prefix
    return by_lower.get(tail) if "/" in wanted and not wanted.endswith(".json") else None


def load(spec: str) -> ModelArch:
    """A catalog name (or its Hugging Face id or served name, any case), ``tiny-local``, or a path to a
    config.json (or a folder holding one)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            return from_config(json.loads(path.read_text()), name=path.parent.name or path.stem)
        except json.JSONDecodeError as exc:
            raise ModelError(f"{path}: not JSON ({exc})") from None
    name = catalog_name(spec)
    if name == "tiny-local":
        return tiny_local()
    if name is not None:
        return CATALOG[name]
    if spec.endswith(".json") or spec.startswith((".", "/", "~")) or Path(spec).expanduser().is_dir():
        raise ModelError(f"--model {spec}: no such file (give the path of a Hugging Face config.json, or the "
                         f"folder holding it)")
    raise ModelError(f"unknown model {spec!r}: use one of {', '.join(names())}, their Hugging Face ids "
                     f"({', '.join(HF_IDS)}), or a config.json path")
