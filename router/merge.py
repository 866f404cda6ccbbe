"""A list of prompts answered one P/D pair per prompt, merged back into the answer vLLM gives the list (pure, no I/O).

vLLM (``OpenAIServingCompletion``, 0.32) answers a list of k prompts as one completion: one ``id`` and ``created``,
choice ``index`` ``prompt * n + child`` (n is 1 here: ``router.choices`` splits only then), ``usage`` summed over the
prompts (``prompt_tokens_details`` of the last prompt, unary; of the first output to arrive, streamed), no per-request
``metrics`` (they describe one generation). Streamed, the prompts' chunks interleave as they come, each prompt's usage
chunk is one summed chunk at the end (when asked for), then one ``[DONE]``. The answers of the k requests for one
prompt each are rewritten into exactly that.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

USAGE_SUMS = ("prompt_tokens", "completion_tokens", "total_tokens")


def summed_usage(usages: Sequence[Mapping[str, Any] | None], details: Mapping[str, Any] | None) -> dict[str, Any]:
    """The usage of all prompts: token counts summed, in the first usage's key order; ``prompt_tokens_details``
    from ``details`` (the usage vLLM takes it from), when that has it."""
    present = [u for u in usages if isinstance(u, Mapping)]
    out: dict[str, Any] = dict(present[0]) if present else {}
    for key in USAGE_SUMS:
        out[key] = sum(int(u.get(key) or 0) for u in present)
    out.pop("prompt_tokens_details", None)
    if isinstance(details, Mapping) and details.get("prompt_tokens_details") is not None:
        out["prompt_tokens_details"] = details["prompt_tokens_details"]
    return out


def unary(answers: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One answer to the list from the answers to its prompts, in order (``kv_transfer_params`` already taken off)."""
    out = dict(answers[0])
    choices: list[Any] = []
    for answer in answers:
        for choice in answer.get("choices") or ():
            choices.append({**choice, "index": len(choices)} if isinstance(choice, Mapping) else choice)
    out["choices"] = choices
    if any(isinstance(a.get("usage"), Mapping) for a in answers):
        out["usage"] = summed_usage([a.get("usage") for a in answers], answers[-1].get("usage"))
    if out.get("metrics") is not None:
        out["metrics"] = None  # vLLM: per-request metrics are not given for several prompts
    return out


class StreamMerge:
    """The client's stream from the prompts' streams: ``chunk`` rewrites one prompt's event, ``end`` closes it."""

    def __init__(self, prompts: int) -> None:
        self.head: tuple[Any, Any] | None = None  # id, created of the client's stream (the first chunk's)
        self.usage: list[dict[str, Any] | None] = [None] * prompts
        self.first: int | None = None  # the prompt whose output came first (vLLM reads cached tokens from it)

    def chunk(self, prompt: int, event: dict[str, Any]) -> bytes | None:
        """Prompt ``prompt``'s event as the client's (None: a usage-only chunk, summed into the end)."""
        if not event.get("choices") and event.get("usage") is not None:
            self.usage[prompt] = event
            return None
        if self.head is None:
            self.head = (event.get("id"), event.get("created"))
        if self.first is None:
            self.first = prompt
        if "id" in event:
            event["id"] = self.head[0]
        if "created" in event:
            event["created"] = self.head[1]
        for choice in event.get("choices") or ():
            if isinstance(choice, dict):
                choice["index"] = prompt
        return b"data: " + orjson.dumps(event) + b"\n\n"

    def end(self) -> bytes:
        """The summed usage chunk (when the prompts' streams carried one), then ``[DONE]``."""
        sent = [u for u in self.usage if u is not None]
        if not sent:
            return b"data: [DONE]\n\n"
        first = self.usage[self.first] if self.first is not None and self.usage[self.first] else sent[0]
        out = dict(sent[0])
        if self.head is not None:
            out["id"], out["created"] = self.head
        out["usage"] = summed_usage([u.get("usage") for u in sent], first.get("usage"))
        out.pop("metrics", None)  # vLLM: per-request metrics are not given for several prompts
        return b"data: " + orjson.dumps(out) + b"\n\ndata: [DONE]\n\n"
