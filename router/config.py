"""The router's configuration: engines, discovery, store, auth, plus the router-scope tunables of the catalog.

Sources, later wins: defaults < config file (``--config``, JSON or TOML, same names as the flags with
``_`` for ``-``) < command-line flags < SSM parameters re-read while running (tunables only).
"""

from __future__ import annotations

import os
import secrets
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import orjson

from router import hints
from turnkv import lifetime, media, params, router_env, wire

KEY_SECRET_ENV = router_env.KEY_SECRET
API_KEYS_ENV = router_env.API_KEYS
DEPLOYMENT_ENV = router_env.DEPLOYMENT


@dataclass
class RouterConfig:
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = router_env.PORT
    #: Router and engine tunables (catalog names). The engine TTL bounds how long an entry may live.
    tunables: dict[str, int | float] = field(default_factory=params.defaults)
    #: HMAC secret for conversation keys; replicas sharing a store must share it. Empty: from the
    #: environment, else (with a Valkey store) one secret created in the store and shared, else random.
    key_secret: bytes = b""
    #: The engines' offer secret (``turnkv.wire``): the router clears each offer it replays with it, and prefill
    #: reads only cleared offers. None: from TURNKV_OFFER_SECRET / TURNKV_OFFER_SECRET_FILE, as the engines read it.
    offer_secret: bytes | None = None
    #: "pull" or "push" (concurrent P and D dispatch).
    mode: str = "pull"
    #: "static" (--prefill/--decode) or "cloudmap".
    discovery: str = "static"
    namespace: str = ""
    service: str = "engines"
    region: str | None = None
    #: AWS endpoint override (moto in tests).
    aws_endpoint_url: str | None = None
    #: "memory" or redis://host:port/db (rediss:// for TLS, as ElastiCache Serverless needs).
    store: str = "memory"
    #: API keys: a file (JSON or lines, see router.auth) and/or the TURNKV_API_KEYS variable.
    api_keys_file: str | None = None
    #: Deployment name (SSM paths /turnkv/<deployment>/..., EMF dimension); TURNKV_DEPLOYMENT.
    deployment: str = field(default_factory=lambda: os.environ.get(DEPLOYMENT_ENV, "local"))
    #: Re-read tunables from SSM every params_refresh seconds (only with a deployment and a region).
    ssm: bool = False
    #: Extra addresses a replayed remote_host may name (NIXL side-channel hosts not in engine URLs).
    side_channel_hosts: list[str] = field(default_factory=list)
    #: Choice policy name (router.engines.policy.POLICIES).
    policy: str = "least_load"
    #: Write one EMF line per request to stdout.
    emf: bool = True
    #: USD per prefill engine-hour, to price the prefill time reuse saves (router.savings): the prefill pool's
    #: instance price over its engines per instance, set by the deployment (TURNKV_PREFILL_ENGINE_PRICE_PER_HOUR);
    #: 0: unknown (seconds saved only).
    prefill_price_per_hour: float = field(default_factory=lambda: _price_from_env())
    #: Seconds an idle client connection stays open. Behind a load balancer it must outlast the balancer's idle
    #: timeout (ALB: router.idle_timeout_s, 900 s by default), or the router closes connections the balancer
    #: still reuses and clients see sporadic 502s; the CDK stack passes idle timeout + 60 s.
    keepalive_timeout: float = 75.0
    #: Serve without API keys on a non-loopback address (refused unless set: open mode serves anyone who can
    #: reach the port, and all of them share one tenant).
    allow_open: bool = False
    #: Where clients' session ids are read, in priority order (``header:NAME`` / ``body:FIELD``). They are
    #: hints (decode affinity, metric labels), never keys to KV: see router/hints.py.
    session_hints: list[str] = field(default_factory=lambda: list(hints.DEFAULT_SOURCES))
    #: Hosts media URLs may name (exact names, as the engines' ``--allowed-media-domains``); empty: any host on
    #: the internet (every name resolved and checked, ``router.media``). Also from ``TURNKV_MEDIA_DOMAINS``
    #: (comma-separated). docs/router.md "Media URLs".
    media_domains: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tunables = params.validate({}, self.tunables)
        if isinstance(self.prefill_price_per_hour, bool) or not isinstance(self.prefill_price_per_hour, (int, float)) \
                or not 0 <= self.prefill_price_per_hour < 1e6:
            raise ValueError(f"prefill_price_per_hour {self.prefill_price_per_hour!r}: expected USD per prefill "
                             "engine-hour, a number >= 0")
        if self.mode not in ("pull", "push"):
            raise ValueError(f"mode {self.mode!r}: expected pull or push")
        if self.discovery not in ("static", "cloudmap"):
            raise ValueError(f"discovery {self.discovery!r}: expected static or cloudmap")
        if self.discovery == "cloudmap" and not self.namespace:
            raise ValueError("--discovery cloudmap needs --namespace (and --service)")
        if self.discovery == "static" and (not self.prefill or not self.decode):
            raise ValueError("the router needs at least one --prefill and one --decode engine URL "
                             "(or --discovery cloudmap)")
        if not (self.store == "memory" or self.store.startswith(("redis://", "rediss://", "unix://"))):
            raise ValueError(f"store {self.store!r}: expected memory or redis://HOST:PORT (rediss:// for TLS)")
        if isinstance(self.key_secret, str):
            self.key_secret = self.key_secret.encode()
        if isinstance(self.offer_secret, str):
            self.offer_secret = self.offer_secret.encode()
        if self.offer_secret is None:
            self.offer_secret = wire.offer_secret()
        hints.parse_sources(self.session_hints)  # a ValueError names a bad source
        if self.policy not in ("least_load", "round_robin"):
            raise ValueError(f"policy {self.policy!r}: expected least_load or round_robin")
        if not self.media_domains and os.environ.get(router_env.MEDIA_DOMAINS):
            self.media_domains = os.environ[router_env.MEDIA_DOMAINS].split(",")
        self.media_domains = [d.strip().lower().rstrip(".") for d in self.media_domains if d.strip()]
        internal = [d for d in self.media_domains if media.internal_host(d)]
        if internal:
            raise ValueError(f"media_domains {internal} name internal addresses; engines must not fetch media from "
                             "inside the network")
        if not self.key_secret and os.environ.get(KEY_SECRET_ENV):
            self.key_secret = os.environ[KEY_SECRET_ENV].encode()

    def ensure_secret(self) -> bytes:
        if not self.key_secret:
            self.key_secret = secrets.token_bytes(32)
        return self.key_secret

    def entry_lifetime(self) -> float:
        """Seconds a stored entry may be replayed: the router TTL, and always before decode frees blocks."""
        t = self.tunables
        return lifetime.entry_lifetime(t["conversation_ttl"], t["decoder_kv_blocks_ttl"], t["expiry_margin"])

    def api_keys_text(self) -> list[str]:
        texts = []
        if self.api_keys_file:
            texts.append(Path(self.api_keys_file).read_text())
        if os.environ.get(API_KEYS_ENV):
            texts.append(os.environ[API_KEYS_ENV])
        return texts

    def __getattr__(self, name: str) -> int | float:
        # Tunables read as attributes: config.first_token_timeout, config.max_body_bytes, ...
        tunables = self.__dict__.get("tunables", {})
        if name in tunables:
            return tunables[name]
        raise AttributeError(name)


def _price_from_env() -> float:
    """``TURNKV_PREFILL_ENGINE_PRICE_PER_HOUR`` as a float (0 when unset); a malformed value is an error naming it."""
    raw = os.environ.get(router_env.PREFILL_PRICE, "").strip()
    if not raw:
        return 0.0
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{router_env.PREFILL_PRICE}={raw!r}: expected USD per prefill engine-hour (a number)") \
            from None


def load_file(path: str | Path) -> dict[str, Any]:
    """A config file as a mapping of RouterConfig field names (``set`` / ``tunables``: catalog names)."""
    p = Path(path)
    if p.suffix in (".yaml", ".yml"):
        raise ValueError(f"{p}: router settings are JSON or TOML; a YAML file is a deploy config (check it with "
                         "`turnkv config validate`, deploy it with `cdk deploy -c turnkv:config=FILE`)")
    raw = p.read_bytes()
    try:
        data = tomllib.loads(raw.decode()) if p.suffix == ".toml" else orjson.loads(raw)
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, orjson.JSONDecodeError) as exc:
        kind = "TOML" if p.suffix == ".toml" else "JSON (name the file .toml for TOML)"
        raise ValueError(f"{p}: malformed {kind}: {exc}; fix the syntax there") from None
    if not isinstance(data, dict):
        raise ValueError(f"{p}: expected a mapping of settings")
    data = {k.replace("-", "_"): v for k, v in data.items()}
    known = {f.name for f in fields(RouterConfig)} | {"set"}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"{p}: unknown setting(s) {sorted(unknown)}; known: {sorted(known)}")
    if "set" in data:
        data["tunables"] = {**data.pop("set"), **data.get("tunables", {})}
    return data


def build(file_values: Mapping[str, Any], flag_values: Mapping[str, Any], tunable_changes: Mapping[str, Any]
          ) -> RouterConfig:
    """File < flags; tunables validated over the catalog defaults."""
    values: dict[str, Any] = dict(file_values)
    values.update({k: v for k, v in flag_values.items() if v not in (None, [], ())})
    changes = {**values.pop("tunables", {}), **tunable_changes}
    values["tunables"] = params.validate(params.fit_router_ttl(changes))
    return RouterConfig(**values)
