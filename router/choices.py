"""How many sequences a request asks decode for, and how the router serves it (pure, no I/O).

One P/D pair carries the KV of one engine request: prefill answers with that request's ``kv_transfer_params`` and
decode reads those blocks once. vLLM answers a request of several sequences with the params of one of them only:

- ``n > 1`` (and beam search, and ``best_of``, which some vLLM versions run): decode's n children would all read
  one prefill child's blocks, which prefill frees at the first read notification;
- a ``/v1/completions`` list of prompts (strings, or token-id lists; a flat list of ints is one prompt in token
  form): prefill returns prompt 0's params, so decode would read prompt 0's blocks for every prompt.

Either way decode would answer from the wrong KV. So such a request is never sent as one P/D pair:

- a list of prompts with ``n == 1``: one P/D pair per prompt, the answers merged back into vLLM's answer to the list
  (``router.merge``, ``router.fanout``): P/D keeps serving the prompts;
- any other request of several sequences: decode alone, which computes the prompt itself (no ``kv_transfer_params``):
  the same request an engine without P/D would get, so the same answer.

The sequences a request asks for (``choices``: n x prompts) are what it holds of the decode pool's fair share
(``decode_fair_sequences``) and what ``max_choices`` bounds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from router.outcomes import RequestKind


class Serving(StrEnum):
    """How a request goes to the engines (the ``served`` label of ``turnkv_router_several_sequences``)."""

    PD = "pd"  # one P/D pair: one sequence of one prompt (multi-turn reuse applies)
    DECODE_ALONE = "decode_alone"  # decode computes the prompt itself: no prefill leg, no kv_transfer_params
    PER_PROMPT = "per_prompt"  # one P/D pair per prompt, answers merged


@dataclass(frozen=True)
class Plan:
    serving: Serving
    #: Sequences decode runs for the request (n x prompts): its units of the decode pool, what max_choices bounds.
    choices: int
    n: int
    prompts: int
    #: PER_PROMPT: the prompts, one P/D pair each.
    split: tuple[Any, ...] = ()


ONE = Plan(Serving.PD, 1, 1, 1)


def prompt_list(prompt: Any) -> list[Any] | None:
    """The prompts of a completion's ``prompt`` when it is a list of prompts (all strings, or all token-id lists);
    None when it is one prompt (a string, a flat list of token ids) or a mixed list (which vLLM refuses)."""
    if not isinstance(prompt, list) or not prompt:
        return None
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        return prompt
    return None


def _embeds(body: Mapping[str, Any]) -> int:
    """Prompts given as embeddings (vLLM's ``prompt_embeds``: one base64 tensor, or a list of them)."""
    embeds = body.get("prompt_embeds")
    if embeds is None:
        return 0
    return len(embeds) if isinstance(embeds, list) else 1


def plan(kind: RequestKind, body: Mapping[str, Any]) -> Plan:
    """How ``body`` is served and how many sequences it asks for (types already checked: ``router.intake``)."""
    n = body.get("n") or 1  # 0 is the engine's to refuse
    several = n > 1 or bool(body.get("use_beam_search")) or (body.get("best_of") or 1) > 1
    if kind == RequestKind.CHAT:
        return Plan(Serving.DECODE_ALONE, n, n, 1) if several else ONE
    listed = prompt_list(body.get("prompt"))
    embeds = _embeds(body)
    prompts = (len(listed) if listed else 1 if body.get("prompt") is not None else 0) + embeds
    prompts = max(1, prompts)
    if several or (embeds and prompts > 1):
        return Plan(Serving.DECODE_ALONE, n * prompts, n, prompts)
    if listed and len(listed) > 1:
        return Plan(Serving.PER_PROMPT, prompts, 1, prompts, tuple(listed))
    return ONE


def sub_body(body: Mapping[str, Any], prompt: Any) -> dict[str, Any]:
    """The request for one prompt of a list: the client's, with that prompt alone."""
    return {**body, "prompt": prompt}


def prompt_tokens(prompt: Any) -> int:
    """The router's estimate of a prompt's tokens (its fair-share and load accounting): ids counted, text / 4."""
    return len(prompt) if isinstance(prompt, list) else len(str(prompt)) // 4
