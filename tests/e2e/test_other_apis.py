"""The other APIs agents speak, on real vLLM CPU engines (1 prefill + 1 decode): the official openai SDK's
``responses.create`` and the official anthropic SDK's ``messages`` (translated to chat completions at the
router), and tool-call round trips (the assistant message with its calls, then the tool's result) through
all three APIs. Every pull is proven by the prefill engine's
``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`` counter, and every answer equals the
answer with reuse off. The stack is the package's, reached through its router with API keys (conftest.py)."""

from __future__ import annotations

import pytest
from anthropic import Anthropic
from openai import OpenAI

from tests.e2e import ACME as KEY
from tests.e2e.client import OFF, OUTCOME, PREFILL_CACHED, REUSED, check_turns, pulled_tokens, words

pytestmark = pytest.mark.engines
ROUTER = "router-keyed"  # the clients send API keys (conftest.py)


# The tiny model's template renders no tool calls; this one renders an assistant's calls as the JSON of their
# arguments (what the model generated under the forced tool choice), so the history sent back is the tokens
# decode holds. A tool that takes no argument: the only valid call is "{}", two tokens of the tiny vocabulary.
TOOL_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') }}"
    "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}{{ c['function']['arguments'] | tojson }}{% endfor %}"
    "{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PARAMS = {"type": "object", "properties": {}, "additionalProperties": False}


def openai_sdk(stack) -> OpenAI:
    return OpenAI(base_url=stack["router"] + "/v1", api_key=KEY, max_retries=0, timeout=120)


def anthropic_sdk(stack) -> Anthropic:
    return Anthropic(base_url=stack["router"], api_key=KEY, max_retries=0, timeout=120)  # x-api-key


def respond(client: OpenAI, items, *, stream=False, headers=None, **extra):
    """One Responses turn as an SDK user writes it: the output items to append, the text, the headers."""
    raw = client.responses.with_raw_response.create(model="tiny", input=items, temperature=0, max_output_tokens=16,
                                                    stream=stream, store=False, extra_headers=headers, **extra)
    if stream:
        ends = [e for e in raw.parse() if e.type in ("response.completed", "response.incomplete")]
        assert len(ends) == 1
        response = ends[0].response
    else:
        response = raw.parse()
    return list(response.output), response.output_text, raw.headers, response.usage


def message(client: Anthropic, messages, *, stream=False, headers=None, extra_body=None, **extra):
    """One Messages turn as an SDK user writes it: the assistant message to append, the text, the headers.
    (anthropic 2.x's methods have no ``temperature`` argument: greedy decoding goes in the body.)"""
    body = {"temperature": 0, **(extra_body or {})}
    if stream:
        with client.messages.stream(model="tiny", max_tokens=16, messages=messages, extra_headers=headers,
                                    extra_body=body, **extra) as events:
            answer, found = events.get_final_message(), events.response.headers
    else:
        raw = client.messages.with_raw_response.create(model="tiny", max_tokens=16, messages=messages,
                                                       extra_headers=headers, extra_body=body, **extra)
        answer, found = raw.parse(), raw.headers
    text = "".join(b.text for b in answer.content if b.type == "text")
    return {"role": "assistant", "content": answer.content}, text, found, answer


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_the_openai_responses_sdk_reuses_from_turn_two(stack, stream):
    client, model_dir = openai_sdk(stack), stack["model_dir"]

    seen = []

    def turn(items, *, stream, headers=None):  # as stateless agents ask (Codex CLI, the Agents SDK with store=False)
        output, text, found, usage = respond(client, items, stream=stream, headers=headers,
                                             include=["reasoning.encrypted_content"])
        seen.append((found, usage))
        return output, text, found

    first = [{"role": "system", "content": words(model_dir, 200, 400 + stream)},
             {"role": "user", "content": words(model_dir, 400, 410 + stream)}]
    check_turns(stack, turn, first=first, stream=stream,  # input += response.output, as the SDK docs show
                follow=lambda h, out, n: [*h, *out, {"role": "user", "content": words(model_dir, 100, 420 + n)}])
    # Reuse in the Responses API's own field (issue #47 item 2): the tokens prefill did not compute.
    found, usage = seen[2]  # turn 2, reuse on (each turn also asks with reuse off)
    cached = usage.input_tokens_details.cached_tokens
    print(f"turn 2: {found[OUTCOME]} cached_tokens={cached} of {usage.input_tokens}")
    assert found[OUTCOME] == "hit" and cached == int(found[REUSED]) + int(found[PREFILL_CACHED]) > 600


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_responses_continued_by_previous_response_id_pull_and_answer_as_if_resent(stack, stream):
    """The Responses API's own multi-turn style: only the new input and previous_response_id (store defaults to
    true). Each later turn pulls what decode held, and answers as the whole conversation resent with reuse off."""
    client, model_dir = openai_sdk(stack), stack["model_dir"]
    instructions = words(model_dir, 200, 430 + stream)
    new = [{"role": "user", "content": words(model_dir, 400, 440 + stream)}]
    whole, previous_id, previous = list(new), None, 0
    for n in range(3):
        before = pulled_tokens(stack)
        raw = client.responses.with_raw_response.create(
            model="tiny", instructions=instructions, input=new, temperature=0, max_output_tokens=16, stream=stream,
            **({"previous_response_id": previous_id} if previous_id else {}))
        if stream:
            response = next(e for e in raw.parse() if e.type in ("response.completed", "response.incomplete")).response
        else:
            response = raw.parse()
        moved = pulled_tokens(stack) - before
        _, off, _, _ = respond(client, whole, stream=stream, headers=OFF, instructions=instructions)
        assert response.output_text and response.output_text == off, f"turn {n + 1}: not the resent answer"
        assert response.previous_response_id == previous_id and response.store
        outcome, reused = raw.headers[OUTCOME], int(raw.headers[REUSED])
        print(f"turn {n + 1}: {outcome} reused={reused} pulled={moved:.0f}")  # the figures (-s)
        if n == 0:
            assert outcome == "none" and moved == 0
        else:
            assert outcome == "hit" and reused == moved > max(600, previous + 100), (n, outcome, reused, moved)
            previous = moved
        new = [{"role": "user", "content": words(model_dir, 100, 450 + n)}]
        whole = [*whole, *response.output, *new]
        previous_id = response.id


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_the_anthropic_sdk_reuses_from_turn_two(stack, stream):
    client, model_dir = anthropic_sdk(stack), stack["model_dir"]

    def turn(messages, *, stream, headers=None):
        reply, text, found, _ = message(client, messages, stream=stream, headers=headers,
                                        system=words(model_dir, 200, 430 + stream))
        return reply, text, found

    first = [{"role": "user", "content": words(model_dir, 600, 440 + stream)}]
    check_turns(stack, turn, first=first, stream=stream,
                follow=lambda h, reply, n: [*h, reply, {"role": "user", "content": words(model_dir, 100, 450 + n)}])
    # Reuse in Anthropic's own fields (issue #47 item 2): what was read, not computed, is cache_read_input_tokens,
    # and input_tokens the rest, as Anthropic counts them (total input = input + cache read + cache creation).
    reply, _, found, answer = message(client, first, stream=stream, system=words(model_dir, 200, 430 + stream))
    second = [*first, reply, {"role": "user", "content": words(model_dir, 40, 459)}]
    _, _, found, answer = message(client, second, stream=stream, system=words(model_dir, 200, 430 + stream))
    read = answer.usage.cache_read_input_tokens
    print(f"turn 2: {found[OUTCOME]} cache_read_input_tokens={read} input_tokens={answer.usage.input_tokens}")
    assert found[OUTCOME] == "hit" and read == int(found[REUSED]) + int(found[PREFILL_CACHED]) > 600
    assert answer.usage.input_tokens > 0


def check_tool_turn(stack, second):
    """The turn that sends the calls and their results back pulls everything decode held, same answer."""
    before = pulled_tokens(stack)
    text, headers = second(None)
    moved = pulled_tokens(stack) - before
    print(f"tool turn: {headers[OUTCOME]} reused={headers[REUSED]} pulled={moved:.0f}")  # the figures (-s)
    assert headers[OUTCOME] == "hit", headers[OUTCOME]
    assert int(headers[REUSED]) == moved > 600
    off, _ = second(OFF)
    assert text == off


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_a_chat_tool_call_round_trip_hits(stack, stream):
    client, model_dir = openai_sdk(stack), stack["model_dir"]
    tools = [{"type": "function", "function": {"name": "look", "parameters": PARAMS}}]
    common = {"model": "tiny", "temperature": 0, "max_tokens": 16, "tools": tools,
              "extra_body": {"chat_template": TOOL_TEMPLATE}}
    messages = [{"role": "user", "content": words(model_dir, 700, 460 + stream)}]
    forced = {"type": "function", "function": {"name": "look"}}
    if stream:
        chunks = list(client.chat.completions.create(messages=messages, tool_choice=forced, stream=True, **common))
        calls: dict[int, dict] = {}
        for c in chunks:
            for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
                slot = calls.setdefault(d.index, {"id": "", "type": "function",
                                                  "function": {"name": "", "arguments": ""}})
                slot["id"] = d.id or slot["id"]
                slot["function"]["name"] = (d.function.name or "") or slot["function"]["name"]
                slot["function"]["arguments"] += d.function.arguments or ""
        assistant = {"role": "assistant", "content": None, "tool_calls": [calls[i] for i in sorted(calls)]}
    else:
        assistant = client.chat.completions.create(messages=messages, tool_choice=forced, **common).choices[0].message
    call_id = assistant["tool_calls"][0]["id"] if stream else assistant.tool_calls[0].id
    history = [*messages, assistant, {"role": "tool", "tool_call_id": call_id, "content": words(model_dir, 30, 470)}]

    def second(headers):
        raw = client.chat.completions.with_raw_response.create(messages=history, tool_choice="none",
                                                               extra_headers=headers, **common)
        return raw.parse().choices[0].message.content, raw.headers

    check_tool_turn(stack, second)


def test_a_responses_tool_call_round_trip_hits(stack):
    client, model_dir = openai_sdk(stack), stack["model_dir"]
    extra = {"tools": [{"type": "function", "name": "look", "parameters": PARAMS, "strict": False}],
             "extra_body": {"chat_template": TOOL_TEMPLATE}}
    items = [{"role": "user", "content": words(model_dir, 700, 480)}]
    output, _, _, _ = respond(client, items, tool_choice={"type": "function", "name": "look"}, **extra)
    call = next(o for o in output if o.type == "function_call")
    history = [*items, *output, {"type": "function_call_output", "call_id": call.call_id,
                                 "output": words(model_dir, 30, 481)}]

    def second(headers):
        _, text, found, _ = respond(client, history, headers=headers, tool_choice="none", **extra)
        return text, found

    check_tool_turn(stack, second)


def test_an_anthropic_tool_use_round_trip_hits(stack):
    client, model_dir = anthropic_sdk(stack), stack["model_dir"]
    extra = {"tools": [{"name": "look", "input_schema": PARAMS}], "extra_body": {"chat_template": TOOL_TEMPLATE}}
    messages = [{"role": "user", "content": words(model_dir, 700, 490)}]
    reply, _, _, answer = message(client, messages, tool_choice={"type": "tool", "name": "look"}, **extra)
    use = next(b for b in answer.content if b.type == "tool_use")
    assert answer.stop_reason == "tool_use" and use.input == {}
    history = [*messages, reply, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": use.id, "content": words(model_dir, 30, 491)}]}]

    def second(headers):
        _, text, found, _ = message(client, history, headers=headers, tool_choice={"type": "none"}, **extra)
        return text, found

    check_tool_turn(stack, second)


def test_anthropic_thinking_settings_reach_the_engines_as_vllm_maps_them(stack):
    """thinking disabled (reasoning_effort none) is served and reuses; thinking enabled is the engines'
    thinking_token_budget, which engines without a reasoning config refuse: a 400 the SDK raises."""
    import anthropic

    client, model_dir = anthropic_sdk(stack), stack["model_dir"]
    off = {"thinking": {"type": "disabled"}}
    messages = [{"role": "user", "content": words(model_dir, 700, 530)}]
    reply, _, _, _ = message(client, messages, **off)
    history = [*messages, reply, {"role": "user", "content": words(model_dir, 50, 531)}]
    before = pulled_tokens(stack)
    _, text, headers, _ = message(client, history, **off)
    assert headers[OUTCOME] == "hit" and int(headers[REUSED]) == pulled_tokens(stack) - before > 600
    assert text == message(client, history, headers=OFF, **off)[1]
    with pytest.raises(anthropic.BadRequestError, match="thinking_token_budget is set but reasoning_config"):
        message(client, messages, thinking={"type": "enabled", "budget_tokens": 1024},
                extra_body={"max_tokens": 2048})  # the engine's own refusal, passed on
