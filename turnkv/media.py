"""Which media URLs engines may fetch (pure): one rule for the router's intake and the engines'
``--allowed-media-domains``.

An engine fetches a media URL from inside the network, so the host of every URL is read the way the engine's
resolver reads it, not the way ``ipaddress`` does: glibc (``getaddrinfo``, ``inet_aton``) takes ``2852039166``,
``0xa9fea9fe``, ``0251.0376.0251.0376`` and ``127.1`` as IPv4 addresses, and an IPv6 literal can carry an IPv4
address (``::ffff:127.0.0.1``, NAT64 ``64:ff9b::a9fe:a9fe``, 6to4). :func:`literal_address` parses those forms
(the WHATWG URL standard's IPv4 parser, which agrees with ``inet_aton`` on them); a host that is no literal is a
DNS name, whose every address the router resolves and checks (``router.media``). Hosts are held to the
characters a DNS name or an IPv6 literal can have, so no resolver reads past what was checked.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Collection
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

#: Schemes an engine fetches media from (``data:`` is inline: nothing is fetched).
FETCHED_SCHEMES = ("http", "https")
#: A DNS name as resolvers read it: letters, digits, hyphens, underscores, dots (at most 253 characters).
_NAME = re.compile(r"[a-z0-9_](?:[a-z0-9_.-]{0,251}[a-z0-9_.])?")
#: NAT64 prefixes (RFC 6052 well-known, RFC 8215 local-use): the last 32 bits are an IPv4 address a gateway reaches.
_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))


class MediaURLError(ValueError):
    """A media URL an engine must not fetch; the message says why (the router answers 400 with it)."""


def _ipv4_number(part: str) -> int | None:
    """One dotted part as ``inet_aton`` reads it: ``0x`` hex, a leading ``0`` octal, else decimal; None if none."""
    try:
        if part[:2] in ("0x", "0X"):
            return int(part[2:] or "0", 16)
        if len(part) > 1 and part[0] == "0":
            return int(part[1:], 8)
        return int(part, 10) if part.isdigit() else None
    except ValueError:
        return None


def ipv4_literal(host: str) -> ipaddress.IPv4Address | None:
    """The IPv4 address a host names in any form a resolver accepts (``127.1``, ``2852039166``, ``0xa9fea9fe``,
    ``0177.0.0.1``, a trailing dot), or None when it is not one."""
    if host.endswith(".") and len(host) > 1:
        host = host[:-1]
    parts = host.split(".")
    if not 1 <= len(parts) <= 4 or any(not p for p in parts):
        return None
    numbers = [_ipv4_number(p) for p in parts]
    if any(n is None for n in numbers):
        return None
    *head, last = numbers
    assert last is not None
    if any(n > 255 for n in head if n is not None) or last >= 256 ** (5 - len(parts)):
        return None
    value = last
    for i, n in enumerate(head):
        assert n is not None
        value += n << (8 * (3 - i))
    return ipaddress.IPv4Address(value)


def literal_address(host: str) -> IPAddress | None:
    """The address a URL host names literally (IPv6 with or without brackets, any IPv4 form), or None (a name).
    A zone id (``fe80::1%eth0``) is a link-local address: kept, so it is refused."""
    bare = host.strip().lower()
    if bare.startswith("[") and bare.endswith("]"):
        bare = bare[1:-1]
    if ":" in bare:
        try:
            return ipaddress.IPv6Address(bare.split("%", 1)[0])
        except ValueError:
            return None
    return ipv4_literal(bare)


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address reaches: mapped, compatible (``::a.b.c.d``), 6to4, NAT64, Teredo server."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]  # the client's own address (the server is the first)
    if any(ip in net for net in _NAT64) or (int(ip) >> 32 == 0 and int(ip) > 1):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def internal_address(ip: IPAddress) -> bool:
    """Whether an address is this network's inside, or not a unicast address on the internet: loopback, private,
    link-local (169.254.169.254, the instance metadata service), shared (100.64/10), reserved, unspecified,
    multicast, site-local, and an IPv6 address carrying any such IPv4 address."""
    if isinstance(ip, ipaddress.IPv6Address):
        inner = _embedded_ipv4(ip)
        if inner is not None and internal_address(inner):
            return True
        if ip.is_site_local:
            return True
    return not ip.is_global or ip.is_multicast


def internal_host(host: str) -> bool:
    """Whether a URL host names this network's inside by its text alone (``localhost``, ``*.internal``, an
    internal address in any literal form). A DNS name is not resolved here: ``router.media`` resolves it."""
    host = host.strip().strip("[]").lower().rstrip(".")
    if host == "localhost" or host.endswith((".localhost", ".internal", ".local")):
        return True
    ip = literal_address(host)
    return ip is not None and internal_address(ip)


def media_host(url: str, allowed: Collection[str] = ()) -> tuple[str, IPAddress | None]:
    """The host an engine would fetch ``url`` from and its literal address (None: a DNS name to resolve and check
    before the engine sees it). MediaURLError for a scheme engines must not fetch, a URL a parser could read two
    ways (credentials, backslashes, spaces), an internal host, or a host off the ``allowed`` list (when given:
    exact lower-case names, as vLLM's ``--allowed-media-domains`` compares them)."""
    if any(c in url for c in "\\\t\r\n ") or any(ord(c) < 0x20 or ord(c) == 0x7F for c in url):
        raise MediaURLError("the URL has spaces, backslashes or control characters")
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        parts.port  # noqa: B018 - a port that is not a number raises here
    except ValueError:
        raise MediaURLError("it is not a valid URL") from None
    if parts.scheme.lower() not in FETCHED_SCHEMES:
        raise MediaURLError(f"scheme {parts.scheme or '(none)'!r} is not fetched; use http(s) or a data: URL")
    if "@" in parts.netloc:
        raise MediaURLError("media URLs must not carry credentials (user@host)")
    if not host:
        raise MediaURLError("it names no host")
    ip = literal_address(host)
    if ip is None and not _NAME.fullmatch(host):
        raise MediaURLError(f"{host!r} is neither a host name nor an IP address")
    if internal_host(host):
        raise MediaURLError(f"it names an internal address ({host})")
    if allowed and host.rstrip(".") not in allowed:
        raise MediaURLError(f"{host} is not on this deployment's media allow-list")
    return host, ip
