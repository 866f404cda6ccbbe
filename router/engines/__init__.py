"""The engine pool: which prefill and decode engines exist, which are healthy, and which to use."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit


@dataclass(eq=False)
class Engine:
    url: str
    role: str  # "prefill" or "decode"
    healthy: bool = True
    outstanding: int = 0
    failures: int = 0
    name: str = field(default="")

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"engine URL {self.url!r} must look like http://HOST:PORT")
        if not self.name:
            self.name = parts.netloc


class NoEngineError(RuntimeError):
    """No healthy engine of a role is available (HTTP 503)."""


class LeastOutstanding:
    """Pick the healthy engine with the fewest requests in flight; round-robin among ties."""

    def __init__(self) -> None:
        self._tick = itertools.count()

    def choose(self, engines: Sequence[Engine]) -> Engine:
        healthy = [e for e in engines if e.healthy]
        if not healthy:
            raise NoEngineError("no healthy engine")
        least = min(e.outstanding for e in healthy)
        ties = [e for e in healthy if e.outstanding == least]
        return ties[next(self._tick) % len(ties)]


class EnginePool:
    def __init__(self, prefill: Iterable[str], decode: Iterable[str], policy: LeastOutstanding | None = None) -> None:
        self.prefill = [Engine(u, "prefill") for u in prefill]
        self.decode = [Engine(u, "decode") for u in decode]
        if not self.prefill or not self.decode:
            raise ValueError("the router needs at least one --prefill and one --decode engine URL")
        self.policy = policy or LeastOutstanding()

    @property
    def all(self) -> list[Engine]:
        return self.prefill + self.decode

    def pick(self, role: str) -> Engine:
        engines = self.prefill if role == "prefill" else self.decode
        try:
            return self.policy.choose(engines)
        except NoEngineError:
            raise NoEngineError(f"no healthy {role} engine among {[e.url for e in engines]}") from None
