"""Media URLs through the router (issue 38): every form of an internal address, and every name that resolves to
one, is a 400 before any engine sees the request. DNS is the fake resolver of tests/router/conftest.py."""

from __future__ import annotations

import pytest

from tests.router.conftest import engines, router_over
from tests.router.test_flow_fake import chat

#: The issue's forms, and more of each kind.
REFUSED = [
    "http://2852039166/latest/meta-data/", "http://0xa9fea9fe/", "http://127.1:8000/", "http://0251.0376.0251.0376/",
    "http://169.254.169.254.nip.io/latest/meta-data/", "http://app-10-0-0-1.nip.io/a.png",
    "http://[::ffff:127.0.0.1]/a.png", "http://[::1]:8000/a.png", "http://[64:ff9b::a9fe:a9fe]/",
    "http://mixed.example.com/a.png",  # one of its addresses is internal
    "http://aaaa-internal.example.com/a.png",  # an internal IPv6 address only
    "http://no-such-host.example.org/a.png",  # does not resolve: nothing to check, nothing fetched
    "file:///etc/passwd", "http://example.com@169.254.169.254/",
]


def image(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


@pytest.mark.parametrize("url", REFUSED)
async def test_a_media_url_reaching_inside_is_a_400_no_engine_sees(url):
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, _):
        r = await chat(s, image(url), conversation=None)
        assert r["status"] == 400, (url, r["status"])
        message = r["error"]["error"]["message"]
        assert "media" in message and "refused" in message, message
        print(f"{url} -> {r['status']}: {message}")
        for part in ({"image_url": url}, {"type": "video_url", "video_url": {"url": url}}):  # untyped, video
            r = await chat(s, [{"role": "user", "content": [part]}], conversation=None)
            assert r["status"] == 400, (url, part)
        assert p[0].stats["requests"] == 0 and d[0].stats["requests"] == 0


async def test_a_public_host_is_served_and_the_allow_list_is_exact():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, _):
        assert (await chat(s, image("https://example.com/cat.png"), conversation=None))["status"] == 200
        assert (await chat(s, image("http://93.184.215.14/cat.png"), conversation=None))["status"] == 200
    async with router_over(p, d, media_domains=["images.example.com"]) as (s, _):
        assert (await chat(s, image("https://images.example.com/cat.png"), conversation=None))["status"] == 200
        r = await chat(s, image("https://example.com/cat.png"), conversation=None)
        assert r["status"] == 400 and "allow-list" in r["error"]["error"]["message"]


def test_an_allow_list_naming_an_internal_host_is_refused():
    from router.config import RouterConfig

    with pytest.raises(ValueError, match="internal"):
        RouterConfig(prefill=["http://p:1"], decode=["http://d:1"], media_domains=["2852039166"])


async def test_a_names_verdict_is_kept_a_while_and_a_failed_lookup_is_not():
    import socket

    from router.media import CACHE_SECONDS, MediaChecker

    now, calls = [0.0], []

    async def resolver(host: str) -> list[str]:
        calls.append(host)
        if host == "flaky.example.com" and len(calls) == 1:
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return ["10.9.9.9"] if host == "rebind.example.com" and now[0] > CACHE_SECONDS else ["93.184.215.14"]

    checker = MediaChecker(resolver, clock=lambda: now[0])
    with pytest.raises(Exception, match="does not resolve"):
        await checker.check({"flaky.example.com"})
    await checker.check({"flaky.example.com"})  # asked again: a failure is not kept
    await checker.check({"rebind.example.com"})
    await checker.check({"rebind.example.com"})
    assert calls.count("rebind.example.com") == 1  # kept
    now[0] = CACHE_SECONDS + 1  # the name now answers an internal address: seen once the verdict is stale
    with pytest.raises(Exception, match="internal address"):
        await checker.check({"rebind.example.com"})



async def test_the_translated_apis_media_urls_are_checked_too():
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (s, _):
        body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://169.254.169.254.nip.io/latest/meta-data/"}}]}]}
        async with s.post("/v1/messages", json=body) as r:
            answer = await r.json()
            assert r.status == 400 and answer["type"] == "error" and "internal address" in answer["error"]["message"]
        body = {"model": "tiny", "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": "http://0xa9fea9fe/latest/meta-data/"}]}]}
        async with s.post("/v1/responses", json=body) as r:
            assert r.status == 400 and "internal address" in (await r.json())["error"]["message"]
        assert d[0].stats["requests"] == 0
