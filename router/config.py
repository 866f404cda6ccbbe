"""The router's configuration: engine URLs plus the router-scope tunables of the catalog."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field

from turnkv import params


@dataclass
class RouterConfig:
    prefill: list[str]
    decode: list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    #: Router and engine tunables (catalog names). The engine TTL bounds how long an entry may live.
    tunables: dict[str, int | float] = field(default_factory=params.defaults)
    #: HMAC secret for conversation keys; replicas sharing a store must share it.
    key_secret: bytes = field(default_factory=lambda: os.environ.get("TURNKV_KEY_SECRET", "").encode()
                              or secrets.token_bytes(32))
    health_interval: float = 2.0

    def __post_init__(self) -> None:
        self.tunables = params.validate({}, self.tunables)

    def entry_lifetime(self) -> float:
        """Seconds a stored entry may be replayed: the router TTL, and always before decode frees blocks."""
        t = self.tunables
        return float(min(t["conversation_ttl"], t["decoder_kv_blocks_ttl"] - t["expiry_margin"]))

    def __getattr__(self, name: str) -> int | float:
        # Tunables read as attributes: config.first_token_timeout, config.max_body_bytes, ...
        tunables = self.__dict__.get("tunables", {})
        if name in tunables:
            return tunables[name]
        raise AttributeError(name)
