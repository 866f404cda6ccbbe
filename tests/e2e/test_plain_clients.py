"""Reuse for clients that send no turnkv field: the official openai SDK against the router on real vLLM CPU
engines (1 prefill + 1 decode, two tenants). Every pull is proven by the prefill engine's
``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`` counter, and every answer equals the
answer with reuse off. The stack is the package's, reached through its router with API keys (conftest.py)."""

from __future__ import annotations

import pytest
from openai import OpenAI

from tests.e2e import ACME, GLOBEX
from tests.e2e.client import OFF, OUTCOME, PREFILL_CACHED, REUSED, check_turns, metric, pulled_tokens, words

pytestmark = pytest.mark.engines
ROUTER = "router-keyed"  # the clients send API keys (conftest.py)

BLOCK = 128

# Opens every reply with a reasoning block in the generation prompt and renders earlier assistant turns
# without it, as Qwen3's template drops earlier turns' <think> blocks: the text history the client sends
# back is exact, but the tokens of the previous reply differ from what decode holds.
THINK_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' + (m['content'] or '').split('</think>')[-1] + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}"
)


def sdk(stack, key=ACME) -> OpenAI:
    return OpenAI(base_url=stack["router"] + "/v1", api_key=key, max_retries=0, timeout=120)


def ask(client: OpenAI, messages, *, stream=False, max_tokens=16, **extra):
    """One turn as an SDK user writes it: the reply message to append, its text, and the HTTP headers."""
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=messages, temperature=0,
                                                           max_tokens=max_tokens, stream=stream, **extra)
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
        return {"role": "assistant", "content": text}, text, raw.headers
    message = raw.parse().choices[0].message
    return message, message.content or "", raw.headers


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_the_openai_sdk_with_no_id_reuses_from_turn_two(stack, stream):
    client, model_dir = sdk(stack), stack["model_dir"]
    messages = [{"role": "system", "content": words(model_dir, 200, 300 + stream)},
                {"role": "user", "content": words(model_dir, 400, 310 + stream)}]

    def turn(history, *, stream, headers=None):
        return ask(client, history, stream=stream, extra_headers=headers)

    check_turns(stack, turn, first=messages, stream=stream,
                follow=lambda h, reply, n: [*h, reply, {"role": "user", "content": words(model_dir, 100, 320 + n)}])


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_the_sdks_usage_counts_the_prompt_tokens_prefill_did_not_compute_as_cached(stack, stream):
    """issue #47 item 2: ``usage.prompt_tokens_details.cached_tokens`` is what cost trackers and SDK users read;
    the router writes there what the headers say (pulled plus prefix-cached), and its outcome under ``turnkv``."""
    client, model_dir = sdk(stack), stack["model_dir"]
    messages = [{"role": "user", "content": words(model_dir, 600, 360 + stream)}]
    reply, _, _ = ask(client, messages)
    history = [*messages, reply, {"role": "user", "content": words(model_dir, 50, 362 + stream)}]
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=history, temperature=0, max_tokens=8, stream=stream,
        **({"stream_options": {"include_usage": True}} if stream else {}))
    usage = [c.usage for c in raw.parse() if c.usage][-1] if stream else raw.parse().usage
    headers = raw.headers
    cached = usage.prompt_tokens_details.cached_tokens
    print(f"turn 2: {headers[OUTCOME]} cached_tokens={cached} of {usage.prompt_tokens}")  # the figures (-s)
    assert headers[OUTCOME] == "hit" and cached == int(headers[REUSED]) + int(headers[PREFILL_CACHED]) > 600
    assert usage.model_extra["turnkv"] == {"reuse_outcome": "hit", "reused_tokens": int(headers[REUSED]),
                                           "prefill_cached_tokens": int(headers[PREFILL_CACHED])}


def test_an_edited_history_misses_and_answers_correctly(stack):
    client, model_dir = sdk(stack), stack["model_dir"]
    messages = [{"role": "user", "content": words(model_dir, 500, 330)}]
    reply, _, _ = ask(client, messages)
    edited = [{"role": "user", "content": words(model_dir, 500, 331)}, reply,
              {"role": "user", "content": words(model_dir, 50, 332)}]
    before = pulled_tokens(stack)
    _, text, headers = ask(client, edited)
    assert headers[OUTCOME] == "miss" and pulled_tokens(stack) == before
    assert text == ask(client, edited, extra_headers=OFF)[1]
    # the untouched history still finds its turn
    _, _, headers = ask(client, [*messages, reply, {"role": "user", "content": "go on"}])
    assert headers[OUTCOME] == "hit" and pulled_tokens(stack) > before


def test_a_template_that_strips_reasoning_pulls_only_the_proven_prefix(stack):
    client, model_dir = sdk(stack), stack["model_dir"]
    template = {"extra_body": {"chat_template": THINK_TEMPLATE}}
    messages = [{"role": "user", "content": words(model_dir, 700, 340)}]
    reply, _, _ = ask(client, messages, **template)
    messages = [*messages, reply, {"role": "user", "content": words(model_dir, 100, 341)}]
    mismatches = metric(stack["prefill-0"], "vllm:turnkv_proof_mismatches_total")
    before = pulled_tokens(stack)
    _, text, headers = ask(client, messages, **template)
    moved = pulled_tokens(stack) - before
    # the router found the turn; decode's token proof cut the pull at the first block that differs
    assert headers[OUTCOME] == "token_mismatch", headers[OUTCOME]
    assert int(headers[REUSED]) == moved >= 512 and moved % BLOCK == 0
    assert metric(stack["prefill-0"], "vllm:turnkv_proof_mismatches_total") == mismatches + 1
    assert text == ask(client, messages, extra_headers=OFF, **template)[1]


def test_forks_one_branch_pulls_the_other_recomputes_at_the_default_fork_window(stack):
    client, model_dir = sdk(stack), stack["model_dir"]
    messages = [{"role": "user", "content": words(model_dir, 600, 360)}]
    reply, _, _ = ask(client, messages)
    branches = [[*messages, reply, {"role": "user", "content": words(model_dir, 40, 361 + i)}] for i in range(2)]
    results = []
    for branch in branches:
        before = pulled_tokens(stack)
        _, text, headers = ask(client, branch)
        results.append((headers[OUTCOME], pulled_tokens(stack) - before, int(headers[REUSED])))
        assert text == ask(client, branch, extra_headers=OFF)[1]
    # fork_window 0 (the default): single use; tests/e2e/test_forks.py runs forks with a window
    (first, first_moved, first_reused), (second, second_moved, second_reused) = results
    assert first == "hit" and first_reused == first_moved > 600
    assert second == "miss" and second_reused == second_moved == 0


def test_two_tenants_with_identical_histories_never_share(stack):
    acme, globex, model_dir = sdk(stack, ACME), sdk(stack, GLOBEX), stack["model_dir"]
    messages = [{"role": "user", "content": words(model_dir, 500, 370)}]
    reply, _, _ = ask(acme, messages)
    follow = [*messages, {"role": "assistant", "content": reply.content}, {"role": "user", "content": "more"}]
    before = pulled_tokens(stack)
    _, text, headers = ask(globex, follow)
    assert headers[OUTCOME] == "miss" and pulled_tokens(stack) == before
    assert text == ask(globex, follow, extra_headers=OFF)[1]
    _, _, headers = ask(acme, follow)
    assert headers[OUTCOME] == "hit" and pulled_tokens(stack) > before


def test_the_readmes_python_snippet_reuses_from_turn_two(stack, capsys):
    """README.md's snippet, run as written (its URL and key aside): turn 2 ended in token_mismatch with 0 reused
    tokens, and its loop never sent the last question (issue #49). Three short turns on the package's stack."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    code = readme.split("```python\n", 1)[1].split("```", 1)[0]
    code = code.replace('"http://127.0.0.1:8000/v1"', repr(stack["router"] + "/v1"))
    exec(code.replace('"unused-when-open"', repr(ACME)), {})
    printed = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert [outcome for outcome, _ in printed] == ["none", "hit", "hit"], printed
    assert all(int(reused) > 0 for _, reused in printed[1:]), printed
