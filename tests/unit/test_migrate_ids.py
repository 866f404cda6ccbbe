"""router.migrate: token ids are cut from relayed lines as text and parsed only when a migration needs them."""

from __future__ import annotations

import orjson

from router import migrate


def test_ids_are_cut_from_the_line_and_parsed_on_demand() -> None:
    state = migrate.StreamState("chat", client_ids=False)
    first = b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"a"},"token_ids":[11,12]}],' \
            b'"prompt_token_ids":[1,2,3]}\n'
    out = state.observe(first)
    assert b"token_ids" not in out and b'"content":"a"' in out
    assert state.head["id"] == "x"
    state.observe(b'data: {"choices":[{"index":0,"delta":{"content":"b"},"token_ids":[13]}]}\n')
    state.observe(b"data: [DONE]\n")
    assert state.ids_parse() and state.generated == [11, 12, 13]
    state.observe(b'data: {"choices":[{"index":0,"delta":{},"token_ids":[]}]}\n')  # an empty list adds nothing
    assert state.generated == [11, 12, 13]


def test_a_client_that_asked_for_ids_keeps_them_and_they_are_still_counted() -> None:
    state = migrate.StreamState("chat", client_ids=True)
    line = b'data: {"choices":[{"index":0,"delta":{"content":"a"},"token_ids":[7]}]}\n'
    assert state.observe(line) == line
    assert state.generated == [7]


def test_ids_that_are_not_integers_make_the_stream_not_continuable() -> None:
    state = migrate.StreamState("chat", client_ids=False)
    state.observe(b'data: {"choices":[{"index":0,"delta":{"content":"a"},"token_ids":["x"]}]}\n')
    assert not state.ids_parse()
    assert migrate.prompt_ids(b"1, 2") == [1, 2]
    assert migrate.prompt_ids(b"1,true") is None and migrate.prompt_ids(b"1.5") is None


def test_prompt_ids_are_cut_unparsed_from_either_place() -> None:
    chat = b'{"id":"c","choices":[{"index":0}],"prompt_token_ids":[1,2,3],"usage":{"prompt_tokens":3}}'
    rest, raw = migrate.cut_prompt_ids(chat)
    assert orjson.loads(rest) == {"id": "c", "choices": [{"index": 0}], "usage": {"prompt_tokens": 3}}
    assert raw is not None and migrate.prompt_ids(raw) == [1, 2, 3]
    completion = b'{"choices":[{"prompt_token_ids":[4],"index":0,"text":"x"}]}'
    rest, raw = migrate.cut_prompt_ids(completion)
    assert orjson.loads(rest) == {"choices": [{"index": 0, "text": "x"}]} and raw == b"4"
    text = b'{"choices":[{"message":{"content":"\\"prompt_token_ids\\":[9]"}}]}'  # in a string: escaped, not cut
    assert migrate.cut_prompt_ids(text) == (text, None)
