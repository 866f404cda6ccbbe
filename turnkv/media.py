"""Which media hosts engines must never fetch from (pure): one rule for the router's intake and the engines'
``--allowed-media-domains``."""

from __future__ import annotations

import ipaddress


def internal_host(host: str) -> bool:
    """Whether a URL host names this network's inside (loopback, private, link-local, reserved, unspecified)."""
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith((".localhost", ".internal")):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return not ip.is_global or ip.is_multicast
