"""turnkv.plan.architectures: parameter counts and KV bytes agree with what the model makers publish."""

from dataclasses import replace

import pytest

from turnkv.local.model import ModelSpec
from turnkv.plan.architectures import CATALOG, ModelError, from_config, load, tiny_local

QWEN3_32B_CONFIG = {  # Qwen/Qwen3-32B config.json (fields the planner reads)
    "architectures": ["Qwen3ForCausalLM"], "hidden_size": 5120, "intermediate_size": 25600,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 64,
    "vocab_size": 151936, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "max_position_embeddings": 40960,
}


@pytest.mark.parametrize("name,total,active", [
    ("Qwen3-32B", 32.8e9, 32.8e9),  # "Number of Parameters: 32.8B"
    ("Qwen3-8B", 8.2e9, 8.2e9),  # "Number of Parameters: 8.2B"
    ("Llama-3.3-70B-Instruct", 70.6e9, 70.6e9),
    ("GLM-5-FP8", 744e9, 40e9),  # "744B parameters (40B active)"
])
def test_parameter_counts_match_the_published_ones(name, total, active):
    m = CATALOG[name]
    assert m.total_params() == pytest.approx(total, rel=0.02)
    assert m.active_params() == pytest.approx(active, rel=0.05)


def test_kv_bytes_gqa_and_mla():
    qwen = CATALOG["Qwen3-32B"]
    assert qwen.kv_bytes_per_token() == 2 * 64 * 8 * 128 * 2  # 256 KiB: K and V, 8 heads, bf16
    assert qwen.kv_bytes_per_token_rank(8) == qwen.kv_bytes_per_token() / 8  # one KV head per rank
    assert qwen.kv_bytes_per_token_rank(16) == qwen.kv_bytes_per_token() / 8  # replicated past 8 ranks
    glm = CATALOG["GLM-5-FP8"]
    assert glm.kv_bytes_per_token_layer() == 656 + 132  # vLLM fp8_ds_mla + the indexer's fp8 keys
    assert glm.kv_bytes_per_token_rank(8) == glm.kv_bytes_per_token()  # MLA latent on every rank


def test_attention_grows_with_context_and_dsa_caps_it():
    qwen, glm = CATALOG["Qwen3-32B"], CATALOG["GLM-5-FP8"]
    assert qwen.attention_flops(100, 20_000) > 10 * qwen.attention_flops(100, 1_000)
    # past index_topk keys, DSA attends to 2,048 keys per query; only its small indexer sees every key
    dense = replace(glm, index_topk=0)
    assert glm.attention_flops(100, 40_000) < 0.25 * dense.attention_flops(100, 40_000)
    assert glm.attention_flops(100, 1_000) == pytest.approx(dense.attention_flops(100, 1_000), rel=0.15)


def test_config_json_reads_like_the_catalog(tmp_path):
    m = from_config(QWEN3_32B_CONFIG, "Qwen3-32B")
    assert m == CATALOG["Qwen3-32B"]
    (tmp_path / "config.json").write_text(__import__("json").dumps(QWEN3_32B_CONFIG))
    assert load(str(tmp_path)).kv_bytes_per_token() == m.kv_bytes_per_token()
    with pytest.raises(ModelError, match="unknown model 'nope'"):
        load("nope")
    with pytest.raises(ModelError, match="num_hidden_layers"):
        from_config({"hidden_size": 8, "num_attention_heads": 2})


def test_tiny_local_is_the_local_stack_model():
    spec, m = ModelSpec(), tiny_local()
    assert (m.layers, m.hidden, m.kv_heads, m.head_dim, m.dtype) == (
        spec.num_hidden_layers, spec.hidden_size, spec.num_key_value_heads, spec.head_dim, spec.dtype)
    assert m.kv_bytes_per_token() == 4 * 2 * 4 * 64 * 4  # 8 KiB per token in float32
