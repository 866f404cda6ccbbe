"""A tiny Llama-style model made on this machine: config, tokenizer and chat template, no network.

The weights are random (seeded, initializer range 0.02 as in Hugging Face's Llama init), written
once as safetensors (~21 MB). Output is gibberish, but greedy decoding is deterministic and depends
on the whole context: misplaced KV changes the answer, which is what the reuse tests rely on (vLLM's
``--load-format dummy`` weights are so small that the output barely depends on the prompt). Prefill
costs real compute, which is what KV reuse saves.

The tokenizer is a word-level vocabulary trained with the ``tokenizers`` library on a deterministic
synthetic corpus. Word-level (each word, digit and punctuation mark one token) keeps one property
byte-level BPE lacks: any sequence the model generates re-tokenizes to the same ids when a client
sends the reply back as text. That keeps the spine's text-level history guard sound; the token proof
of the connector is what makes reuse safe with real BPE tokenizers.
"""

from __future__ import annotations

import hashlib
import json
import random
import string
from dataclasses import asdict, dataclass
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>")
PUNCTUATION = tuple(".,;:!?'\"()[]{}-_/*+=<>@#$%&|~`^\\")
# Role names and a few common words, so chat templates and hand-typed prompts mostly avoid <unk>.
COMMON_WORDS = tuple(
    """
    system user assistant tool function call result you are a an the of and to in is it that for on with
    as this be at by from or not what which who how why when where can will do does did have has had i
    we they he she my your our their please answer question tell me about explain write code file run
    test error hello hi thanks yes no ok step next previous turn agent task plan search read open list
    show fix
    """.split()  # noqa: SIM905
)

# ChatML, the template most chat models use. A trailing space-free layout keeps assistant turns
# rendered in history exactly as they were generated after the generation prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of the tiny model. Defaults make a ~4k-token prefill take ~1.5 s on 2 cores."""

    num_hidden_layers: int = 4
    hidden_size: int = 512
    intermediate_size: int = 1024
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 64
    max_position_embeddings: int = 8192
    vocab_words: int = 1200
    initializer_range: float = 0.02
    #: float32, not bfloat16: decode computes a reply's KV one token at a time, prefill in one batch; in
    #: bfloat16 the two differ enough to flip greedy near-ties, so reuse-on and reuse-off answers could
    #: differ for reasons that have nothing to do with KV transfer.
    dtype: str = "float32"
    seed: int = 20261129

    @property
    def fingerprint(self) -> str:
        blob = json.dumps([asdict(self), CHAT_TEMPLATE, COMMON_WORDS, PUNCTUATION, SPECIAL_TOKENS, "no-special-out"])
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def make_words(count: int, seed: int) -> list[str]:
    """Deterministic pronounceable pseudo-words ("tavelo", "min", ...), all distinct."""
    rng = random.Random(seed)
    consonants, vowels = "bcdfghjklmnprstvwz", "aeiou"
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < count:
        syllables = rng.choice((1, 1, 2, 2, 2, 3))
        word = "".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(syllables))
        if rng.random() < 0.3:
            word += rng.choice(consonants)
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


def _train_tokenizer(words: list[str]):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation("isolated"), pre_tokenizers.Digits(True)]
    )
    trainer = trainers.WordLevelTrainer(
        vocab_size=len(words) + len(PUNCTUATION) + 10 + len(SPECIAL_TOKENS),
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
    )
    corpus = [" ".join(words), " ".join(PUNCTUATION), " ".join(string.digits)]
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return tokenizer


def build(directory: Path, spec: ModelSpec | None = None) -> Path:
    """Write config, tokenizer and template into ``directory`` unless an identical build is there."""
    spec = spec or ModelSpec()
    stamp = directory / ".turnkv-model"
    if stamp.exists() and stamp.read_text().strip() == spec.fingerprint:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    words = list(COMMON_WORDS) + [w for w in make_words(spec.vocab_words, spec.seed) if w not in COMMON_WORDS]
    tokenizer = _train_tokenizer(words)
    tokenizer.save(str(directory / "tokenizer.json"))
    vocab_size = tokenizer.get_vocab_size()
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": vocab_size,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "tie_word_embeddings": False,
        "initializer_range": spec.initializer_range,
        "torch_dtype": spec.dtype,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": spec.max_position_embeddings,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<unk>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (directory / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": "<unk>"}, indent=2))
    (directory / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"]}, indent=2))
    (directory / "words.txt").write_text("\n".join(words) + "\n")
    _write_weights(directory, spec)
    stamp.write_text(spec.fingerprint + "\n")
    return directory


def _write_weights(directory: Path, spec: ModelSpec) -> None:
    """Seeded random weights (needs torch + transformers: the engines extra)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(LlamaConfig.from_pretrained(str(directory))).to(getattr(torch, spec.dtype))
    # Zero output rows for the special tokens: their logit is then 0 while the best of ~1,300 random
    # logits is well above 0, so greedy decoding never emits one. A reply therefore always runs to
    # max_tokens (predictable prompt growth), and never holds a token that vanishes when the client
    # sends the reply back as text (special tokens are skipped in detokenization).
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    special_ids = [t["id"] for t in tokenizer["added_tokens"]]
    with torch.no_grad():
        model.lm_head.weight[special_ids] = 0
    model.save_pretrained(str(directory), safe_serialization=True)


def load_words(directory: Path) -> list[str]:
    """The vocabulary's words, for workloads that should tokenize without <unk>."""
    return (directory / "words.txt").read_text().split()
