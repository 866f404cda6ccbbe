"""The two-leg P/D dispatch: prefill (``max_tokens=1``) and decode, with multi-turn KV reuse.

Per request:
1. look the turn up by its content (``router.guard``: the digest of its messages up to its last
   assistant reply; no client field needed), take the stored decode params (single-use) and keep them
   only if they name a known engine; a client's session id (``router.hints``) only steers the decode
   engine and labels metrics;
2. send the legs (``router.legs``): pull mode: prefill with those params (a pull of the previous turn's
   KV from decode) or fresh ones, then decode with prefill's params verbatim; push mode: prefill and
   decode at once when the prefill engine's identity is known (decode is told where its KV will come
   from), serially otherwise;
3. stream (``router.relay``) or return decode's answer, sharing one ``X-Request-Id`` (and
   ``transfer_id``) per dispatch;
4. take decode's returned params off the response (engine metadata never reaches a client) and
   store them for the next turn.

Failover: a prefill that fails or times out is retried on another prefill engine (``prefill_retries``);
a decode that fails before its first token is retried with both legs on another decode engine
(``decode_retries``; prefill again, because the blocks of the failed dispatch may already be freed);
a retry after a failed reuse pull goes without reuse (``router.retry`` decides). A client that goes away
cancels the handler, which closes both upstream connections: vLLM aborts requests whose connection closes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import secrets
import time
from collections.abc import Awaitable, Mapping
from typing import Any, TypeVar

import aiohttp
import orjson
from aiohttp import web

from router import (
    apis,
    choices,
    encoded,
    fanout,
    guard,
    hints,
    intake,
    limits,
    media,
    merge,
    migrate,
    retry,
    savings,
    telemetry,
    upstream,
    usage,
)
from router.apis import stored
from router.choices import Serving
from router.config import RouterConfig
from router.dispatch import Dispatch
from router.enginegate import EngineGate
from router.engines import Engine, EnginePool, NoEngineError, evictions
from router.errors import public_message
from router.keepalive import Keepalive
from router.legs import REQUEST_ID_HEADER, Legs, Opened, UpstreamError, new_leg_id
from router.outcomes import RequestKind, ReuseOutcome
from router.relay import Relay, SseResponse, error_event
from router.state import ConversationStore, Entry
from router.telemetry import Metrics
from turnkv import wire

T = TypeVar("T")

log = logging.getLogger("turnkv.router")

# The protocol's header names live in turnkv.wire (clients read them there); bound here for the flow's code.
REUSE_HEADER = wire.REUSE_HEADER
REUSED_TOKENS_HEADER = wire.REUSED_TOKENS_HEADER
PREFILL_CACHED_HEADER = wire.PREFILL_CACHED_HEADER
REUSE_OUTCOME_HEADER = wire.REUSE_OUTCOME_HEADER
CONVERSATION_HEADER = wire.CONVERSATION_HEADER


def error_response(status: int, message: str, kind: str = "invalid_request_error",
                   headers: Mapping[str, str] | None = None, limit: str | None = None) -> web.Response:
    error: dict[str, Any] = {"message": message, "type": kind, "code": status}
    if limit is not None:
        error["limit"] = limit  # the router limit that refused the request (a tunable's name)
    body = {"error": error, "object": "error"}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json", headers=headers)


def _sealed_ranks(params: Mapping[str, Any]) -> int:
    """Decode's tensor-parallel ranks whose seals a sealed offer needs (0: not sealed)."""
    return wire.KVParams(params).tp_size if params.get(wire.SEALED) else 0


def client_request_id(raw: str | None) -> str:
    """The client's ``X-Request-Id`` to echo and log, or one of ours; RequestError (400) when it is not
    printable ASCII of at most 128 characters (a header we could not echo back)."""
    if not raw:
        return new_leg_id()
    if len(raw) > 128 or not raw.isascii() or not raw.isprintable():
        raise guard.RequestError("'X-Request-Id' must be printable ASCII of at most 128 characters")
    return raw


def tenant_tag(secret: bytes, tenant: str) -> str:
    """The tenant's tag on the wire (``turnkv.wire.TENANT``): stable across routers sharing the key secret, the
    same for a turn's retain request and its replays' clearances, and no API key name leaves the router."""
    return guard.keyed_digest(secret, b"turnkv-tenant-tag-v1", tenant)[:32]


class Flow:
    """Runs client requests through the legs: intake, the store, retries, the reply and its metrics."""

    def __init__(self, config: RouterConfig, pool: EnginePool, store: ConversationStore, metrics: Metrics,
                 session: aiohttp.ClientSession, *, forward_auth: bool = True,
                 emf: telemetry.EmfWriter | None = None, responses: stored.ResponseLog | None = None,
                 legs_client: upstream.LegClient | None = None) -> None:
        self.config = config
        self.responses = responses  # kept /v1/responses answers (previous_response_id)
        self.pool = pool
        self.store = store
        self.metrics = metrics
        self.session = session  # probes, leases, the evictions feed; the legs have their own pooled connections
        self.legs_client = legs_client or upstream.LegClient()
        self.prefill_rate = telemetry.PrefillRate()
        self.savings = savings.Ledger()  # turns and dollars saved per tenant, since start (per 1,000 turns)
        metrics.prefill_price.set(float(config.prefill_price_per_hour))
        self.legs = Legs(config, pool, metrics, self.legs_client, self.prefill_rate, forward_auth=forward_auth)
        self.relay = Relay(config, metrics, dispatch=self._dispatch, store_reply=self._store_reply,
                           first_token=self._first_token)
        self.fanin = fanout.FanIn(config, metrics, self._first_token)  # a list of prompts' streams, merged
        self.emf = emf or telemetry.EmfWriter()
        # Prometheus children resolved once (labels() takes a lock and a dict lookup per call)
        self._ttft = {o: metrics.ttft.labels(o) for o in telemetry.OUTCOMES}
        self._reuse = {o: metrics.reuse.labels(o) for o in telemetry.OUTCOMES}
        self._store_seconds = {op: metrics.store_seconds.labels(op) for op in ("take", "put")}
        self.retention = limits.TenantRetentionLedger()
        self.media = media.MediaChecker()  # media hosts resolved and checked (tests swap in a fake resolver)
        self.lease_rate = limits.TokenBucket()
        # the prefill pool's fair queue (prefill_fair_tokens)
        self.engine_gate = EngineGate(self._gate_capacity(), on_wait=metrics.fair_queue_waits.inc)
        metrics.fair_queue_waiting.set_function(lambda: self.engine_gate.queue.waiting)
        # the decode pool's fair queue (decode_fair_sequences): a request holds one unit per sequence it asks for (n x
        # prompts, router.choices) until its answer ends. A tenant alone is held to it too: decode runs no more
        # sequences at once, so what waits here instead of in decode's first-come queue costs it nothing, and the next
        # tenant to come is not behind it there.
        self.decode_gate = EngineGate(self._decode_capacity(), on_wait=metrics.decode_queue_waits.inc,
                                      alone_exempt=False)
        metrics.decode_queue_waiting.set_function(lambda: self.decode_gate.queue.waiting)
        self.hint_sources = hints.parse_sources(config.session_hints)
        self._hint_counts = {s: metrics.session_hints.labels(s.label) for s in self.hint_sources}
        self._several = {s: metrics.several_sequences.labels(s) for s in Serving if s != Serving.PD}

    # -- request intake -------------------------------------------------------------------------

    def prepare(self, kind: RequestKind, path: str, request: web.Request, body: Any, tenant: str = "",
                size: int = 0, api: apis.Translation | None = None, nesting: int | None = None) -> Dispatch:
        """The request's dispatch, or RequestError / LimitError; ``nesting``: a bound of the body's depth (its braces
        and brackets, ``router.body``; None: unknown)."""
        if not isinstance(body, dict):
            raise guard.RequestError("the request body must be a JSON object")
        body.pop("kv_transfer_params", None)  # engine metadata is never accepted from clients
        try:
            hint = hints.find(self.hint_sources, request.headers, body)
        except ValueError as exc:
            raise guard.RequestError(str(exc)) from None
        for own in hints.OWN_BODY_FIELDS:
            body.pop(own, None)
        intake.check_messages(body, int(self.config.max_messages))
        intake.check_types(body)
        plan = choices.plan(kind, body)
        intake.check_choices(plan, int(self.config.max_choices))
        media_names = intake.check_media_urls(body, self.config.media_domains)
        intake.isolate(body, self.config.ensure_secret(), tenant)
        # The depth check (400 past it), before anything is hashed: the legs' shared bytes of a body large enough to
        # splice, or of one that may nest too deep (a translation may nest deeper than the client's body)
        shared = None
        if nesting is None or nesting > encoded.MAX_DEPTH or size >= encoded.SHARE_MIN or api is not None:
            shared = encoded.base(body)
        # a request of several sequences is no conversation turn: one prefill request's KV cannot serve it
        turn = guard.parse_turn(kind, body) if plan.serving == Serving.PD else None
        request_id = client_request_id(request.headers.get(REQUEST_ID_HEADER))
        key = None
        storable = turn is not None
        if turn is not None and turn.kind == RequestKind.CHAT:
            if turn.lookup is not None:
                key = guard.content_key(self.config.key_secret, tenant, turn.lookup)
        elif turn is not None:
            storable = hint is not None  # a raw prompt has no turn boundaries: only a session names its slot
            if hint is not None:
                key = guard.hint_key(self.config.key_secret, tenant, hint.value, turn)
        d = Dispatch(kind, path, body, request_id, turn, key, started=time.perf_counter(), tenant=tenant,
                     tokens=size // 4, stream=bool(body.get("stream")), leg_request_id=new_leg_id(), hint=hint,
                     storable=storable, media_names=media_names,
                     tenant_tag=tenant_tag(self.config.ensure_secret(), tenant), plan=plan, encoded=shared)
        d.migrate = (int(self.config.decode_migrations) > 0 and plan.serving == Serving.PD
                     and migrate.migratable(kind, body))
        if plan.serving != Serving.PD:
            self._several[plan.serving].inc()
        if api is not None:  # the engines speak chat; a continuation is translated like the rest of the stream
            d.api, d.route = api, api.route
        if hint is not None:
            self._hint_counts[hint.source].inc()
            d.affinity = hints.rendezvous(tenant, hint.value, [e.name for e in self.pool.decode])
        if request.headers.get(REUSE_HEADER, "").lower() in ("off", "0", "false", "no"):
            d.outcome, d.storable = ReuseOutcome.DISABLED, False
        elif key is None:
            d.outcome = ReuseOutcome.NONE
        return d

    def _bounded(self, op: Awaitable[T]) -> Awaitable[T]:
        """A store operation, bounded by ``store_timeout_ms`` when it waits on the network. An in-process store's
        is awaited as it is: ``wait_for`` would wrap it in a task, which costs two turns of the event loop
        before the request goes on (each a wait behind every stream being relayed)."""
        if getattr(self.store, "does_io", True):
            return asyncio.wait_for(op, self.config.store_timeout_ms / 1000)
        return op

    async def _take(self, d: Dispatch) -> dict[str, Any] | None:
        """The stored params to replay for this request, or None (and why, in d.outcome)."""
        if d.key is None or d.outcome == ReuseOutcome.DISABLED:
            return None
        t0 = time.perf_counter()
        try:
            entry = await self._bounded(self._take_entry(d))
        except Exception as exc:  # the store is an optimisation: never fail a request because of it
            log.warning("conversation store unavailable (%s); continuing without reuse",
                        exc or type(exc).__name__)
            self.metrics.store_errors.labels("take").inc()
            d.outcome = ReuseOutcome.STORE_ERROR
            return None
        finally:
            self._store_seconds["take"].observe(time.perf_counter() - t0)
        assert d.turn is not None
        self.release_retention(d.key)  # single use: the taken turn no longer counts against the tenant
        if entry is None:
            d.outcome = ReuseOutcome.MISS
            return None
        d.outcome = guard.reuse_outcome(entry.params, entry.history, entry.expires_at, d.turn, time.time(),
                                        self.pool.known_hosts())
        if d.outcome == ReuseOutcome.HIT and entry.decode_engine and not self.pool.holds_blocks_since(
                entry.decode_engine, entry.stored_at):
            d.outcome = ReuseOutcome.REFUSED
            log.warning("decode engine %s was ejected or is unknown since this turn was stored: not replayed",
                        entry.decode_engine)
        elif d.outcome == ReuseOutcome.HIT and (why := await self._evicted(entry)):
            d.outcome = ReuseOutcome.REFUSED
            log.info("decode engine %s: stored turn not replayed (%s)", entry.decode_engine, why)
        elif d.outcome == ReuseOutcome.REFUSED:
            log.warning("stored params name %r, which is no engine of this router: not replayed",
                        wire.KVParams(entry.params).host)
        if entry.decode_engine:
            d.affinity = entry.decode_engine
        if d.outcome != ReuseOutcome.HIT:
            return None
        if d.fork:
            self.metrics.fork_reads.inc()
        # Prefill starts reading within replay_window of now or not at all (router.engines.evictions).
        # Cleared with the offer secret: prefill reads only offers a router cleared (turnkv.wire); each replay of a
        # fork-readable offer names its reader (prefill reads each clearance once).
        reader = secrets.token_hex(8) if wire.fork_window(entry.params) > 0 else None
        read_by = time.time() + float(self.config.replay_window)
        if entry.fork_until:  # decode frees a read turn FORK_READ_SLACK after its window (plus the clocks' margin)
            read_by = min(read_by, entry.fork_until + wire.FORK_READ_SLACK)
        # The clearance names the tenant the replay is for: prefill reads an offer retained for a tenant only under a
        # clearance for that tenant (wire.CLEARED_TENANT); the prefill engine, chosen later, is named by the leg that
        # sends it there (router.legs.bind_clearance).
        return wire.clear_offer(self.config.offer_secret, self._with_seals(entry), read_by, reader,
                                tenant=d.tenant_tag or None)

    async def _take_entry(self, d: Dispatch) -> Entry | None:
        """The stored turn for ``d.key``. Single use (taken) unless decode's offer is fork-readable: then the first
        reader marks it readable by forks of the same history until ``fork_window`` from now (decode keeps the
        blocks at least that long after the first read completes, which is later), and later readers within that
        window read it too (``d.fork``); past it, it is dropped."""
        assert d.key is not None
        entry = await self.store.get(d.key)
        window = 0.0 if entry is None else wire.fork_window(entry.params)
        if entry is None or window <= 0:
            return None if entry is None else await self.store.take(d.key)
        now = time.time()
        if not entry.fork_until:
            marked = dataclasses.replace(entry, fork_until=now + window)
            if await self.store.swap(d.key, entry, marked):
                return marked
            entry = await self.store.get(d.key)  # a concurrent fork read it first
            if entry is None or not entry.fork_until:
                return None
        if now >= entry.fork_until:
            await self.store.swap(d.key, entry, None)
            return None
        d.fork = True
        return entry

    async def _evicted(self, entry: Entry) -> str | None:
        """Why decode may have evicted (or be about to free) the entry's blocks, from its evictions feed. A
        host-tier offer whose copy, or a sealed one whose seal, the last read did not list yet gets up to
        ``PENDING_REREADS`` fresh reads of the feed now (decode does both at the step after the turn ended; a fast
        next turn should not wait for the next interval)."""
        engine = self.pool.find(entry.decode_engine) if entry.decode_engine else None
        if engine is None:
            return None
        request_id = wire.KVParams(entry.params).request_id
        host = entry.params.get(wire.HOST_TIER) is not None
        sealed = _sealed_ranks(entry.params)
        interval = float(self.config.evictions_interval)
        why = engine.feed.refuses(request_id, time.time(), interval, host_tier=host, sealed_ranks=sealed)
        for pause in evictions.PENDING_REREADS:
            if why not in (evictions.HOST_COPY_PENDING, evictions.SEAL_PENDING):
                break
            await asyncio.sleep(pause)
            await evictions.read_feed(self.session, engine.url, engine.feed, 1.0, time.time, fresh=True)
            why = engine.feed.refuses(request_id, time.time(), interval, host_tier=host, sealed_ranks=sealed)
        return why

    def _with_seals(self, entry: Entry) -> Mapping[str, Any]:
        """The stored offer with decode's seals of its KV bytes attached (``turnkv.wire.SEALS``), when it is sealed:
        prefill checks every block its READ brings against them."""
        ranks = _sealed_ranks(entry.params)
        engine = self.pool.find(entry.decode_engine) if ranks and entry.decode_engine else None
        seals = engine.feed.seals_of(wire.KVParams(entry.params).request_id, ranks) if engine is not None else None
        return {**entry.params, wire.SEALS: seals} if seals is not None else entry.params

    async def _remember(self, d: Dispatch, decode: Engine, params: Any, reply: Mapping[str, Any] | str) -> None:
        replay = guard.replayable(params)
        if not d.retain or d.turn is None or replay is None:
            return
        now = time.time()
        expires = guard.entry_expiry(now, self.config.entry_lifetime(), replay, float(self.config.expiry_margin))
        if expires <= now:
            return
        history = d.turn.extended_by(reply)
        key = guard.content_key(self.config.key_secret, d.tenant, history) if d.kind == RequestKind.CHAT else d.key
        if key is None:
            return
        entry = Entry(replay, history, expires, decode.name, now)
        t0 = time.perf_counter()
        try:
            await self._bounded(self.store.put(key, entry))
            self.hold_retention(d.tenant, key, entry, expires)
        except Exception as exc:
            self.metrics.store_errors.labels("put").inc()
            log.warning("could not store conversation state (%s)", exc or type(exc).__name__)
        finally:
            self._store_seconds["put"].observe(time.perf_counter() - t0)

    async def _keep_response(self, d: Dispatch, reply: Mapping[str, Any] | str) -> None:
        """Keep an answer another API can continue by id (``/v1/responses``' previous_response_id)."""
        if d.api is None or self.responses is None:
            return
        kept = d.api.kept(reply)
        if kept is not None:
            await self.responses.save(d.tenant, *kept)

    async def _store_reply(self, d: Dispatch, decode: Engine, params: Any, reply: Mapping[str, Any] | str) -> None:
        """A streamed reply, complete: kept for the next turn and for its API (the relay's ``store_reply``)."""
        await self._remember(d, decode, params, reply)
        await self._keep_response(d, reply)

    # -- retention limits (per tenant, this process) -----------------------------------------------

    def hold_retention(self, tenant: str, key: str, entry: Entry, expires: float) -> None:
        self.retention.hold(tenant, key, wire.KVParams(entry.params).num_tokens, expires)

    def release_retention(self, key: str) -> None:
        self.retention.release(key)

    def _may_retain(self, d: Dispatch) -> bool:
        if not d.storable:
            return False
        budget = d.tokens + int(d.body.get("max_tokens") or d.body.get("max_completion_tokens") or 0)
        config = self.config
        if self.retention.allows(d.tenant, budget, int(config.tenant_max_conversations),
                                 int(config.tenant_max_retained_tokens), int(config.max_conversations),
                                 int(config.max_retained_tokens)):
            return True
        self.metrics.retention_refused.inc()
        return False

    def log_engine_error(self, leg: str, engine: Engine, exc: BaseException) -> None:
        self.metrics.engine_errors.labels(leg, type(exc).__name__).inc()
        log.warning("%s engine %s failed: %s", leg, engine.name, str(exc) or type(exc).__name__)

    # -- the retry loop ---------------------------------------------------------------------------

    async def _dispatch(self, d: Dispatch, request: web.Request) -> Opened:
        """Both legs, with the retry budgets; returns the opened decode leg or raises UpstreamError."""
        if d.decode_slot is None:  # a migration's continuation (a prompt of a list) runs on the slot of its request
            d.decode_slot = await self.decode_gate.enter(d.tenant, d.plan.choices, self._decode_capacity())
        if d.plan.serving == Serving.DECODE_ALONE:  # no prefill leg: nothing of the prefill pool held
            return await self._attempts(d, request, None)
        params = await self._take(d)
        d.retain = self._may_retain(d)
        # Until decode's first token the request holds its share of the prefill pool (router.fairqueue): the tokens
        # prefill will compute, its estimate less what the replayed offer pulls.
        offered = wire.KVParams(params).num_tokens if params else 0
        ticket = await self.engine_gate.enter(d.tenant, d.tokens - offered, self._gate_capacity())
        d.prefill_share_done = functools.partial(self.engine_gate.leave, ticket)
        try:
            return await self._attempts(d, request, params)
        finally:
            self.engine_gate.leave(ticket)  # once per ticket: a second leave does nothing

    def _gate_capacity(self) -> float:
        return float(self.config.prefill_fair_tokens) * max(1, len(self.pool.prefill))

    def _decode_capacity(self) -> float:
        return float(self.config.decode_fair_sequences) * max(1, len(self.pool.decode))

    async def _attempts(self, d: Dispatch, request: web.Request, params: dict[str, Any] | None) -> Opened:
        tried: dict[str, list[Engine]] = {"prefill": [], "decode": list(d.avoid_decode)}
        budget = {"prefill": int(self.config.prefill_retries), "decode": int(self.config.decode_retries)}
        attempt = (self.legs.alone if d.plan.serving == Serving.DECODE_ALONE else
                   self.legs.push if self.config.mode == "push" else self.legs.pull)
        while True:
            try:
                opened = await attempt(d, request, params, tried)
                if d.outcome == ReuseOutcome.HIT and not d.reused_tokens:
                    # replayed, but prefill pulled nothing (failed or below threshold)
                    d.outcome = ReuseOutcome.RECOMPUTE
                return opened
            except UpstreamError as exc:
                failure = retry.Failure(exc.leg, exc.retryable, exc.connect, exc.engine is not None)
                decision = retry.decide(failure, budget[exc.leg], replaying=params is not None)
                if not decision.retry:
                    raise
                budget[exc.leg] -= 1
                tried[exc.leg].append(exc.engine)  # type: ignore[arg-type]  # engine_known
                d.retries += 1
                d.leg_request_id = new_leg_id()
                self.metrics.retries.labels(exc.leg, exc.reason).inc()
                if decision.drop_reuse:
                    params = None
                    d.outcome, d.reused_tokens = ReuseOutcome.RECOMPUTE, 0
                log.warning("%s; retrying (%s retries left for %s)", exc, budget[exc.leg], exc.leg)

    # -- responses ------------------------------------------------------------------------------

    def _reply_headers(self, d: Dispatch) -> dict[str, str]:
        return {REQUEST_ID_HEADER: d.request_id, REUSED_TOKENS_HEADER: str(d.reused_tokens),
                PREFILL_CACHED_HEADER: str(d.prefill_cached_tokens), REUSE_OUTCOME_HEADER: d.outcome}

    def _upstream_error(self, d: Dispatch, exc: UpstreamError) -> web.Response:
        log.warning("%s", exc)
        d.error = str(exc)
        kind = "invalid_request_error" if 400 <= exc.status < 500 else "upstream_error"
        headers = self._reply_headers(d)
        if exc.status == 503:  # the router's own shortage (router.upstream.RouterResourceError)
            kind, headers = "service_unavailable", {**headers, "Retry-After": "1"}
        return error_response(exc.status, public_message(exc), kind, headers=headers)

    async def run(self, d: Dispatch, request: web.Request) -> web.StreamResponse:
        await self.media.check(d.media_names)  # RequestError (400) before any engine or the store is touched
        token = telemetry.request_id.set(d.request_id)
        try:
            response = await (self._run_stream(d, request) if d.stream else self._run_unary(d, request))
            d.status = d.status or response.status
            return response
        except asyncio.CancelledError:
            self.metrics.client_disconnects.inc()
            d.status, d.error = 499, "client disconnected"
            log.info("client disconnected: both legs aborted")
            raise
        finally:
            if d.decode_slot is not None:
                self.decode_gate.leave(d.decode_slot)
            self._finish(d)
            telemetry.request_id.reset(token)

    def _finish(self, d: Dispatch) -> None:
        self._reuse[d.outcome].inc()
        if d.reused_tokens:
            self.metrics.reused_tokens.inc(d.reused_tokens)
        if d.prefill_cached_tokens:
            self.metrics.prefill_cached_tokens.inc(d.prefill_cached_tokens)
        saving = self._count_saving(d)
        if not self.config.emf:
            return
        self.emf.emit(telemetry.emf_record(
            namespace=telemetry.NAMESPACE, deployment=self.config.deployment, outcome=d.outcome,
            prompt_tokens=d.prompt_tokens, ttft_ms=None if d.ttft is None else d.ttft * 1000,
            error=d.status >= 500 or d.status == 0, reused_tokens=d.reused_tokens, prefill_ms=d.prefill_ms,
            saved_ms=None if saving is None else saving.seconds * 1000, tenant=d.tenant,
            saved_dollars=None if saving is None else saving.dollars, fields={
                "request_id": d.request_id, "status": d.status, "route": d.route or d.path, "stream": d.stream,
                "tenant": d.tenant, "prefill_engine": d.prefill_engine, "decode_engine": d.decode_engine,
                "prompt_tokens": d.prompt_tokens, "retries": d.retries, "mode": self.config.mode,
                "latency_ms": round((time.perf_counter() - d.started) * 1000, 3),
                **({"session": d.hint.value, "session_source": d.hint.source.label} if d.hint else {}),
                **({"error": d.error} if d.error else {})}))

    def _count_saving(self, d: Dispatch) -> savings.Saved | None:
        """The prefill time (and dollars) this turn's reuse saved, on /metrics per tenant (router.savings)."""
        rate = self.prefill_rate.ms_per_token / 1000
        price = float(self.config.prefill_price_per_hour)
        saving = savings.saved(d.reused_tokens, rate, price)
        tenant = savings.tenant_label(d.tenant)
        self.savings.add(d.tenant, saving)
        m = self.metrics
        m.turns.labels(tenant).inc()
        m.prefill_seconds_per_token.set(rate)
        if saving is not None:
            m.prefill_seconds_saved.labels(tenant).inc(saving.seconds)
            if saving.dollars is not None:
                m.prefill_dollars_saved.labels(tenant).inc(saving.dollars)
        if price > 0:
            m.dollars_per_1k_turns.set(self.savings.per_1k_turns())
            m.tenant_dollars_per_1k_turns.labels(tenant).set(self.savings.per_1k_turns(d.tenant))
        return saving

    def _first_token(self, d: Dispatch) -> None:
        d.ttft = time.perf_counter() - d.started
        self._ttft[d.outcome].observe(d.ttft)

    async def _open(self, d: Dispatch, request: web.Request) -> Opened | fanout.Fanned:
        """The request's decode legs, opened: one, or one per prompt of a list (``router.fanout``), which then holds
        the decode-pool units of all its prompts at once."""
        if d.plan.serving != Serving.PER_PROMPT:
            return await self._dispatch(d, request)
        d.decode_slot = await self.decode_gate.enter(d.tenant, d.plan.choices, self._decode_capacity())
        subs = fanout.parts(d)
        try:
            return await fanout.open_all(subs, request, self._dispatch)
        finally:
            fanout.tally(d, subs)

    async def _run_unary(self, d: Dispatch, request: web.Request) -> web.StreamResponse:
        try:
            opened = await self._open(d, request)
        except UpstreamError as exc:
            return self._upstream_error(d, exc)
        except NoEngineError as exc:
            d.error = str(exc)
            return error_response(503, str(exc), "service_unavailable", headers=self._reply_headers(d))
        if isinstance(opened, fanout.Fanned):
            answers = [orjson.loads(o.raw) for o in opened.opened]
            for answer in answers:
                answer.pop("kv_transfer_params", None)
            self._first_token(d)
            return web.Response(body=orjson.dumps(merge.unary(answers)), content_type="application/json",
                                headers=self._reply_headers(d))
        result = orjson.loads(opened.raw)
        kv = result.pop("kv_transfer_params", None)
        if isinstance(result.get("usage"), Mapping):
            result["usage"] = usage.with_reuse(result["usage"], d)
        self._first_token(d)
        choices = result.get("choices") or [{}]
        reply = guard.reply_message(choices[0]) if d.kind == RequestKind.CHAT else str(choices[0].get("text") or "")
        await self._remember(d, opened.engine, kv, reply)
        if d.api is not None:
            result = d.api.unary(result)
            await self._keep_response(d, reply)
        return web.Response(body=orjson.dumps(result), content_type="application/json",
                            headers=self._reply_headers(d))

    async def _run_stream(self, d: Dispatch, request: web.Request) -> web.StreamResponse:
        # Before the first token: SSE comments keep idle-timeout proxies (ALB) from closing (router.keepalive).
        keepalive = Keepalive(request, {REQUEST_ID_HEADER: d.request_id, "Content-Type": "text/event-stream",
                                        "Cache-Control": "no-cache"}, float(self.config.sse_keepalive),
                              float(self.config.write_timeout))
        opened: Opened | fanout.Fanned | None = None
        try:
            try:
                opened = await self._open(d, request)
            except (UpstreamError, NoEngineError) as exc:
                response = await keepalive.stop()
                if response is None:
                    if isinstance(exc, NoEngineError):
                        d.error = str(exc)
                        return error_response(503, str(exc), "service_unavailable", headers=self._reply_headers(d))
                    return self._upstream_error(d, exc)
                d.error = str(exc)
                status = exc.status if isinstance(exc, UpstreamError) else 503
                await error_event(d, response, public_message(exc) if isinstance(exc, UpstreamError)
                                  else str(exc), status)
                return response
            response = await keepalive.stop()
            early = response is not None
            if response is None:
                response = SseResponse(headers={**self._reply_headers(d), "Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
                await response.prepare(request)
            if isinstance(opened, fanout.Fanned):
                return await self.fanin.stream(d, response, opened, early, request)
            return await self.relay.stream(d, response, opened, early, request)
        finally:
            await keepalive.stop()
            if opened is not None:
                opened.close()
