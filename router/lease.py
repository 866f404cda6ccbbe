"""``POST /v1/conversations/lease``: keep a conversation's retained KV alive past the engine TTL.

An agent that will think or run tools for longer than ``decoder_kv_blocks_ttl`` sends the request
settings it will use next turn (``model``, ``tools``, ..., without ``messages``) with its
``conversation_id`` and an optional ``ttl``. The router asks the decode engine that holds the
conversation's blocks to extend their lease (``/turnkv/v1/leases``, turnkv's connector) and moves
its own entry's expiry accordingly, so the expiry it acts on stays truthful.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from router import guard
from router.flow import CONVERSATION_HEADER, Flow, error_response

ENGINE_ROUTE = "/turnkv/v1/leases"


async def renew(flow: Flow, request: web.Request, body: Any, tenant: str = "") -> web.Response:
    if not isinstance(body, dict):
        raise guard.RequestError("the request body must be a JSON object")
    conversation_id = body.get("conversation_id") or request.headers.get(CONVERSATION_HEADER)
    if not isinstance(conversation_id, str) or not conversation_id:
        raise guard.RequestError("'conversation_id' (or the X-Conversation-Id header) is required")
    engine_ttl = float(flow.config.decoder_kv_blocks_ttl)
    ttl = body.get("ttl", engine_ttl)
    if not isinstance(ttl, (int, float)) or not 0 < ttl <= 3600:
        raise guard.RequestError("'ttl' must be a number of seconds in (0, 3600]")
    kind = "completion" if body.get("kind") == "completion" else "chat"
    key = guard.conversation_key(flow.config.key_secret, tenant, conversation_id, guard.render_only(kind, body))
    entry = await flow.store.take(key)
    if entry is None:
        return error_response(404, "no live KV for this conversation (expired, consumed, or different settings)",
                              "not_found")
    engine = next((e for e in flow.pool.decode if e.name == entry.decode_engine), None)
    request_id = entry.params.get("remote_request_id")
    if engine is None or not request_id:
        return error_response(410, "the decode engine holding this conversation is gone", "gone")
    try:
        async with flow.session.post(engine.url + ENGINE_ROUTE, data=orjson.dumps({"request_ids": [request_id],
                                                                                   "ttl": ttl}),
                                     headers={"Content-Type": "application/json"},
                                     timeout=aiohttp.ClientTimeout(total=10)) as resp:
            answer = await resp.json() if resp.status == 200 else {}
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        await flow.store.put(key, entry)  # unchanged: the old lease still stands
        return error_response(502, f"decode engine {engine.name} did not renew: {exc!r}", "upstream_error")
    left = (answer.get("renewed") or {}).get(request_id)
    if left is None:
        return error_response(410, "the decode engine no longer holds this conversation's KV", "gone")
    lifetime = left - float(flow.config.expiry_margin)
    params = dict(entry.params)
    expiry = (answer.get("remote_blocks_expiry_time") or {}).get(request_id)
    if expiry is not None:
        # Prefill declines a read past this instant (decode's clock): it must move with the lease.
        params["remote_blocks_expiry_time"] = expiry
    renewed = dataclasses.replace(entry, params=params, expires_at=time.time() + lifetime)
    await flow.store.put(key, renewed)
    return web.json_response({"conversation_id": conversation_id, "expires_in": round(lifetime, 1)})
