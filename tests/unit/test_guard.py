import pytest

from router import guard

SECRET = b"k" * 32


def chat(messages, **extra):
    return guard.parse_turn("chat", {"model": "m", "messages": messages, **extra})


BASE = [{"role": "system", "content": "s"}, {"role": "user", "content": "hello"}]
REPLY = {"role": "assistant", "content": " hi there"}


def history_after_first_turn(**extra):
    return chat(BASE, **extra).extended_by(REPLY)


def test_next_turn_extends_history():
    nxt = chat([*BASE, REPLY, {"role": "user", "content": "more"}])
    assert nxt.continues(history_after_first_turn())


@pytest.mark.parametrize("messages", [
    [*BASE, {"role": "assistant", "content": "hi there"}, {"role": "user", "content": "more"}],  # reply edited
    [BASE[0], {"role": "user", "content": "HELLO"}, REPLY, {"role": "user", "content": "more"}],  # history edited
    [BASE[1], REPLY, {"role": "user", "content": "more"}],  # truncated
])
def test_any_edit_is_a_miss(messages):
    assert not chat(messages).continues(history_after_first_turn())


def test_different_tools_or_model_never_continue():
    nxt = [*BASE, REPLY, {"role": "user", "content": "more"}]
    history = history_after_first_turn()
    assert not chat(nxt, tools=[{"type": "function", "function": {"name": "f"}}]).continues(history)
    assert not guard.parse_turn("chat", {"model": "other", "messages": nxt}).continues(history)


def test_text_parts_and_client_metadata_are_canonical():
    parts = {"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}],
             "client_note": "ignored"}
    # vLLM joins text parts with "\n" (renderers/chat_utils.py): the address is what the template renders
    assert guard.canonical_message(parts) == {"role": "user", "content": "hel\nlo"}


def test_completion_prompt_extension():
    t = guard.parse_turn("completion", {"model": "m", "prompt": "abc"})
    history = t.extended_by(" def")
    assert guard.parse_turn("completion", {"model": "m", "prompt": "abc def ghi"}).continues(history)
    assert not guard.parse_turn("completion", {"model": "m", "prompt": "abX def ghi"}).continues(history)
    assert guard.parse_turn("completion", {"model": "m", "prompt": [1, 2]}) is None  # token prompts: no reuse


def key_after(messages, reply, tenant="tenant-a", secret=SECRET, **extra):
    """Where the router stores the turn that answered ``messages`` with ``reply``."""
    return guard.content_key(secret, tenant, chat(messages, **extra).extended_by(reply))


def key_to_look_up(messages, tenant="tenant-a", secret=SECRET, **extra):
    turn = chat(messages, **extra)
    return None if turn.lookup is None else guard.content_key(secret, tenant, turn.lookup)


def test_the_next_turn_finds_the_stored_turn_by_its_content_alone():
    nxt = [*BASE, REPLY, {"role": "user", "content": "more"}]
    assert chat(BASE).lookup is None  # a first turn has nothing to look up
    assert key_to_look_up(nxt) == key_after(BASE, REPLY)
    # several turns later: the lookup is the last assistant message, whatever follows it
    later = [*nxt, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "a"},
             {"role": "user", "content": "b"}]
    assert key_to_look_up(later) == key_after(nxt, {"role": "assistant", "content": "ok"})
    assert chat(later).lookup.length == 5


@pytest.mark.parametrize("messages", [
    [*BASE, {"role": "assistant", "content": "hi there"}, {"role": "user", "content": "more"}],  # reply edited
    [BASE[0], {"role": "user", "content": "HELLO"}, REPLY, {"role": "user", "content": "more"}],  # history edited
    [BASE[1], REPLY, {"role": "user", "content": "more"}],  # truncated
    [BASE[1], BASE[0], REPLY, {"role": "user", "content": "more"}],  # reordered
    [*BASE, {"role": "user", "content": "extra"}, REPLY, {"role": "user", "content": "more"}],  # inserted
])
def test_edited_truncated_or_reordered_histories_have_another_address(messages):
    assert key_to_look_up(messages) != key_after(BASE, REPLY)


def test_addresses_isolate_tenants_secrets_and_render_settings():
    nxt = [*BASE, REPLY, {"role": "user", "content": "more"}]
    stored = key_after(BASE, REPLY)
    assert key_to_look_up(nxt, tenant="tenant-b") != stored
    assert key_to_look_up(nxt, secret=b"x" * 32) != stored
    assert key_to_look_up(nxt, cache_salt="s") != stored
    assert key_to_look_up(nxt, tools=[{"type": "function", "function": {"name": "f"}}]) != stored
    assert key_to_look_up(nxt, chat_template_kwargs={"enable_thinking": False}) != stored
    assert guard.parse_turn("chat", {"model": "other", "messages": nxt}).lookup != chat(nxt).lookup


def test_reasoning_and_client_metadata_do_not_change_the_address():
    nxt = [*BASE, {**REPLY, "reasoning_content": "let me think", "refusal": None, "annotations": []},
           {"role": "user", "content": "more"}]
    assert key_to_look_up(nxt) == key_after(BASE, {**REPLY, "reasoning": "streamed as reasoning"})


def test_tool_call_round_trips_keep_their_address():
    call = {"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "get", "arguments": '{"q": 1}'}}
    generated = {"role": "assistant", "content": None, "tool_calls": [call]}
    # the client echoes it back (the SDK drops nothing it needs; a streaming client rebuilt it with indexes)
    echoed = {"role": "assistant", "tool_calls": [{**call, "index": 0}]}
    nxt = [*BASE, echoed, {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "42"}]
    assert key_to_look_up(nxt) == key_after(BASE, generated)
    other_args = {"role": "assistant", "tool_calls": [{**call, "function": {"name": "get", "arguments": "{}"}}]}
    assert key_to_look_up([*BASE, other_args, nxt[-1]]) != key_after(BASE, generated)


def test_completion_sessions_are_slots_named_by_a_hint():
    t = guard.parse_turn("completion", {"model": "m", "prompt": "abc"})
    a = guard.hint_key(SECRET, "tenant-a", "sess", t)
    assert a == guard.hint_key(SECRET, "tenant-a", "sess", guard.parse_turn("completion", {"model": "m",
                                                                                           "prompt": "xyz"}))
    assert a != guard.hint_key(SECRET, "tenant-b", "sess", t)


@pytest.mark.parametrize("body, message", [
    ({"model": "m"}, "'messages' must be a non-empty list"),
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"messages": ["hi"]}, r"messages\[0\] must be an object"),
])
def test_malformed_chat_requests(body, message):
    with pytest.raises(guard.RequestError, match=message):
        guard.parse_turn("chat", body)


def test_only_complete_allowlisted_params_are_replayed():
    good = {"do_remote_decode": True, "do_remote_prefill": False, "remote_block_ids": [[1, 2]],
            "remote_engine_id": "d", "remote_host": "127.0.0.1", "remote_port": 5601, "remote_num_tokens": 200,
            "remote_request_id": "r", "tp_size": 1, "evil": "x"}
    replay = guard.replayable(good)
    assert replay is not None and "evil" not in replay and replay["remote_block_ids"] == [[1, 2]]
    assert guard.replayable({**good, "remote_block_ids": []}) is None
    assert guard.replayable({**good, "do_remote_decode": False}) is None
    assert guard.replayable(None) is None


def test_the_connectors_own_params_survive_the_replay_allowlist():
    from connector import boot, token_proof

    offer = {"do_remote_decode": True, "remote_block_ids": [[1]], "remote_engine_id": "d", "remote_host": "h",
             "remote_port": 1, "remote_num_tokens": 100, token_proof.PARAMS_KEY: "proof", boot.PARAMS_KEY: "b0"}
    replay = guard.replayable(offer)
    assert replay[token_proof.PARAMS_KEY] == "proof" and replay[boot.PARAMS_KEY] == "b0"
