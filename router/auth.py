"""Tenants from API keys (``Authorization: Bearer KEY``). Pure: the caller reads the file or variable.

Key sources, all the same format (``parse_keys``):
- a JSON object ``{"keys": ["k1", ...], "initial": "k0"}`` (the Secrets Manager secret the infra
  stack creates and ECS hands the task as ``TURNKV_API_KEYS``),
- a JSON object of named keys ``{"tenants": {"acme": "k1", "globex": ["k2", "k3"]}}``,
- a JSON list of keys, or text lines ``KEY`` / ``TENANT:KEY`` (``#`` comments).

A tenant is the name given to the key, else a digest of the key (keys never reach logs or the store).
With no keys configured the router is open and every request is the tenant ``""`` (local use).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import orjson


class AuthError(PermissionError):
    """A missing or unknown API key (HTTP 401)."""


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def parse_keys(text: str) -> dict[str, str]:
    """Key digest -> tenant name."""
    text = text.strip()
    if not text:
        return {}
    pairs: list[tuple[str, str]] = []
    if text[0] in "[{":
        data: Any = orjson.loads(text)
        if isinstance(data, list):
            pairs = [("", str(k)) for k in data]
        elif isinstance(data, Mapping):
            for k in data.get("keys") or []:
                pairs.append(("", str(k)))
            if data.get("initial"):
                pairs.append(("", str(data["initial"])))
            for tenant, keys in (data.get("tenants") or {}).items():
                for k in [keys] if isinstance(keys, str) else keys:
                    pairs.append((str(tenant), str(k)))
        else:
            raise ValueError("API keys: expected a JSON object or list")
    else:
        for line in text.splitlines():
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            tenant, sep, key = line.rpartition(":")
            pairs.append((tenant if sep else "", key))
    out = {}
    for tenant, key in pairs:
        if len(key) < 8:
            raise ValueError("API keys must be at least 8 characters long")
        out[_digest(key)] = tenant or "key-" + _digest(key)[:12]
    return out


class ApiKeys:
    def __init__(self, keys: Mapping[str, str] | None = None) -> None:
        self.keys = dict(keys or {})

    @property
    def open(self) -> bool:
        return not self.keys

    def tenant(self, authorization: str | None) -> str:
        """The tenant of an ``Authorization`` header value; raises AuthError."""
        if self.open:
            return ""
        if not authorization:
            raise AuthError("missing API key: send 'Authorization: Bearer <key>'")
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthError("malformed Authorization header: expected 'Bearer <key>'")
        tenant = self.keys.get(_digest(key.strip()))
        if tenant is None:
            raise AuthError("unknown API key")
        return tenant
