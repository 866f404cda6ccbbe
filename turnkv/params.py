"""The catalog of tunables: name, default, bounds, SSM path and help, defined once.

Everything that reads or writes a knob (the router, the connector's hot-reload file, the CDK params
stack, ``turnkv params``) goes through this module, so a default or a bound lives in exactly one place.
Pure logic: no I/O.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from turnkv import lifetime
from turnkv.engine_settings import VLLM_MAX_NUM_SEQS_LARGE_GPU

SSM_PREFIX = "/turnkv"


class Scope(StrEnum):
    """Who consumes a tunable: the vLLM engines (through the connector) or the router."""

    ENGINE = "engine"
    ROUTER = "router"


class ParamError(ValueError):
    """A value that the catalog refuses; the message names the tunable and the allowed range."""


@dataclass(frozen=True)
class Tunable:
    name: str
    default: int | float
    minimum: int | float
    maximum: int | float
    unit: str
    scope: Scope
    help: str
    kind: type = int
    #: Engine scope: the connector applies a new value from the tunables file without a restart
    #: (``connector.tunables``).
    reloadable: bool = False

    def ssm_path(self, deployment: str) -> str:
        return f"{SSM_PREFIX}/{deployment}/{self.scope.value}/{self.name}"

    @property
    def allowed(self) -> str:
        return f"{self.minimum}..{self.maximum} {self.unit}".strip()

    def parse(self, raw: str | int | float) -> int | float:
        """Parse and bound-check one value; raise ParamError naming the fix."""
        try:
            if self.kind is int:
                if isinstance(raw, float) and not raw.is_integer():
                    raise ValueError
                value: int | float = int(str(raw).strip()) if not isinstance(raw, (int, float)) else int(raw)
            else:
                value = float(raw)
        except (TypeError, ValueError):
            raise ParamError(f"{self.name}: {raw!r} is not {'an integer' if self.kind is int else 'a number'}; "
                             f"allowed {self.allowed}") from None
        if not (self.minimum <= value <= self.maximum):
            raise ParamError(f"{self.name}: {value} is out of range; allowed {self.allowed}")
        return value


CATALOG: tuple[Tunable, ...] = (
    Tunable("decoder_kv_blocks_ttl", 480, 10, 3600, "s", Scope.ENGINE,
            "How long a decode engine keeps a finished turn's KV blocks for the next turn's prefill to pull.",
            reloadable=True),
    Tunable("kv_recompute_threshold", 64, 0, 1_000_000, "tokens", Scope.ENGINE,
            "Prefill recomputes instead of pulling when fewer tokens than this would be reused.", reloadable=True),
    Tunable("inline_pull_max_ms", 25, 0, 10_000, "ms", Scope.ENGINE,
            "Prefill reads a pull predicted to take at most this long inside the step that computes the request (a "
            "synchronous KV load, connector.inline), instead of parking the request for two engine steps (the READ "
            "posted after one step, its end seen after the next). Only from decode engines already handshaken and "
            "laid out alike; 0: every pull asynchronous, as upstream.", float, reloadable=True),
    Tunable("kv_lease_duration", 30, 5, 600, "s", Scope.ENGINE,
            "How long prefill holds blocks for decode to read (extended by decode heartbeats)."),
    Tunable("expiry_skew_margin", 5, 0, 120, "s", Scope.ENGINE,
            "Prefill refuses to read a decode offer this long before the offer's wall-clock expiry (measured on "
            "prefill's own clock), covering clock skew between hosts and the time the read takes.", reloadable=True),
    Tunable("retained_kv_share", 0.5, 0.0, 1.0, "share", Scope.ENGINE,
            "Share of decode's KV cache that may hold finished turns for next turns; a turn that does not fit goes "
            "to the host tier (host_kv_budget_mib) or, with no room there either, is not retained.", float,
            reloadable=True),
    Tunable("host_kv_budget_mib", 0, 0, 4 * 1024 * 1024, "MiB", Scope.ENGINE,
            "Host memory per decode engine for retained turns that do not fit in retained_kv_share of the device "
            "cache (the host tier; prefill reads them there with the same NIXL READ). Allocated and registered at "
            "engine start; a reload can lower it or raise it back up to the size the engine started with; 0: no "
            "host tier.", reloadable=True),
    Tunable("retention_idle_evict", 0, 0, 3600, "s", Scope.ENGINE,
            "A retained turn unread and unrenewed for this long may be evicted to make room for a newer one; 0: "
            "twice the 90th percentile of how long retained turns waited before being read (the TTL until 8 reads "
            "are seen). Younger turns are kept and the newcomer is not retained, so reuse degrades to the share "
            "that fits instead of collapsing under oldest-first eviction.", float, reloadable=True),
    Tunable("retention_idle_floor", 10, 0, 3600, "s", Scope.ENGINE,
            "With retention_idle_evict 0, a retained turn counts as idle after at least this long, however fast its "
            "tenant's turns were read before (idle is measured per tenant, twice the 90th percentile of its own read "
            "delays): a burst of quick reads cannot make a tenant's turns, or anyone else's, go after a second.",
            float, reloadable=True),
    Tunable("fork_window", 0, 0, 600, "s", Scope.ENGINE,
            "Decode keeps a retained turn readable this long after its first read, so forks of one history "
            "(parallel samples, subagents, retries) each pull it instead of recomputing; read turns are the first "
            "evicted when room is needed. 0 (the default): single use, the first read frees the blocks. Read turns "
            "hold their room fork_window + 7 s longer: under retention pressure that room is the next turn's (make "
            "demo's pressure row at 2x what fits: 7/16 later turns reused at 10 s, 11/16 at 0); set it (10 s) for "
            "agents that fork and have room to spare.", float, reloadable=True),
    Tunable("retention_eviction_grace", 30, 5, 600, "s", Scope.ENGINE,
            "Decode frees an evicted turn's blocks this long after announcing the eviction on its evictions feed; "
            "must exceed replay_window + 2 x evictions_interval + max(1 s, evictions_interval) + "
            "expiry_skew_margin, "
            "so no router still replays, and no prefill still reads, the evicted offer.", float, reloadable=True),
    Tunable("conversation_ttl", 450, 5, 3600, "s", Scope.ROUTER,
            "How long the router keeps a conversation's decode kv_transfer_params; must stay below "
            "decoder_kv_blocks_ttl."),
    Tunable("expiry_margin", 10, 5, 120, "s", Scope.ROUTER,
            "A stored entry is dropped this long before the engine's remote_blocks_expiry_time "
            "(prefill declines reads within 5 s of expiry)."),
    Tunable("store_timeout_ms", 50, 1, 5000, "ms", Scope.ROUTER,
            "Past this, a conversation-store call is abandoned and the request proceeds without reuse."),
    Tunable("max_conversations", 100_000, 100, 10_000_000, "entries", Scope.ROUTER,
            "Bound of the in-memory conversation store (least recently used entries go first)."),
    Tunable("max_store_bytes", 256 * 1024 * 1024, 1024 * 1024, 64 * 1024 * 1024 * 1024, "bytes", Scope.ROUTER,
            "Bound of the in-memory conversation store in bytes of stored entries (least recently used go first)."),
    Tunable("max_inflight", 4096, 1, 1_000_000, "requests", Scope.ROUTER,
            "Admission control: requests in flight in one router; above it new requests get 429."),
    Tunable("responses_ttl", 3600, 0, 30 * 86400, "s", Scope.ROUTER,
            "How long the router keeps a /v1/responses answer's conversation (store: true, the API's default) so a "
            "later request can continue it by previous_response_id; 0 keeps none."),
    Tunable("responses_max_bytes", 256 * 1024 * 1024, 1024 * 1024, 64 * 1024 * 1024 * 1024, "bytes", Scope.ROUTER,
            "Memory bound of the kept responses in an in-memory store (least recently used dropped first); "
            "kept apart from the conversation store so long histories never push out KV metadata."),
    Tunable("tenant_max_inflight", 256, 1, 1_000_000, "requests", Scope.ROUTER,
            "Admission control per tenant (API key): requests in flight; above it that tenant gets 429. A sixteenth "
            "of max_inflight by default, so it takes 16 saturating keys, not 4, to fill the router."),
    Tunable("tenant_max_conversations", 10_000_000, 1, 10_000_000, "conversations", Scope.ROUTER,
            "A ceiling of the live conversations (retained turns) one tenant may hold whatever the others do; above "
            "it new turns are not retained. The default (the maximum) sets none: tenants share max_conversations "
            "max-min (while there is room anyone may retain; once full, only a tenant under the fair level does)."),
    Tunable("max_body_buffer_bytes", 512 * 1024 * 1024, 1024 * 1024, 64 * 1024 * 1024 * 1024, "bytes",
            Scope.ROUTER,
            "Request body bytes all requests together may be buffering at once (by Content-Length, else as read); "
            "above it 429. Bounds the router's memory against slow or parked bodies."),
    Tunable("router_body_rate", 256 * 1024 * 1024, 1024 * 1024, 64 * 1024 * 1024 * 1024, "bytes/s", Scope.ROUTER,
            "Request body bytes per second the router takes from all tenants together before it holds them to max-min "
            "fair shares of this (charged by Content-Length before reading, averaged over about 2 s): while the "
            "tenants sending lately ask for less in all nobody is limited (nor is a tenant alone); beyond, "
            "each tenant may send its fair share (the heaviest is cut first, one asking less than the fair level "
            "never is); above it 429 naming tenant_body_rate. Bounds the JSON parsing and hashing the router does."),
    Tunable("tenant_body_rate", 64 * 1024 * 1024 * 1024, 1024, 64 * 1024 * 1024 * 1024, "bytes/s", Scope.ROUTER,
            "A ceiling of one tenant's request body bytes per second whatever the others do (token bucket, burst of "
            "max_body_bytes or 2 s, whichever is more); above it 429. The default (the maximum) sets none: tenants "
            "share router_body_rate max-min."),
    Tunable("tenant_max_body_buffer_bytes", 32 * 1024 * 1024, 1024, 64 * 1024 * 1024 * 1024, "bytes",
            Scope.ROUTER,
            "Request body bytes one tenant may be buffering at once; above it that tenant gets 429."),
    Tunable("body_read_timeout", 30, 1, 3600, "s", Scope.ROUTER,
            "A request body must arrive whole within this time of its headers; past it 408 (slow-body deadline).",
            float),
    Tunable("max_messages", 4096, 1, 1_000_000, "messages", Scope.ROUTER,
            "Most chat messages (or Responses input items) in one request; above it 413. Every message is hashed "
            "on the router's event loop; a body with more than 16 x this many JSON objects is refused before it is "
            "parsed (parsing 240,000 small objects blocks the loop for 0.2 s)."),
    Tunable("tenant_message_rate", 20_000.0, 1, 100_000_000, "messages/s", Scope.ROUTER,
            "Chat messages (or Responses input items) one tenant may send per second, over all its requests (token "
            "bucket, burst of 2 s or 2 x max_messages, whichever is more); above it 429. Each message is hashed on "
            "the event loop (about 2 us): the default bounds one tenant to a few percent of a core.", float),
    Tunable("tenant_loop_share", 0.25, 0.01, 1.0, "share", Scope.ROUTER,
            "Share of the router's event loop one tenant's requests may take (their handlers' steps, timed as they "
            "run, averaged over about 2 s) while the loop is busier than twice this in all and another tenant uses "
            "it too; above it that tenant's new requests get 429 before their bodies are read. Keep it above the "
            "share the heaviest legitimate tenant takes (at 0.1 the hostile bench's bystander was refused). 1 switches "
            "it off.",
            float),
    Tunable("router_request_rate", 5000.0, 1, 1_000_000, "requests/s", Scope.ROUTER,
            "Requests per second the router starts for all tenants together (completions, the translated APIs and "
            "/v1/models, averaged over about 2 s) before it holds them to max-min fair shares of this: while the "
            "tenants asking lately ask for less in all nobody is limited (a tenant alone never is; one router "
            "process serves about 1,500/s); beyond, each tenant may start its fair share (token bucket, burst of "
            "2 s, at least 10): the heaviest is cut first, one asking less than the fair level never is; above it 429 "
            "naming tenant_request_rate.", float),
    Tunable("tenant_request_rate", 1_000_000.0, 0.01, 1_000_000, "requests/s", Scope.ROUTER,
            "A ceiling of one tenant's requests per second whatever the others do (token bucket, burst of 2x, at "
            "least 10); above it 429. The default (the maximum) sets none: tenants share router_request_rate "
            "max-min.", float),
    Tunable("prefill_fair_tokens", 2048, 64, 100_000_000, "tokens", Scope.ROUTER,
            "Prompt tokens to compute (the request's estimate less the tokens its replayed offer would pull) each "
            "prefill engine of the pool is sent at once, counted from a request's prefill until decode's first token, "
            "before further requests wait in the router's fair queue (router.fairqueue) instead of the engines' own "
            "first-come queue: a tenant alone is never held, one under the max-min fair level of this goes at once, "
            "and the tenant with the most in flight waits first. About one prefill step: set it to the engines' "
            "max_num_batched_tokens (vLLM's default is 2048 on GPUs under 70 GiB, 8192 on H100/H200), two steps if "
            "prefill engines idle under contention. The maximum switches it off."),
    Tunable("decode_fair_sequences", VLLM_MAX_NUM_SEQS_LARGE_GPU, 1, 100_000_000, "sequences", Scope.ROUTER,
            "Sequences each decode engine of the pool is sent at once, counted from a request's dispatch until its "
            "answer ends, before further requests wait in the router's fair queue (router.fairqueue; a request holds "
            "one unit per sequence it asks for, n x prompts, at most the whole pool: router.choices) instead of the "
            "engine's own first-come waiting queue, where a tenant with more requests in flight than the engine runs "
            "sequences goes ahead of everyone after them for as long as its generations last: a tenant under the "
            "max-min fair level goes at once, the tenant with the most in flight waits first, and a tenant alone gets "
            "all of it (not more: the engines run no more at once). Per router process. Set it to the decode engines' "
            "max_num_seqs (vLLM's default is 1024 on H100/H200, 256 on smaller GPUs, 128 on CPU). The maximum "
            "switches it off."),
    Tunable("max_choices", 128, 1, 100_000, "sequences", Scope.ROUTER,
            "Most sequences one request may ask for: n x prompts (a /v1/completions list of prompts; beam search's "
            "width is n); above it 400. Each is a sequence decode runs and a unit of decode_fair_sequences the request "
            "holds, and each prompt of a list is a P/D pair of its own: without a bound one request of n 16,384 "
            "would put 16,384 sequences on decode. OpenAI's own bound on n is 128."),
    Tunable("tenant_max_response_bytes", 32 * 1024 * 1024, 1024, 64 * 1024 * 1024 * 1024, "bytes", Scope.ROUTER,
            "Bytes of kept /v1/responses histories one tenant may hold (memory and Valkey, per router process); "
            "above it new answers are not kept (previous_response_id then answers not found)."),
    Tunable("max_retained_tokens", 500_000_000, 1000, 100_000_000_000, "tokens", Scope.ROUTER,
            "Tokens of decode KV the live conversations of all tenants together may retain (per router process) "
            "before tenants are held to max-min fair shares of it: once full, only a tenant under the fair level "
            "retains new turns, so the heaviest holder stops growing first; decode's own bound is retained_kv_share."),
    Tunable("tenant_max_retained_tokens", 10_000_000_000, 1000, 10_000_000_000, "tokens", Scope.ROUTER,
            "A ceiling of the tokens of decode KV one tenant's live conversations may retain whatever the others do; "
            "above it new turns are not retained. The default (the maximum) sets none: tenants share "
            "max_retained_tokens max-min."),
    Tunable("lease_max_ttl", 900, 10, 3600, "s", Scope.ROUTER,
            "Longest lease a client may ask for on a conversation's retained KV."),
    Tunable("tenant_lease_rate", 2.0, 0.01, 1000, "renewals/s", Scope.ROUTER,
            "Lease renewals one tenant may make per second (token bucket, burst of 10x); above it 429.", float),
    Tunable("write_timeout", 30, 1, 3600, "s", Scope.ROUTER,
            "A client that does not take a streamed chunk within this time is cut off (slow-reader deadline)."),
    Tunable("prefill_timeout", 120, 1, 3600, "s", Scope.ROUTER,
            "Deadline for the prefill leg before it is retried elsewhere."),
    Tunable("first_token_timeout", 300, 1, 3600, "s", Scope.ROUTER,
            "Deadline for the decode leg's first byte."),
    Tunable("sse_keepalive", 15, 1, 300, "s", Scope.ROUTER,
            "Interval of SSE comments sent before the first token, so idle-timeout proxies keep streams open."),
    Tunable("max_body_bytes", 8 * 1024 * 1024, 1024, 256 * 1024 * 1024, "bytes", Scope.ROUTER,
            "Largest request body the router accepts (413 above)."),
    Tunable("prefill_retries", 2, 0, 10, "retries", Scope.ROUTER,
            "Retry budget of a failed or timed-out prefill leg, each on another prefill engine when one is healthy."),
    Tunable("decode_retries", 1, 0, 10, "retries", Scope.ROUTER,
            "Retry budget of a decode leg that fails before its first token (both legs again, on another decode "
            "engine, without reuse)."),
    Tunable("decode_migrations", 1, 0, 5, "migrations", Scope.ROUTER,
            "A stream whose decode engine dies after tokens went out continues on another decode engine (prefill "
            "of prompt + tokens so far, then decode) up to this many times; 0: end it with an error event."),
    Tunable("health_interval", 2.0, 0.2, 60, "s", Scope.ROUTER,
            "Interval of the active /health probes of every engine.", float),
    Tunable("evictions_interval", 1.0, 0.2, 10, "s", Scope.ROUTER,
            "Interval of the router's reads of each decode engine's evictions feed; an engine whose feed is older "
            "than 2 x this (plus one read) has none of its offers replayed.", float),
    Tunable("replay_window", 10, 1, 300, "s", Scope.ROUTER,
            "A replayed offer must be read by prefill within this time of the router's take, else prefill "
            "recomputes (bounds the time between the router's last look at decode's evictions and the read).",
            float),
    Tunable("eject_failures", 1, 1, 20, "failures", Scope.ROUTER,
            "Consecutive failures (probes or requests) after which an engine is ejected from the pool."),
    Tunable("return_successes", 2, 1, 20, "probes", Scope.ROUTER,
            "Consecutive successful probes before an ejected engine returns to the pool."),
    Tunable("slow_start", 30, 0, 600, "s", Scope.ROUTER,
            "A returning engine's share of new requests ramps from 10% to 100% over this time."),
    Tunable("tokens_per_request", 2048, 1, 1_000_000, "tokens", Scope.ROUTER,
            "Load weight: this many outstanding prompt tokens count as one outstanding request."),
    Tunable("affinity_slack", 4, 0, 1000, "requests", Scope.ROUTER,
            "Decode affinity: keep a conversation on the decode engine holding its blocks unless that engine "
            "carries this much more load (in requests) than the least loaded one."),
    Tunable("prefill_affinity_slack", 4, 0, 1000, "requests", Scope.ROUTER,
            "Prefill affinity: a request whose shared prefix (render settings + leading system messages) is known "
            "goes to the prefill engine its tenant and prefix hash to (rendezvous), whose prefix cache likely holds "
            "it, unless that engine carries this much more load (in requests; tokens_per_request prompt tokens "
            "count as one) than the least loaded one; then to the least loaded. 0: off (load alone)."),
    Tunable("prefill_affinity_min_bytes", 1024, 0, 100_000_000, "bytes", Scope.ROUTER,
            "Prefill affinity applies when the shared prefix (the tools' JSON + the leading system/developer "
            "messages) is at least this long; shorter prefixes save too little prefill to outweigh load balance."),
    Tunable("discovery_interval", 10, 1, 600, "s", Scope.ROUTER,
            "Interval of Cloud Map discovery refreshes."),
    Tunable("params_refresh", 60, 5, 3600, "s", Scope.ROUTER,
            "Interval of the router's re-read of its SSM parameters (applied without restart)."),
)

BY_NAME: dict[str, Tunable] = {t.name: t for t in CATALOG}


def get(name: str) -> Tunable:
    try:
        return BY_NAME[name]
    except KeyError:
        raise ParamError(unknown(name)) from None


def unknown(name: str) -> str:
    """The message for a name the catalog lacks: the closest names where some are close (a typo), else where the
    list is (the catalog has ~60 names: listing them all buried the one meant)."""
    close = difflib.get_close_matches(name, BY_NAME, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(close)}?" if close else "no tunable is named like it"
    return f"unknown tunable {name!r}; {hint} (`turnkv params catalog` lists all {len(BY_NAME)})"


def defaults(scope: Scope | None = None) -> dict[str, int | float]:
    return {t.name: t.default for t in CATALOG if scope is None or t.scope is scope}


def value(values: Mapping[str, int | float], name: str) -> int | float:
    """``name``'s value in ``values``, else its catalog default (never a default retyped at the call site)."""
    return values.get(name, get(name).default)


#: The rules ``cross_check`` enforces, in words (docs/parameters.md is generated from them and the catalog).
CROSS_CHECKS: tuple[str, ...] = (
    "conversation_ttl + expiry_margin must stay at or below decoder_kv_blocks_ttl, else the router would replay "
    "offers for blocks decode has already freed. `turnkv params set decoder_kv_blocks_ttl=N` alone lowers "
    "conversation_ttl to fit (N - expiry_margin).",
    "retention_eviction_grace must be at least replay_window + 2 x evictions_interval + max(1 s, evictions_interval) "
    "+ expiry_skew_margin, else decode would free an evicted turn's "
    "blocks while a router may still replay its offer or a prefill still read it.",
)


def cross_problems(values: Mapping[str, int | float]) -> list[str]:
    """Every broken rule that spans tunables, in words (``CROSS_CHECKS``). ``values`` holds a full set."""
    out = []
    ttl = values["conversation_ttl"]
    engine_ttl = values["decoder_kv_blocks_ttl"]
    margin = values["expiry_margin"]
    if not lifetime.conversation_fits(ttl, engine_ttl, margin):
        out.append(
            f"conversation_ttl ({ttl} s) + expiry_margin ({margin} s) must stay below decoder_kv_blocks_ttl "
            f"({engine_ttl} s): the router would replay params for blocks decode has already freed; "
            f"lower conversation_ttl or raise decoder_kv_blocks_ttl")
    needed = eviction_grace_needed(values)
    if values["retention_eviction_grace"] < needed:
        out.append(
            f"retention_eviction_grace ({values['retention_eviction_grace']} s) must be at least {needed:g} s "
            f"(replay_window + 2 x evictions_interval + max(1, evictions_interval) + expiry_skew_margin): decode would "
            f"free an evicted turn's blocks while a router may still replay its offer or a prefill still read it")
    return out


def cross_check(values: Mapping[str, int | float]) -> None:
    """Rules that span tunables. ``values`` holds a full set (defaults filled in); raises naming every one broken."""
    if found := cross_problems(values):
        raise ParamError("; ".join(found))


def eviction_grace_needed(values: Mapping[str, int | float]) -> float:
    """The shortest safe ``retention_eviction_grace``: a router sees an eviction within 2 x evictions_interval
    (the feed's age limit) plus one read (at most max(1, evictions_interval)); the offer it replayed just before
    is read within replay_window, and expiry_skew_margin covers the hosts' clocks."""
    interval = float(values["evictions_interval"])
    return (float(values["replay_window"]) + 2 * interval + max(1.0, interval)
            + float(values["expiry_skew_margin"]))


def fit_router_ttl(changes: Mapping[str, object],
                   current: Mapping[str, int | float] | None = None) -> dict[str, object]:
    """When only the engines' TTL is changed, fit the router's conversation TTL inside it (N - expiry_margin).

    Without ``current`` (a fresh stack: ``turnkv local up --set``, the router's ``--set``) it is set to that value.
    Over ``current`` (stored values: ``turnkv params set``) it is only lowered, and only when the stored one no
    longer fits: raising the engines' TTL leaves the router's as the operator set it."""
    out = dict(changes)
    if "decoder_kv_blocks_ttl" in out and "conversation_ttl" not in out:
        try:
            ttl = get("decoder_kv_blocks_ttl").parse(out["decoder_kv_blocks_ttl"])  # type: ignore[arg-type]
            margin_raw = out.get("expiry_margin", value(current or {}, "expiry_margin"))
            margin = get("expiry_margin").parse(margin_raw)  # type: ignore[arg-type]
        except ParamError:
            return out  # validate() reports the bad value
        fitted = lifetime.fitted_conversation_ttl(ttl, margin, BY_NAME["conversation_ttl"].minimum)
        if current is None or not lifetime.conversation_fits(value(current, "conversation_ttl"), ttl, margin):
            out["conversation_ttl"] = fitted
    return out


def _merged(changes: Mapping[str, object], current: Mapping[str, int | float] | None,
            ) -> tuple[dict[str, int | float], list[tuple[str | None, str]]]:
    """``changes`` parsed over ``current`` (defaults when None), and every problem found (:func:`problems`)."""
    merged: dict[str, int | float] = {**defaults(), **(current or {})}
    found: list[tuple[str | None, str]] = []
    for name, raw in changes.items():
        try:
            merged[name] = get(name).parse(raw)  # type: ignore[arg-type]
        except ParamError as exc:
            found.append((name, str(exc)))
    if not found:
        found += [(None, message) for message in cross_problems(merged)]
    return merged, found


def problems(changes: Mapping[str, object], current: Mapping[str, int | float] | None = None,
             ) -> list[tuple[str | None, str]]:
    """Every problem of ``changes`` over ``current`` at once: (tunable, message) for each bad name or value, then
    (None, message) for each cross rule broken (judged only when every value parsed)."""
    return _merged(changes, current)[1]


def validate(changes: Mapping[str, object], current: Mapping[str, int | float] | None = None) -> dict[str, int | float]:
    """Parse ``changes`` over ``current`` (defaults when None) and cross-check the result; raises naming every
    problem (:func:`problems`)."""
    merged, found = _merged(changes, current)
    if found:
        raise ParamError("; ".join(message for _, message in found))
    return merged


#: File the node's SSM sync writes and the connector hot-reloads (engine-scope tunables as JSON).
TUNABLES_FILE_ENV = "TURNKV_TUNABLES_FILE"
DEFAULT_TUNABLES_FILE = "/etc/turnkv/tunables.json"
