"""Each A/B arm's name and definition, once (pure data): tables, legends, charts and headlines read them here.
A module of its own, importing nothing: ``bench.report`` reads them, and ``bench.arms`` (which imports
``bench.capacity``, which imports ``bench.report``) could not hold them without an import cycle."""

from __future__ import annotations

#: Each arm's name in tables, charts and headlines, and its definition where it first appears (one source).
LABELS = {"off": "no prefix cache", "peer": "peer-best", "on": "turnkv as deployed", "best": "best case"}
MEANINGS = {
    "off": "reuse off and a fresh cache_salt on every request: prefill recomputes every prompt",
    "peer": "what you would run instead of turnkv: prefill prefix caching on (and the offload tier's memory as more "
            "prefix cache), prefix-aware prefill choice, no reuse from decode",
    "on": "prefill prefix caching on, decode retains each turn, prefill pulls it back",
    "best": "a prefill whose prefix cache holds the previous turn's prompt, which no busy fleet guarantees",
}
