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
    [*BASE, REPLY],  # nothing new
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
    assert guard.canonical_message(parts) == {"role": "user", "content": "hello"}


def test_completion_prompt_extension():
    t = guard.parse_turn("completion", {"model": "m", "prompt": "abc"})
    history = t.extended_by(" def")
    assert guard.parse_turn("completion", {"model": "m", "prompt": "abc def ghi"}).continues(history)
    assert not guard.parse_turn("completion", {"model": "m", "prompt": "abX def ghi"}).continues(history)
    assert guard.parse_turn("completion", {"model": "m", "prompt": [1, 2]}) is None  # token prompts: no reuse


def test_keys_isolate_tenants_and_settings():
    t = chat(BASE)
    a = guard.conversation_key(SECRET, "tenant-a", "conv", t)
    assert a == guard.conversation_key(SECRET, "tenant-a", "conv", chat(BASE))
    assert a != guard.conversation_key(SECRET, "tenant-b", "conv", t)
    assert a != guard.conversation_key(b"x" * 32, "tenant-a", "conv", t)
    assert a != guard.conversation_key(SECRET, "tenant-a", "conv", chat(BASE, cache_salt="s"))


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
