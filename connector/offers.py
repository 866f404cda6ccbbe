"""Signed offers on the engine side: the model fingerprint and prefill's replay guard (no vLLM imports).

The signature itself is ``turnkv.wire`` (shared with the router's docs and tests). Here:
- ``model_fields``: what of an engine's vLLM config makes its KV interchangeable with a peer's;
- ``ReplayGuard``: an offer is read at most once by a prefill engine (decode frees the blocks on the
  first read, so a second read of the same offer would get whatever the blocks hold next).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any


def model_fields(vllm_config: Any) -> dict[str, Any]:
    """Model identity from a vLLM config: name, revision, dtype, architecture and KV layout."""
    model = getattr(vllm_config, "model_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    hf = getattr(model, "hf_config", None)
    fields: dict[str, Any] = {}
    for name in ("model", "revision", "tokenizer", "tokenizer_revision", "dtype", "quantization"):
        fields[name] = str(getattr(model, name, None))
    for name in ("architectures", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "vocab_size", "_name_or_path"):
        value = getattr(hf, name, None)
        fields["hf." + name] = value if isinstance(value, (int, str, list, tuple)) or value is None else str(value)
    fields["kv_cache_dtype"] = str(getattr(cache, "cache_dtype", None))
    return fields


class ReplayGuard:
    """Signatures of offers this engine already read, until they expire (bounded, oldest dropped first)."""

    def __init__(self, max_entries: int = 100_000, clock: Callable[[], float] = time.time) -> None:
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._max = max_entries
        self._clock = clock

    def __len__(self) -> int:
        return len(self._seen)

    def first_use(self, signature: str, expires_at: float) -> bool:
        """True the first time a live ``signature`` is seen (and remember it); False for a replay."""
        now = self._clock()
        while self._seen:
            oldest_sig, oldest_exp = next(iter(self._seen.items()))
            if oldest_exp > now and len(self._seen) < self._max:
                break
            del self._seen[oldest_sig]
        if signature in self._seen:
            return False
        self._seen[signature] = expires_at
        return True
