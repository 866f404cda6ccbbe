"""Intake checks, render fields and the byte budgets of issue 31 (pure)."""

from __future__ import annotations

import pytest

from router import guard, intake, limits


@pytest.mark.parametrize("field", ["media_io_kwargs", "truncation_side"])
def test_render_fields_vllm_reads_are_in_the_digest(field):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert guard.render_digest("chat", body) != guard.render_digest("chat", {**body, field: {"a": 1}})


@pytest.mark.parametrize("bad", ["abc", [1], {}, "1e400", True, 1.5])
def test_integer_fields_of_any_other_type_are_refused_by_name(bad):
    with pytest.raises(guard.RequestError, match="'max_tokens'"):
        intake.check_types({"max_tokens": bad})


def test_unknown_or_untyped_non_text_parts_count_as_remote_media():
    assert guard.has_remote_media({"content": [{"image_url": "https://example.com/a.png"}]})
    assert guard.has_remote_media({"content": [{"type": "mystery", "data": "x"}]})
    assert not guard.has_remote_media({"content": [{"text": "plain"}]})


def test_byte_budget_refuses_by_the_limit_it_would_break_and_gives_back():
    b = limits.ByteBudget()
    assert b.try_take("a", 60, 100, 80) is None
    assert b.try_take("a", 30, 100, 80) == "tenant_max_body_buffer_bytes"
    assert b.try_take("b", 50, 100, 80) == "max_body_buffer_bytes"
    b.give("a", 60)
    assert b.total == 0 and b.try_take("b", 50, 100, 80) is None


def test_expiring_bytes_free_what_expired():
    now = [0.0]
    e = limits.ExpiringBytes(lambda: now[0])
    assert e.try_hold("t", 60, 10, 100) and not e.try_hold("t", 60, 10, 100)
    now[0] = 11
    assert e.used("t") == 0 and e.try_hold("t", 60, 20, 100)


@pytest.mark.parametrize("url", ["http://169.254.169.254/latest/meta-data", "http://10.0.0.5/a.png",
                                 "http://[::1]/a.png", "http://localhost:8000/a.png"])
def test_media_urls_naming_internal_addresses_are_refused(url):
    body = {"messages": [{"role": "user", "content": [{"image_url": {"url": url}}]}]}
    with pytest.raises(guard.RequestError, match="internal address"):
        intake.check_media_urls(body)
    intake.check_media_urls({"messages": [{"role": "user", "content": [{"image_url": {"url": "https://a.com/x"}}]}]})


def test_engines_get_the_media_allow_list_and_never_an_internal_host():
    from turnkv.engine_args import EngineSpec, serve_args

    spec = dict(role="prefill", engine_id="p", model="m", port=1, side_channel_port=2)
    args = serve_args(EngineSpec(**spec, allowed_media_domains=("images.example.com",)))
    assert args[args.index("--allowed-media-domains") + 1] == "images.example.com"
    with pytest.raises(ValueError, match="internal"):
        serve_args(EngineSpec(**spec, allowed_media_domains=("169.254.169.254",)))


def test_fields_vllm_accepts_are_not_refused():
    intake.check_types({"logprobs": True, "top_logprobs": 2, "top_k": -1, "truncate_prompt_tokens": -1, "seed": -5,
                        "max_tokens": None, "temperature": 0, "stream": False})
    intake.check_types({"logprobs": 3, "echo": True})  # completions
