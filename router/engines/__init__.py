"""The engine pool: which prefill and decode engines exist, their health and load, and which to use.

Pure state and decisions (no I/O): discovery (``router.engines.discovery``) feeds the membership,
the health loop (``router.engines.health``) and the request flow report successes and failures, and
a choice policy (``router.engines.policy``) picks an engine per leg; a prefill leg whose request has a shared
prompt prefix goes to that prefix's engine first (``router.engines.prefix``, bounded by load).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, urlsplit

from router.engines import prefix
from router.engines.evictions import EvictionFeed
from router.engines.policy import ChoicePolicy, LeastLoad
from router.guard import normalize_host
from turnkv import params

ROLES = ("prefill", "decode")


def join_host_port(host: str, port: int | str) -> str:
    """``host:port``, with IPv6 literals in brackets (``[fd00::1]:8000``)."""
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class PushIdentity:
    """What a decode engine must be told about its prefill engine before prefill answers (push mode)."""

    engine_id: str
    host: str
    port: int
    tp_size: int = 1
    pp_size: int = 1


@dataclass(eq=False)
class Engine:
    url: str
    role: str  # "prefill" or "decode"
    engine_id: str = ""
    side_channel_host: str = ""
    side_channel_port: int = 0
    tp_size: int = 1
    healthy: bool = True
    outstanding: int = 0
    outstanding_tokens: int = 0
    failures: int = 0  # consecutive
    successes: int = 0  # consecutive probe successes while ejected
    returned_at: float = 0.0  # when it last came back (slow start), pool clock
    down_at_wall: float = 0.0  # wall clock of its last ejection: blocks it held before may be gone
    learned: PushIdentity | None = None  # identity learned from a push answer
    #: The NIXL engine id this prefill engine's last answer named (its own word; a restart may change it).
    answered_id: str = ""
    feed: EvictionFeed = field(default_factory=EvictionFeed)  # decode: the turns it evicted (router.engines.evictions)
    name: str = field(default="")

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"engine URL {self.url!r} must look like http://HOST:PORT")
        if not self.name:
            self.name = self.engine_id or parts.netloc

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    @property
    def nixl_id(self) -> str:
        """The engine's NIXL engine id as far as the router knows: what its answers name, else its listed
        ``engine_id`` ("": unknown). A clearance names it (``turnkv.wire.CLEARED_FOR``)."""
        return self.answered_id or self.engine_id

    @property
    def push_identity(self) -> PushIdentity | None:
        """P's identity for a concurrent push dispatch: discovered, else learned, else unknown."""
        if self.engine_id and self.side_channel_host and self.side_channel_port:
            return PushIdentity(self.engine_id, self.side_channel_host, self.side_channel_port, self.tp_size)
        return self.learned

    def weight(self, now: float, slow_start: float) -> float:
        """Share of new requests: ramps from 0.1 to 1 over ``slow_start`` seconds after a return."""
        if not self.returned_at or slow_start <= 0:
            return 1.0
        return min(1.0, 0.1 + 0.9 * max(0.0, now - self.returned_at) / slow_start)


def parse_engine(spec: str, role: str) -> Engine:
    """``http://host:port`` with optional identity as a query string:
    ``http://10.0.0.5:8000?engine_id=prefill-0&side_channel_port=5600&side_channel_host=10.0.0.5&tp_size=1``."""
    parts = urlsplit(spec)
    if parts.scheme != "http" or not parts.hostname:
        bare = spec.split("://", 1)[-1]
        raise ValueError(f"engine {spec!r}: give http://host:port, e.g. http://{bare or '127.0.0.1:8100'} (the legs "
                         "speak plain HTTP/1.1, router.upstream)")
    attrs = dict(parse_qsl(parts.query))
    unknown = set(attrs) - {"engine_id", "side_channel_host", "side_channel_port", "tp_size"}
    if unknown:
        raise ValueError(f"engine {spec!r}: unknown attribute(s) {sorted(unknown)}")
    url = parts._replace(query="", fragment="").geturl()
    side_host = attrs.get("side_channel_host") or (parts.hostname if "side_channel_port" in attrs else "") or ""
    try:
        return Engine(url, role, engine_id=attrs.get("engine_id", ""), side_channel_host=side_host,
                      side_channel_port=int(attrs.get("side_channel_port", 0)), tp_size=int(attrs.get("tp_size", 1)))
    except ValueError as exc:
        raise ValueError(f"engine {spec!r}: {exc}") from None


class NoEngineError(RuntimeError):
    """No healthy engine of a role is available (HTTP 503)."""


class Lease:
    """One leg's share of an engine's load (a request and its prompt tokens), counted in when taken and out
    exactly once, whichever way the leg ends: ``release`` is idempotent and ``with`` releases on exit, so load
    accounting can neither leak nor go negative."""

    __slots__ = ("_held", "engine", "tokens")

    def __init__(self, engine: Engine, tokens: int) -> None:
        self.engine, self.tokens, self._held = engine, tokens, True
        engine.outstanding += 1
        engine.outstanding_tokens += tokens

    def release(self) -> None:
        if self._held:
            self._held = False
            self.engine.outstanding -= 1
            self.engine.outstanding_tokens -= self.tokens

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


class EnginePool:
    def __init__(self, prefill: Iterable[str | Engine] = (), decode: Iterable[str | Engine] = (),
                 policy: ChoicePolicy | None = None, tunables: Mapping[str, float] | None = None,
                 clock: Callable[[], float] = time.monotonic, require: bool = True) -> None:
        self.prefill = [e if isinstance(e, Engine) else parse_engine(e, "prefill") for e in prefill]
        self.decode = [e if isinstance(e, Engine) else parse_engine(e, "decode") for e in decode]
        if require and (not self.prefill or not self.decode):
            raise ValueError("the router needs at least one --prefill and one --decode engine URL "
                             "(or --discovery cloudmap)")
        self.policy: ChoicePolicy = policy or LeastLoad()
        self.tunables: Mapping[str, float] = tunables if tunables is not None else {}
        self.clock = clock
        self.on_change: Callable[[Engine], None] = lambda engine: None
        self.extra_hosts: set[str] = set()

    def _t(self, name: str) -> float:
        return float(params.value(self.tunables, name))

    @property
    def all(self) -> list[Engine]:
        return self.prefill + self.decode

    def by_role(self, role: str) -> list[Engine]:
        return self.prefill if role == "prefill" else self.decode

    def find(self, name: str) -> Engine | None:
        for e in self.all:
            if e.name == name or e.url == name:
                return e
        return None

    @staticmethod
    def lease(engine: Engine, tokens: int) -> Lease:
        """Count one leg on ``engine`` until the lease is released (``with pool.lease(e, n): ...``)."""
        return Lease(engine, tokens)

    def known_hosts(self) -> set[str]:
        """Addresses a replayed ``remote_host`` may name: those of the engines the router knows."""
        hosts = {normalize_host(e.host) for e in self.all}
        hosts |= {normalize_host(e.side_channel_host) for e in self.all if e.side_channel_host}
        hosts |= {normalize_host(h) for h in self.extra_hosts}
        if hosts & {"127.0.0.1", "localhost", "::1"}:
            hosts |= {"127.0.0.1", "localhost", "::1"}
        return hosts

    def replace(self, role: str, engines: Sequence[Engine]) -> None:
        """New membership from discovery; engines already known keep their health and load state."""
        current = {e.url: e for e in self.by_role(role)}
        merged = []
        for e in engines:
            old = current.get(e.url)
            if old is not None:
                old.engine_id, old.side_channel_host = e.engine_id or old.engine_id, e.side_channel_host
                old.side_channel_port, old.tp_size = e.side_channel_port, e.tp_size
                if e.engine_id:
                    old.name = e.engine_id
                merged.append(old)
            else:
                merged.append(e)
        if role == "prefill":
            self.prefill = merged
        else:
            self.decode = merged

    def _candidates(self, role: str, exclude: Sequence[Engine]) -> list[Engine]:
        engines = self.by_role(role)
        candidates = [e for e in engines if e.healthy and e not in exclude]
        if not candidates:  # a retry may go back to an engine it already tried rather than fail
            candidates = [e for e in engines if e.healthy]
        if not candidates:  # panic mode: all ejected (often a moment of overload): try them anyway
            candidates = [e for e in engines if e not in exclude] or list(engines)
        if not candidates:
            raise NoEngineError(f"no {role} engine known (static flags or discovery)")
        return candidates

    def pick(self, role: str, *, exclude: Sequence[Engine] = (), prefer: str = "", tokens: int = 0) -> Engine:
        candidates = self._candidates(role, exclude)
        preferred = None
        if prefer:
            preferred = next((e for e in candidates if e.name == prefer), None)
        return self.policy.choose(candidates, now=self.clock(), preferred=preferred, tunables=self.tunables,
                                  tokens=tokens)

    def pick_prefill(self, prefix_key: str, *, exclude: Sequence[Engine] = (), tokens: int = 0) -> tuple[Engine, str]:
        """A prefill engine for a request with ``prefix_key`` ("" : none) and why (``prefix.REASONS``): the key's
        home engine within ``prefill_affinity_slack``, else the policy's choice. A retry excludes the engines it
        tried, so it goes to the key's next home."""
        candidates = self._candidates("prefill", exclude)
        now = self.clock()
        return prefix.choose(prefix_key, candidates, now=now, tunables=self.tunables,
                             fallback=lambda: self.policy.choose(candidates, now=now, preferred=None,
                                                                 tunables=self.tunables, tokens=tokens))

    # -- health bookkeeping (the flow reports request outcomes, the probe loop reports probes) -----

    def report_failure(self, engine: Engine) -> bool:
        """Count a failure; eject the engine at ``eject_failures`` in a row. True when it was ejected now."""
        engine.failures += 1
        engine.successes = 0
        if engine.healthy and engine.failures >= self._t("eject_failures"):
            engine.healthy = False
            engine.down_at_wall = time.time()
            self.on_change(engine)
            return True
        return False

    def holds_blocks_since(self, name: str, stored_at: float) -> bool:
        """Whether the decode engine ``name`` can still hold blocks of an entry stored at ``stored_at``:
        known, in the pool, and not ejected since (a crashed and restarted engine lost them, and its
        new blocks under the old ids would be read silently)."""
        engine = self.find(name)
        return engine is not None and engine.healthy and engine.down_at_wall < stored_at

    def report_success(self, engine: Engine, probe: bool = False) -> bool:
        """A success; an ejected engine returns after ``return_successes`` probes in a row (then ramps up).
        True when it returned now."""
        engine.failures = 0
        if engine.healthy or not probe:
            return False
        engine.successes += 1
        if engine.successes >= self._t("return_successes"):
            engine.healthy = True
            engine.successes = 0
            engine.returned_at = self.clock()
            self.on_change(engine)
            return True
        return False
