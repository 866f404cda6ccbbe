"""Responses and Anthropic Messages translated to chat completions and back (router.apis): the requests vLLM
would render, answers the official SDKs' own types validate, and round trips that keep a turn's address."""

from __future__ import annotations

import orjson
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from router import guard
from router.apis.messages import MessagesTranslation
from router.apis.responses import ResponsesTranslation
from router.guard import RequestError

CALL = {"id": "chatcmpl-tool-7", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
TOOL = {"type": "function", "name": "weather", "parameters": {"type": "object", "properties": {"city": {}}}}
CHAT_TEXT = {"id": "chatcmpl-abc", "object": "chat.completion", "model": "tiny",
             "choices": [{"index": 0, "finish_reason": "length",
                          "message": {"role": "assistant", "content": "bonjour", "tool_calls": []}}],
             "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}}
CHAT_CALL = {"id": "chatcmpl-def", "object": "chat.completion", "model": "tiny",
             "choices": [{"index": 0, "finish_reason": "tool_calls",
                          "message": {"role": "assistant", "content": None, "tool_calls": [CALL]}}],
             "usage": {"prompt_tokens": 20, "completion_tokens": 9, "total_tokens": 29}}


def addresses_match(first_body: dict, reply_choice: dict, second_body: dict) -> bool:
    """Whether the second request finds the turn the first one stored (the router's own computation)."""
    first = guard.parse_turn("chat", first_body)
    stored = first.extended_by(guard.reply_message(reply_choice))
    second = guard.parse_turn("chat", second_body)
    return second.lookup == stored


def sse_lines(*chunks) -> list[bytes]:
    lines = []
    for c in chunks:
        lines += [b"data: " + orjson.dumps(c) + b"\n", b"\n"]
    return [*lines, b"data: [DONE]\n", b"\n"]


def chunk(delta=None, finish=None, usage=None, cid="chatcmpl-s1"):
    body = {"id": cid, "object": "chat.completion.chunk", "model": "tiny",
            "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage:
        body["usage"] = usage
    return body


def events(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for block in raw.split(b"\n\n"):
        if not block.strip() or block.startswith(b":"):
            continue
        name, data = block.split(b"\n", 1)
        assert name.startswith(b"event: ") and data.startswith(b"data: "), block
        out.append((name[7:].decode(), orjson.loads(data[6:])))
    return out


TEXT_STREAM = sse_lines(chunk({"role": "assistant", "content": ""}), chunk({"content": "bon"}),
                        chunk({"content": "jour"}), chunk({}, "stop"),
                        chunk(usage={"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}))
CALL_STREAM = sse_lines(
    chunk({"role": "assistant", "tool_calls": [{"index": 0, "id": CALL["id"], "type": "function",
                                                "function": {"name": "weather", "arguments": ""}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}), chunk({}, "tool_calls"),
    chunk(usage={"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}))


# -- Responses -------------------------------------------------------------------------------------

def test_responses_input_becomes_the_chat_messages_vllm_builds():
    t = ResponsesTranslation({
        "model": "tiny", "instructions": "be brief", "max_output_tokens": 8, "temperature": 0, "tools": [TOOL],
        "tool_choice": {"type": "function", "name": "weather"}, "store": False, "prompt_cache_key": "s-1",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi "}, {"type": "input_text",
                                                                                     "text": "there"}]},
                  {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text",
                                                                                   "text": "hmm"}]},
                  {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hello"}]},
                  {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]})
    assert t.chat_body == {
        "model": "tiny", "temperature": 0, "prompt_cache_key": "s-1", "max_tokens": 8,
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"},
                     {"role": "assistant", "content": "hello", "reasoning": "hmm",
                      "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "weather",
                                                                                   "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
        "tools": [{"type": "function", "function": {"name": "weather", "parameters": TOOL["parameters"]}}],
        "tool_choice": {"type": "function", "function": {"name": "weather"}}}
    assert ResponsesTranslation({"model": "m", "input": "hi", "stream": True}).chat_body == {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "stream_options": {"include_usage": True}}


@pytest.mark.parametrize("field, value, named", [
    ("previous_response_id", "resp_1", "kept responses"),  # the router resolves it first (router.apis.stored)
    ("background", True, "background"), ("include", ["message.output_text.logprobs"], "logprobs"),
    ("include", ["file_search_call.results"], "file_search_call.results"), ("include", "x", "list of strings"),
    ("truncation", "auto", "truncation"), ("frobnicate", 1, "frobnicate"), ("conversation", "c", "conversation"),
    ("tools", [{"type": "web_search"}], "web_search"), ("text", {"format": {"type": "grammar"}}, "grammar"),
])
def test_responses_fields_it_cannot_honour_are_refused_by_name(field, value, named):
    with pytest.raises(RequestError, match=named):
        ResponsesTranslation({"model": "tiny", "input": "hi", field: value})


def test_responses_include_of_encrypted_reasoning_is_accepted_as_vllm_does():
    """Codex CLI and the Agents SDK (store=False) ask for it on every request: the translation is the same as
    without it, and the reasoning item returned, sent back as input, rebuilds the assistant's reasoning."""
    body = {"model": "m", "input": "hi", "store": False, "include": ["reasoning.encrypted_content"]}
    plain = ResponsesTranslation({k: v for k, v in body.items() if k != "include"})
    t = ResponsesTranslation(body)
    assert t.chat_body == plain.chat_body
    answer = t.unary({"id": "chatcmpl-1", "model": "m", "choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": "4", "reasoning": "2+2"}}], "usage": {}})
    again = ResponsesTranslation({"model": "m", "input": [{"role": "user", "content": "hi"}, *answer["output"],
                                                           {"role": "user", "content": "and 3+3?"}]})
    assert again.chat_body["messages"][1]["role"] == "assistant"
    assert again.chat_body["messages"][1]["content"] == "4"
    assert again.chat_body["messages"][1]["reasoning"] == "2+2"


def test_responses_input_items_it_cannot_render_are_refused_by_name():
    for item, named in (({"type": "item_reference", "id": "x"}, "item_reference"),
                        ({"type": "reasoning", "encrypted_content": "zz", "summary": []}, "encrypted"),
                        ({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}, "input_file")):
        with pytest.raises(RequestError, match=named):
            ResponsesTranslation({"model": "tiny", "input": [item]})


@pytest.mark.parametrize("chat", [CHAT_TEXT, CHAT_CALL], ids=["text", "tool-call"])
def test_a_response_validates_with_the_openai_types_and_sent_back_keeps_its_address(chat):
    first = {"model": "tiny", "input": "weather?", "tools": [TOOL]}
    t = ResponsesTranslation(first)
    answer = t.unary(chat)
    response = Response.model_validate(answer)  # the SDK's own model, validated (the SDK itself does not)
    if chat is CHAT_TEXT:
        assert response.output_text == "bonjour" and response.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
        assert response.usage.input_tokens == 12 and response.usage.output_tokens == 3
    else:
        call = response.output[0]
        assert (call.type, call.call_id, call.name, call.arguments) == ("function_call", CALL["id"], "weather",
                                                                         CALL["function"]["arguments"])
    # the next turn as an SDK user writes it: input += response.output (+ the tool's answer)
    follow = [*[o.model_dump(exclude_none=True) for o in response.output],
              ({"type": "function_call_output", "call_id": CALL["id"], "output": "sunny"} if chat is CHAT_CALL
               else {"role": "user", "content": "more"})]
    second = ResponsesTranslation({**first, "input": [{"role": "user", "content": "weather?"}, *follow]})
    assert addresses_match(t.chat_body, chat["choices"][0], second.chat_body)


@pytest.mark.parametrize("lines, chat", [(TEXT_STREAM, None), (CALL_STREAM, CHAT_CALL)], ids=["text", "tool-call"])
def test_responses_stream_events_validate_and_end_with_the_full_response(lines, chat):
    t = ResponsesTranslation({"model": "tiny", "input": "weather?", "stream": True, "tools": [TOOL]})
    raw = b"".join(t.stream_line(line) for line in [b": keepalive\n\n", *lines])
    assert raw.startswith(b": keepalive\n\n") and b"[DONE]" not in raw
    parsed = events(raw)
    adapter = TypeAdapter(ResponseStreamEvent)
    for name, data in parsed:
        assert adapter.validate_python(data).type == name
    assert [d["sequence_number"] for _, d in parsed] == list(range(len(parsed)))
    names = [n for n, _ in parsed]
    assert names[:2] == ["response.created", "response.in_progress"] and names[-1] == "response.completed"
    final = Response.model_validate(parsed[-1][1]["response"])
    if chat is None:
        deltas = "".join(d["delta"] for n, d in parsed if n == "response.output_text.delta")
        assert deltas == final.output_text == "bonjour" and final.usage.total_tokens == 7
    else:
        assert "response.function_call_arguments.delta" in names
        assert final.output[0].arguments == '{"city": "Paris"}' and final.output[0].call_id == CALL["id"]


def test_responses_stream_error_is_an_error_event_the_sdk_raises_on():
    t = ResponsesTranslation({"model": "tiny", "input": "x", "stream": True})
    t.stream_line(b"data: " + orjson.dumps(chunk({"content": "a"})) + b"\n")
    (name, data), = events(t.error_event(502, "the model server failed"))
    assert name == "error" and data["error"]["message"] == "the model server failed"


# -- Anthropic Messages ----------------------------------------------------------------------------

ATOOL = {"name": "weather", "description": "look it up", "input_schema": {"type": "object"}}


def test_messages_become_the_chat_messages_vllm_builds():
    t = MessagesTranslation({
        "model": "tiny", "max_tokens": 16, "stop_sequences": ["END"], "tools": [ATOOL],
        "tool_choice": {"type": "tool", "name": "weather", "disable_parallel_tool_use": True},
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=4f2a;"},
                   {"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}],
        "metadata": {"user_id": "u"},
        "messages": [{"role": "user", "content": "weather?"},
                     {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": ""},
                                                       {"type": "tool_use", "id": "toolu_1", "name": "weather",
                                                        "input": {"city": "Paris"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                   "content": [{"type": "text", "text": "sunny"}]},
                                                  {"type": "text", "text": "thanks"}]}]})
    assert t.chat_body == {
        "model": "tiny", "max_tokens": 16, "stop": ["END"],
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather?"},
                     {"role": "assistant", "reasoning": "t", "tool_calls": [
                         {"id": "toolu_1", "type": "function",
                          "function": {"name": "weather", "arguments": '{"city":"Paris"}'}}]},
                     {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
                     {"role": "user", "content": "thanks"}],
        "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"},
                                                    "description": "look it up"}}],
        "tool_choice": {"type": "function", "function": {"name": "weather"}}, "parallel_tool_calls": False}


@pytest.mark.parametrize("field, value, named", [
    ("thinking", {"type": "enabled", "budget_tokens": 100}, "budget_tokens"), ("frobnicate", 1, "frobnicate"),
    ("thinking", {"type": "enabled", "budget_tokens": 2048}, "less than"), ("thinking", {"type": "on"}, "'on'"),
    ("output_config", {"effort": "huge"}, "effort"), ("output_config", {"task_budget": 1}, "output_config"),
    ("tools", [{"type": "web_search_20250305", "name": "web_search"}], "web_search_20250305"),
    ("mcp_servers", [], "mcp_servers"), ("max_tokens", 0, "max_tokens"),
])
def test_messages_fields_it_cannot_honour_are_refused_by_name(field, value, named):
    with pytest.raises(RequestError, match=named):
        MessagesTranslation({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                             field: value})
    with pytest.raises(RequestError, match="document"):
        MessagesTranslation({"model": "tiny", "max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "document", "source": {}}]}]})


def test_thinking_and_output_config_map_as_vllms_own_endpoint_does():
    base = {"model": "tiny", "max_tokens": 4096, "messages": [{"role": "user", "content": "hi"}]}
    body = MessagesTranslation({**base, "thinking": {"type": "enabled", "budget_tokens": 2048}}).chat_body
    assert body["thinking_token_budget"] == 2048 and "reasoning_effort" not in body
    body = MessagesTranslation({**base, "thinking": {"type": "disabled"},
                                "output_config": {"effort": "high"}}).chat_body
    assert body["reasoning_effort"] == "none"  # disabled wins over the effort, as in vLLM
    body = MessagesTranslation({**base, "thinking": {"type": "adaptive"}, "output_config": {
        "effort": "low", "format": {"type": "json_schema", "schema": {"type": "object"}}}}).chat_body
    assert body["reasoning_effort"] == "low" and "thinking_token_budget" not in body
    assert body["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "json_schema", "schema": {"type": "object"}}}


@pytest.mark.parametrize("chat", [CHAT_TEXT, CHAT_CALL], ids=["text", "tool-call"])
def test_a_message_validates_with_the_anthropic_types_and_sent_back_keeps_its_address(chat):
    first = {"model": "tiny", "max_tokens": 16, "tools": [ATOOL], "messages": [{"role": "user", "content": "w?"}]}
    t = MessagesTranslation(first)
    message = Message.model_validate(t.unary(chat))
    if chat is CHAT_TEXT:
        assert message.content[0].text == "bonjour" and message.stop_reason == "max_tokens"
        follow = {"role": "user", "content": "more"}
    else:
        block = message.content[0]
        assert (block.type, block.id, block.input, message.stop_reason) == ("tool_use", CALL["id"],
                                                                           {"city": "Paris"}, "tool_use")
        follow = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "sunny"}]}
    back = {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]}
    second = MessagesTranslation({**first, "messages": [*first["messages"], back, follow]})
    assert addresses_match(t.chat_body, chat["choices"][0], second.chat_body)


@pytest.mark.parametrize("lines", [TEXT_STREAM, CALL_STREAM], ids=["text", "tool-call"])
def test_messages_stream_events_validate_and_accumulate_like_the_sdk(lines):
    from anthropic.lib.streaming._messages import accumulate_event

    t = MessagesTranslation({"model": "tiny", "max_tokens": 16, "stream": True, "tools": [ATOOL],
                             "messages": [{"role": "user", "content": "w?"}]})
    parsed = events(b"".join(t.stream_line(line) for line in lines))
    adapter = TypeAdapter(RawMessageStreamEvent)
    snapshot, bufs = None, {}
    for name, data in parsed:
        event = adapter.validate_python(data)
        assert event.type == name
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=bufs)
    assert parsed[0][0] == "message_start" and parsed[-1][0] == "message_stop"
    if lines is TEXT_STREAM:
        assert snapshot.content[0].text == "bonjour" and snapshot.stop_reason == "end_turn"
        assert snapshot.usage.output_tokens == 2
    else:
        assert snapshot.content[0].input == {"city": "Paris"} and snapshot.stop_reason == "tool_use"


def test_messages_errors_are_anthropic_shaped():
    body = orjson.loads(MessagesTranslation.error_shape(400, "bad"))
    assert body == {"type": "error", "error": {"type": "invalid_request_error", "message": "bad"}}
    t = MessagesTranslation({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    (name, data), = events(t.error_event(502, "failed"))
    assert name == "error" and data["error"] == {"type": "api_error", "message": "failed"}


def test_tool_call_arguments_are_addressed_as_the_json_the_template_renders():
    spaced = {"role": "assistant", "tool_calls": [CALL]}
    compact = {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "weather",
                                                                         "arguments": '{"city":"Paris"}'}}]}
    reordered = {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "weather",
                                                                           "arguments": '{"b":1,"a":2}'}}]}
    assert guard.canonical_message(spaced) == guard.canonical_message(compact)
    assert guard.canonical_message(reordered)["tool_calls"][0]["function"]["arguments"] == '{"b":1,"a":2}'
    assert guard.canonical_message({"role": "assistant", "tool_calls": [
        {**CALL, "function": {"name": "w", "arguments": "not json"}}]})["tool_calls"][0]["function"][
        "arguments"] == "not json"


def test_previous_response_id_puts_the_kept_history_before_this_input_and_not_the_old_instructions():
    first = ResponsesTranslation({"model": "tiny", "instructions": "be brief", "input": "hello"})
    first.unary(CHAT_TEXT)
    reply = guard.reply_message(CHAT_TEXT["choices"][0])
    response_id, kept = first.kept(reply)
    assert response_id == "resp_abc" and kept == [{"role": "user", "content": "hello"}, reply]
    second = ResponsesTranslation({"model": "tiny", "instructions": "be brief", "input": "and then?",
                                   "previous_response_id": response_id}, kept)
    resent = ResponsesTranslation({"model": "tiny", "instructions": "be brief",
                                   "input": [{"role": "user", "content": "hello"},
                                             {"role": "assistant", "content": "bonjour"},
                                             {"role": "user", "content": "and then?"}]})
    # the same prompt as a client that resent the whole conversation: the same turn address
    assert second.chat_body["messages"] == [{"role": "system", "content": "be brief"}, *kept,
                                            {"role": "user", "content": "and then?"}]
    assert guard.parse_turn("chat", second.chat_body).lookup == guard.parse_turn("chat", resent.chat_body).lookup
    assert addresses_match(first.chat_body, CHAT_TEXT["choices"][0], second.chat_body)
    assert second.unary(CHAT_TEXT)["previous_response_id"] == "resp_abc"
    assert ResponsesTranslation({"model": "tiny", "input": "x", "store": False}).kept(reply) is None


def test_a_streamed_response_is_kept_under_the_id_the_client_saw():
    t = ResponsesTranslation({"model": "tiny", "input": "hello", "stream": True})
    events = b"".join(t.stream_line(b"data: " + orjson.dumps(c) + b"\n") for c in (
        {"id": "chatcmpl-s1", "model": "tiny", "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                                   "content": "hi"}}]},
        {"id": "chatcmpl-s1", "model": "tiny", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
    events += t.stream_line(b"data: [DONE]\n")
    created = orjson.loads(events.split(b"\n")[1][6:])
    response_id, kept = t.kept({"role": "assistant", "content": "hi"})
    assert created["response"]["id"] == response_id == "resp_s1" and created["response"]["store"] is True
    assert kept[-1] == {"role": "assistant", "content": "hi"}
