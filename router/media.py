"""Media URLs checked before an engine fetches them: every DNS name resolved and every address it has checked
(``turnkv.media`` decides; this module resolves).

A name checked here could resolve differently when the engine fetches it a moment later (DNS rebinding: a
record with a short TTL that answers a public address first and an internal one next). The router cannot close
that alone; deployments that accept media URLs set a media allow-list (``TURNKV_MEDIA_DOMAINS`` here, vLLM's
``--allowed-media-domains`` on the engines: names the operator trusts) and engines never follow redirects
(``VLLM_MEDIA_URL_ALLOW_REDIRECTS=0``, ``turnkv.engine_args.serve_env``). docs/router.md "Media URLs".
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Collection

from router.guard import RequestError
from turnkv.media import internal_address, literal_address

log = logging.getLogger("turnkv.router")

#: A resolver: a host name -> the addresses it resolves to (text). Tests pass a fake that behaves like DNS.
Resolver = Callable[[str], Awaitable[list[str]]]
#: How long a name's check holds (s), and how long a lookup may take.
CACHE_SECONDS = 30.0
RESOLVE_TIMEOUT = 2.0
CACHE_ENTRIES = 4096


async def system_resolver(host: str) -> list[str]:
    """Every address ``getaddrinfo`` gives ``host`` (the system resolver, as the engine's fetch uses)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


class MediaChecker:
    """Resolves media hosts and refuses any with an internal address; a name's verdict is kept ``CACHE_SECONDS``."""

    def __init__(self, resolver: Resolver = system_resolver, clock: Callable[[], float] = time.monotonic) -> None:
        self._resolve = resolver
        self._clock = clock
        self._verdicts: dict[str, tuple[float, str | None]] = {}  # host -> (until, why refused or None)

    async def _verdict(self, host: str) -> str | None:
        now = self._clock()
        cached = self._verdicts.get(host)
        if cached is not None and cached[0] > now:
            return cached[1]
        try:
            addresses = await asyncio.wait_for(self._resolve(host), RESOLVE_TIMEOUT)
        except (OSError, TimeoutError, UnicodeError) as exc:
            log.info("media host %s did not resolve: %r", host, exc)
            return f"{host} does not resolve"  # not cached: a lookup that failed may work next time
        why = None
        if not addresses:
            why = f"{host} does not resolve"
        for text in addresses:
            ip = literal_address(text)
            if ip is None or internal_address(ip):
                why = f"{host} resolves to an internal address ({text})"
                break
        if len(self._verdicts) >= CACHE_ENTRIES:
            self._verdicts = {h: v for h, v in self._verdicts.items() if v[0] > now}
            if len(self._verdicts) >= CACHE_ENTRIES:
                self._verdicts.clear()
        self._verdicts[host] = (now + CACHE_SECONDS, why)
        return why

    async def check(self, names: Collection[str]) -> None:
        """RequestError (400) unless every name resolves to internet addresses only."""
        if not names:
            return
        verdicts = await asyncio.gather(*(self._verdict(h) for h in sorted(names)))
        for why in verdicts:
            if why is not None:
                raise RequestError(f"a media URL is refused: {why}; media must be on the internet or inline "
                                   "(data: URL)")
