import pytest
from multidict import CIMultiDict

from router import hints

SOURCES = hints.parse_sources(hints.DEFAULT_SOURCES)


def find(headers=None, body=None):
    return hints.find(SOURCES, CIMultiDict(headers or {}), body or {})


@pytest.mark.parametrize("headers, body, source, value", [
    ({"X-Correlation-ID": "aiperf-1"}, {}, "header:x-correlation-id", "aiperf-1"),
    ({"x-session-id": "vllm-bench"}, {}, "header:x-session-id", "vllm-bench"),
    ({"X-LiteLLM-Session-Id": "oh-7"}, {}, "header:x-litellm-session-id", "oh-7"),
    ({}, {"prompt_cache_key": "sdk"}, "body:prompt_cache_key", "sdk"),
    ({}, {"session_id": 12}, "body:session_id", "12"),
    ({"X-Session-ID": "h"}, {"conversation_id": "ours"}, "body:conversation_id", "ours"),  # priority order
])
def test_the_session_ids_agents_send_are_read_as_hints(headers, body, source, value):
    hint = find(headers, body)
    assert hint is not None and hint.source.label == source and hint.value == value


def test_foreign_fields_of_another_shape_are_ignored_but_our_own_field_is_checked():
    assert find(body={"session_id": {"nested": 1}, "prompt_cache_key": ""}) is None
    with pytest.raises(ValueError, match="'conversation_id' must be a non-empty string"):
        find(body={"conversation_id": 5})
    with pytest.raises(ValueError, match="at most 256"):
        find(body={"conversation_id": "x" * 257})


def test_sources_are_configurable_and_bad_specs_are_named():
    only = hints.parse_sources(["header:X-My-Session"])
    assert hints.find(only, CIMultiDict({"X-Correlation-ID": "a", "x-my-session": "b"}), {}).value == "b"
    with pytest.raises(ValueError, match="'cookie:x'"):
        hints.parse_sources(["cookie:x"])


def test_rendezvous_is_stable_and_moves_only_the_hints_of_a_leaving_engine():
    names = ["decode-0", "decode-1", "decode-2"]
    picks = {h: hints.rendezvous("t", h, names) for h in (f"s{i}" for i in range(300))}
    assert set(picks.values()) == set(names)
    assert picks == {h: hints.rendezvous("t", h, list(reversed(names))) for h in picks}
    fewer = {h: hints.rendezvous("t", h, names[:2]) for h in picks}
    assert all(fewer[h] == picks[h] for h in picks if picks[h] != "decode-2")
    assert hints.rendezvous("t", "s", []) == ""
