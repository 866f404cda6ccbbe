"""Requests of several sequences through the router on real vLLM CPU engines (issue #50; router.choices).

One P/D pair carries one engine request's KV. Sent as one pair, ``n > 1`` had its children read one prefill child's
blocks (prefill frees them at the first read) and a list of prompts had prompts 1 and 2 read prompt 0's: HTTP 200,
other answers than the same prompts sent alone. Now ``n > 1`` goes to decode alone and a list of prompts is one P/D
pair per prompt: every answer equals the same request sent to an engine without P/D (greedy prompts exactly; sampled
children with the same seeds), and each prompt's answer equals that prompt sent alone through the router with reuse off.
The package's stack (1 prefill + 1 decode, its open router)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import requests

from tests.e2e.client import OFF, metric, words

pytestmark = pytest.mark.engines

#: Requests the prefill engine has finished (each leg is one; a leg of n children counts n).
FINISHED = "vllm:request_success_total"
#: What prefill logs when a decode worker reads blocks of a request it no longer holds (NixlConnector): what the n
#: children of one P/D pair did, reading blocks prefill had freed at the first child's read.
INVALID_READ = "Potentially invalid KV blocks for unrecognized request"


def post(url: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> dict[str, Any]:
    """An answer as one object: the body, or a stream folded into one (choices by index: text and token ids
    concatenated, the last finish_reason; the usage chunk's usage), with the count of ``[DONE]`` and of ids."""
    stream = bool(body.get("stream"))
    resp = requests.post(f"{url}{path}", json=body, headers=headers or {}, timeout=300, stream=stream)
    assert resp.status_code == 200, resp.text
    if not stream:
        return resp.json()
    choices: dict[int, dict[str, Any]] = {}
    folded: dict[str, Any] = {"done": 0, "ids": set(), "usage": None}
    for line in resp.iter_lines():
        if not line.startswith(b"data: "):
            continue
        if line == b"data: [DONE]":
            folded["done"] += 1
            continue
        event = json.loads(line[6:])
        assert "error" not in event, event
        folded["ids"].add(event["id"])
        if event.get("usage") and not event.get("choices"):
            folded["usage"] = event["usage"]
        for c in event.get("choices") or ():
            slot = choices.setdefault(c["index"], {"index": c["index"], "text": "", "token_ids": []})
            slot["text"] += c.get("text") or (c.get("delta") or {}).get("content") or ""
            slot["token_ids"] += c.get("token_ids") or []
            slot["finish_reason"] = c.get("finish_reason") or slot.get("finish_reason")
    folded["choices"] = [choices[i] for i in sorted(choices)]
    return folded


def text_of(choice: dict[str, Any]) -> str:
    return choice["message"]["content"] if "message" in choice else choice["text"]


def answers(answer: dict[str, Any]) -> list[tuple[int, str, list[int]]]:
    return [(c["index"], text_of(c), c["token_ids"]) for c in answer["choices"]]


def prefill_legs(stack) -> float:
    return metric(stack["prefill-0"], FINISHED)


def invalid_reads(stack) -> int:
    """Reads of blocks prefill no longer held, as its log counts them so far."""
    return (stack["state_dir"] / "logs" / "prefill-0.log").read_text(errors="replace").count(INVALID_READ)


def single(body: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """The request for one sequence, not streamed."""
    out = {**body, "stream": False, **changes}
    out.pop("stream_options", None)
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_chat_with_n_answers_as_the_engine_alone_child_by_child(stack, n, stream):
    """vLLM 0.32 samples n > 1 only (greedy is refused), child i with seed + i: each child is the engine's own answer
    to the prompt alone with that seed."""
    messages = [{"role": "user", "content": words(stack["model_dir"], 300, 950 + n)}]
    seed = 100 + n
    body = {"model": "tiny", "messages": messages, "max_tokens": 24, "temperature": 1.0, "seed": seed,
            "return_token_ids": True, "n": n, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})}
    before, invalid = prefill_legs(stack), invalid_reads(stack)
    routed = post(stack["router"], "/v1/chat/completions", body)
    legs = prefill_legs(stack) - before
    alone = post(stack["decode-0"], "/v1/chat/completions", body)  # the same request, no P/D
    assert answers(routed) == answers(alone) and [c["index"] for c in routed["choices"]] == list(range(n))
    for i in range(n):
        one = post(stack["decode-0"], "/v1/chat/completions", single(body, n=1, seed=seed + i))
        assert answers(routed)[i] == (i, *answers(one)[0][1:]), f"child {i} is the prompt alone with seed + {i}"
    assert legs == 0, "no prefill leg: its one request's KV cannot serve n children"
    assert invalid_reads(stack) == invalid, "no child read blocks prefill had freed"
    if stream:
        assert routed["done"] == 1 and len(routed["ids"]) == 1
        assert routed["usage"]["completion_tokens"] == alone["usage"]["completion_tokens"]


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("form", ["text", "token_ids"])
def test_a_list_of_three_prompts_answers_as_the_engine_alone(stack, form, stream):
    """One P/D pair per prompt (three prefill legs), merged into vLLM's own answer to the list: each choice, by index,
    and the usage."""
    texts = [words(stack["model_dir"], size, 970 + i) for i, size in enumerate((260, 180, 340))]
    if form == "text":
        prompts: list[Any] = texts
    else:  # token form: the prompts as the engine tokenises them
        prompts = [requests.post(f"{stack['decode-0']}/tokenize", json={"model": "tiny", "prompt": t},
                                 timeout=60).json()["tokens"] for t in texts]
    body = {"model": "tiny", "prompt": prompts, "max_tokens": 20, "temperature": 0, "return_token_ids": True,
            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
    before, invalid = prefill_legs(stack), invalid_reads(stack)
    routed = post(stack["router"], "/v1/completions", body)
    legs = prefill_legs(stack) - before
    alone = post(stack["decode-0"], "/v1/completions", body)
    assert answers(routed) == answers(alone) and [c["index"] for c in routed["choices"]] == [0, 1, 2]
    assert legs == 3, "one prefill leg per prompt"
    assert invalid_reads(stack) == invalid
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert routed["usage"][key] == alone["usage"][key]
    for i, prompt in enumerate(prompts):
        one = post(stack["router"], "/v1/completions", single(body, prompt=prompt), OFF)  # P/D, reuse off
        assert (text_of(one["choices"][0]), one["choices"][0]["token_ids"]) == answers(routed)[i][1:]
    if stream:
        assert routed["done"] == 1 and len(routed["ids"]) == 1
    else:
        assert "kv_transfer_params" not in routed
