"""``POST /v1/conversations/lease``: keep a conversation's retained KV alive past the engine TTL.

An agent that will think or run tools for longer than ``decoder_kv_blocks_ttl`` sends the request
it has so far: the settings it will use next turn (``model``, ``tools``, ...) and its ``messages`` up
to and including the last assistant reply (turns are found by their content, as in ``router.guard``),
plus an optional ``ttl``. Raw-prompt completions (``"kind": "completion"``) name their session with a
hint instead (``conversation_id`` or one of ``session_hints``). The router sends the turn's signed offer
to the decode engine that holds its blocks (``turnkv.wire.LEASE_ROUTE``: the offer is the credential),
and stores the offer decode re-signed with its new expiry, so the expiry it acts on stays decode's.

Limits: ``lease_max_ttl`` per call, ``tenant_lease_rate`` renewals per second per tenant.
The entry stays in the store while decode renews (a turn arriving meanwhile takes it and reuses, as
without the lease); the renewed entry replaces it only if it is still the same (compare-and-set), so
a concurrent turn always wins. An engine that no longer holds the blocks (404/403, or renews nothing)
drops the entry (410); an engine that fails (5xx, unreachable) leaves it in place (502): the old lease
still stands.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

import aiohttp
import orjson
from aiohttp import web

from router import guard, hints, intake
from router.apis.stored import StoreUnavailable
from router.flow import Flow, error_response
from router.outcomes import RequestKind
from turnkv import lifetime, wire

log = logging.getLogger("turnkv.router")
T = TypeVar("T")

ENGINE_ROUTE = wire.LEASE_ROUTE


async def renew(flow: Flow, request: web.Request, body: Any, tenant: str = "") -> web.Response:
    if not isinstance(body, dict):
        raise guard.RequestError("the request body must be a JSON object")
    max_ttl = float(flow.config.lease_max_ttl)
    ttl = body.get("ttl", lifetime.default_lease_ttl(max_ttl, float(flow.config.decoder_kv_blocks_ttl)))
    if not lifetime.lease_ttl_ok(ttl, max_ttl):
        raise guard.RequestError(f"'ttl' must be a number of seconds in (0, {max_ttl:g}]")
    key = _key(flow, request, body, tenant)  # the rate limit (tenant_lease_rate) came first (router.app)
    entry = await _stored(flow.store.get(key))
    if entry is None:
        return error_response(404, "no live KV for this conversation (expired, consumed, or different settings)",
                              "not_found")
    engine = next((e for e in flow.pool.decode if e.name == entry.decode_engine), None)
    request_id = wire.KVParams(entry.params).request_id
    if engine is None or not request_id:
        return error_response(410, "the decode engine holding this conversation is gone", "gone")
    try:
        async with flow.session.post(engine.url + ENGINE_ROUTE,
                                     data=orjson.dumps({"offers": [entry.params], "ttl": ttl}),
                                     headers={"Content-Type": "application/json"},
                                     timeout=aiohttp.ClientTimeout(total=10)) as resp:
            status = resp.status
            answer = await resp.json(content_type=None) if status == 200 else {}
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        flow.log_engine_error("lease", engine, exc)
        return error_response(502, "the decode engine did not answer; the previous lease still stands",
                              "upstream_error")
    if status >= 500 or status in (408, 429):
        return error_response(502, f"the decode engine could not renew (HTTP {status}); the previous lease still "
                                   "stands", "upstream_error")
    renewed = (answer.get("renewed") or {}).get(request_id) if isinstance(answer, dict) else None
    params = guard.replayable(renewed) if isinstance(renewed, dict) else None
    if status != 200 or params is None:
        # The engine no longer holds the blocks (freed, read, restarted) or refuses the offer: the entry is dead.
        if await _stored(flow.store.swap(key, entry, None)):
            flow.release_retention(key)
        return error_response(410, "the decode engine no longer holds this conversation's KV", "gone")
    now = time.time()
    expires = guard.entry_expiry(now, float(ttl), params, float(flow.config.expiry_margin))
    if expires <= now:
        return error_response(410, "the renewed lease is too short to use", "gone")
    stored = await _stored(flow.store.swap(key, entry, dataclasses.replace(entry, params=params,
                                                                         expires_at=expires)))
    if not stored:  # a turn of this conversation took or replaced the entry meanwhile: it wins
        return error_response(409, "the conversation moved on while renewing; renew again", "conflict")
    flow.hold_retention(tenant, key, entry, expires)
    return web.json_response({"expires_in": round(expires - now, 1)})


async def _stored(op: Awaitable[T]) -> T:
    """A conversation-store call; its failure is StoreUnavailable (503, a fixed message): the detail names the store
    (a Valkey address, its error) and is logged, never sent to the client."""
    try:
        return await op
    except Exception as exc:
        log.warning("conversation store unavailable for a lease: %r", exc)
        raise StoreUnavailable("the conversation store is unavailable; retry shortly") from exc


def _key(flow: Flow, request: web.Request, body: dict[str, Any], tenant: str) -> str:
    secret = flow.config.key_secret
    intake.isolate(body, secret, tenant)  # the settings as the turn was stored (its cache_salt, per tenant)
    if body.get("kind") == RequestKind.COMPLETION:
        try:
            hint = hints.find(flow.hint_sources, request.headers, body)
        except ValueError as exc:
            raise guard.RequestError(str(exc)) from None
        if hint is None:
            raise guard.RequestError("a completion session is named by 'conversation_id' (or a session header)")
        return guard.hint_key(secret, tenant, hint.value, guard.render_only(RequestKind.COMPLETION, body))
    messages = body.get("messages")
    turn = guard.parse_turn(RequestKind.CHAT, body) if messages else None
    if turn is None or turn.lookup is None or turn.lookup.length != len(messages):
        raise guard.RequestError("'messages' is required: the conversation so far, ending with the assistant's "
                                 "last reply (the turn whose KV to keep)")
    return guard.content_key(secret, tenant, turn.lookup)
