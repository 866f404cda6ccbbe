"""Media URLs read as the engines' resolver reads them (turnkv.media, pure): every internal form refused."""

from __future__ import annotations

import ipaddress

import pytest

from turnkv.engine_args import MEDIA_REDIRECTS, EngineSpec, serve_env
from turnkv.media import MediaURLError, internal_address, ipv4_literal, literal_address, media_host

#: Each a host glibc's resolver takes as an internal address (``getent ahosts`` agrees on the IPv4 forms).
INTERNAL_FORMS = {
    "2852039166": "169.254.169.254",  # one decimal number
    "0xa9fea9fe": "169.254.169.254",  # hex
    "0xA9FEA9FE": "169.254.169.254",
    "0251.0376.0251.0376": "169.254.169.254",  # octal parts
    "169.254.43518": "169.254.169.254",  # a.b.c with a 16-bit last part
    "127.1": "127.0.0.1",  # a.b with a 24-bit last part
    "0x7f.1": "127.0.0.1",
    "127.0.0.1.": "127.0.0.1",  # the trailing dot of a fully qualified name
    "0": "0.0.0.0",
    "10.0.0.5": "10.0.0.5",
}


@pytest.mark.parametrize("host,address", sorted(INTERNAL_FORMS.items()))
def test_every_ipv4_form_is_read_as_the_address_it_reaches(host, address):
    assert ipv4_literal(host) == ipaddress.IPv4Address(address)
    with pytest.raises(MediaURLError, match="internal address"):
        media_host(f"http://{host}/latest/meta-data/")
    with pytest.raises(MediaURLError, match="internal address"):
        media_host(f"http://{host}:8000/x.png")


@pytest.mark.parametrize("host", ["[::1]", "[::ffff:127.0.0.1]", "[::ffff:a9fe:a9fe]", "[::ffff:169.254.169.254]",
                                  "[64:ff9b::a9fe:a9fe]", "[2002:a9fe:a9fe::1]", "[::127.0.0.1]", "[fe80::1%25eth0]",
                                  "[fd00:ec2::254]", "[fec0::1]", "[::]", "[ff02::1]"])
def test_ipv6_literals_and_the_ipv4_addresses_they_carry_are_refused(host):
    with pytest.raises(MediaURLError, match="internal address"):
        media_host(f"http://{host}/a.png")


@pytest.mark.parametrize("url,why", [
    ("file:///etc/passwd", "scheme"), ("ftp://example.com/a.png", "scheme"), ("gopher://example.com/", "scheme"),
    ("http://user@example.com/a.png", "credentials"), ("http://example.com@127.0.0.1/a.png", "credentials"),
    ("http://example.com\\@127.0.0.1/", "backslashes"), ("http://127.0.0.1 .example.com/", "spaces"),
    ("http:///a.png", "no host"), ("http://exa%6dple.com/", "neither"), ("http://localhost./a", "internal"),
    ("http://metadata.google.internal/", "internal"), ("http://printer.local/", "internal"),
    ("http://example.com:99999/", "not a valid URL"),
])
def test_urls_a_parser_could_read_two_ways_or_that_fetch_no_web_media_are_refused(url, why):
    with pytest.raises(MediaURLError, match=why):
        media_host(url)


def test_names_and_public_literals_pass_names_are_left_to_resolve():
    assert media_host("https://images.example.com/cat.png") == ("images.example.com", None)
    assert media_host("https://169.254.169.254.nip.io/")[1] is None  # a name: router.media resolves it
    assert media_host("http://8.8.8.8/a.png")[1] == ipaddress.IPv4Address("8.8.8.8")
    assert media_host("http://[2606:4700::1111]/a.png")[1] == ipaddress.IPv6Address("2606:4700::1111")
    assert literal_address("1.2.3.4.5") is None and literal_address("256.1.1.1") is None


def test_the_allow_list_takes_exact_names_only():
    allowed = ("images.example.com",)
    assert media_host("https://IMAGES.example.com/a.png", allowed)[0] == "images.example.com"
    for url in ("https://example.com/a.png", "https://images.example.com.evil.net/a.png", "http://8.8.8.8/a.png"):
        with pytest.raises(MediaURLError, match="allow-list"):
            media_host(url, allowed)


def test_an_ipv6_address_is_internal_when_the_ipv4_one_it_reaches_is():
    assert internal_address(ipaddress.ip_address("::ffff:10.1.2.3"))
    assert not internal_address(ipaddress.ip_address("::ffff:8.8.8.8"))
    assert not internal_address(ipaddress.ip_address("2606:4700::1111"))


def test_engines_never_follow_a_media_redirect():
    """The router checks a URL's host, not where its redirect leads: vLLM follows redirects unless told not to."""
    env = serve_env(EngineSpec(role="prefill", engine_id="p", model="m", port=1, side_channel_port=2))
    assert env[MEDIA_REDIRECTS] == "0"


def test_vllm_with_turnkvs_engine_env_does_not_follow_a_media_redirect(monkeypatch):
    """vLLM 0.32's media fetch (``MediaConnector.load_from_url``), under the environment turnkv gives engines: a
    public URL answering 302 to an internal address fetches nothing there. With vLLM's default it would."""
    import http.server
    import threading

    connector = pytest.importorskip("vllm.multimodal.media.connector")
    from vllm.multimodal.media.image import ImageMediaIO

    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            if self.path == "/cat.png":
                self.send_response(302)
                self.send_header("Location", f"http://127.0.0.1:{self.server.server_port}/latest/meta-data/")
                self.send_header("Content-Length", "0")
                self.end_headers()
            else:
                body = b"secret-credentials"
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/cat.png"  # the router would refuse this host; vLLM alone does not
    try:
        env = serve_env(EngineSpec(role="prefill", engine_id="p", model="m", port=1, side_channel_port=2))
        monkeypatch.setenv(MEDIA_REDIRECTS, env[MEDIA_REDIRECTS])
        with pytest.raises(Exception):  # noqa: B017 - the 302's empty body is no image: any error will do
            connector.MediaConnector().load_from_url(url, ImageMediaIO())
        assert hits == ["/cat.png"]  # the redirect was not followed
        monkeypatch.setenv(MEDIA_REDIRECTS, "1")  # vLLM's default
        with pytest.raises(Exception):  # noqa: B017
            connector.MediaConnector().load_from_url(url, ImageMediaIO())
        assert hits == ["/cat.png", "/cat.png", "/latest/meta-data/"]
    finally:
        server.shutdown()
