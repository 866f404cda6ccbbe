"""Reading a request body within the router's budgets: its size, its buffered bytes (per tenant and globally) and
its arrival deadline.

A body is reserved before it is read (its Content-Length, or chunk by chunk when it has none), so a tenant
holding many slow or parked bodies runs out of its own budget (429) long before the router runs out of memory,
and a body that does not arrive within ``body_read_timeout`` is answered 408 and its connection closed.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import orjson
from aiohttp import web

from router.guard import RequestError
from router.intake import LimitError
from router.limits import ByteBudget, FairRate, TokenBucket
from turnkv import params

#: A refused request's body is read and dropped (so a client that sends its whole body before reading gets its
#: answer, not a reset connection) only while at most this much of it is left unread (about 0.35 ms of the loop);
#: beyond, the connection is closed once the answer is written. Most chat bodies are smaller.
LINGER_BYTES = 1024 * 1024


async def read_json(request: web.Request, tenant: str, budget: ByteBudget, tunables: Any,
                    byte_rate: FairRate | None = None) -> tuple[Any, int, int]:
    """The parsed JSON body, its size, and a bound of its nesting depth (its ``{`` and ``[`` bytes, counted as it
    arrives: a body with no more of them nests no deeper, ``router.encoded``); LimitError (413, 429, 408) naming the
    limit it would break."""
    max_body = int(tunables.max_body_bytes)
    length = request.content_length
    if length is not None and length > max_body:
        raise LimitError(413, "max_body_bytes", f"the request body is larger than max_body_bytes ({max_body} bytes)")
    if byte_rate is not None:
        capacity = float(tunables.router_body_rate)
        cap = float(tunables.tenant_body_rate)
        cap = math.inf if cap >= params.get("tenant_body_rate").maximum else cap
        cost = length if length is not None else max_body  # a body of unknown length is charged as the largest
        if not byte_rate.allow(tenant, capacity, cap, cost, min_burst=float(max_body)):
            rate = byte_rate.rate(tenant, capacity, cap)
            why = (f"tenant_body_rate {cap:g} bytes/s" if rate >= cap else
                   f"its fair share now, {rate:.4g} bytes/s of router_body_rate {capacity:g} among the keys sending")
            raise LimitError(429, "tenant_body_rate", f"too many request body bytes per second for this API key "
                                                      f"({why}); slow down",
                             retry_after=max(1, int(cost / rate + 0.999)))
    max_total, max_tenant = int(tunables.max_body_buffer_bytes), int(tunables.tenant_max_body_buffer_bytes)
    reserved = 0

    def reserve(size: int) -> None:
        nonlocal reserved
        refused = budget.try_take(tenant, size, max_total, max_tenant)
        if refused is not None:
            who = "this API key" if refused.startswith("tenant") else "this router"
            raise LimitError(429, refused, f"too many request body bytes in flight for {who} ({refused}); retry "
                                           "shortly", retry_after=1)
        reserved += size

    try:
        if length is not None:
            reserve(length)
        parts: list[bytes] = []
        size = objects = arrays = 0
        most = 16 * int(tunables.max_messages)
        try:
            async with asyncio.timeout(float(tunables.body_read_timeout)):
                while chunk := await request.content.readany():
                    size += len(chunk)
                    if size > max_body:
                        raise LimitError(413, "max_body_bytes",
                                         f"the request body is larger than max_body_bytes ({max_body} bytes)")
                    if size > reserved:
                        reserve(size - reserved)
                    # an upper bound of the objects, counted at C speed as the body arrives: a flood is refused
                    # at its 16 x max_messages-th object, never parsed, and the rest of it never read
                    objects += chunk.count(b"{")
                    arrays += chunk.count(b"[")
                    if objects > most:
                        raise LimitError(413, "max_messages", f"the request body holds more than {most} JSON "
                                                              f"objects; at most {most} (16 x max_messages) are parsed")
                    parts.append(chunk)
        except TimeoutError:
            raise LimitError(408, "body_read_timeout", "the request body did not arrive within body_read_timeout "
                                                       f"({float(tunables.body_read_timeout):g} s)") from None
        raw = b"".join(parts)
        del parts
        if not raw:
            raise RequestError("the request body is empty; send a JSON object")
        try:
            return orjson.loads(raw), len(raw), objects + arrays
        except orjson.JSONDecodeError as exc:
            raise RequestError(f"the request body is not valid JSON: {exc}") from None
    finally:
        if reserved:
            budget.give(tenant, reserved)


def limit_response(exc: LimitError) -> web.Response:
    """A refusal that names its limit. The connection closes after a 408 (a body still arriving); after the others it
    is kept when the body left is small (read and dropped), and closed by ``close_unread`` when it is not: a client
    refused for its rate need not connect again (a new connection costs the router more than the refusal)."""
    from router.flow import error_response

    kind = "rate_limit_exceeded" if exc.status == 429 else "invalid_request_error"
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
    response = error_response(exc.status, str(exc), kind, headers=headers, limit=exc.limit)
    if exc.status == 408:
        response.force_close()
    return response


async def close_unread(request: web.BaseRequest, response: web.StreamResponse) -> web.StreamResponse:
    """Send a refusal and close the connection at once when more than LINGER_BYTES of the request's body are left
    unread. aiohttp would otherwise read and drop up to 10 s of them (its lingering close) on the event loop: about
    3 ms of it for each refused 8 MiB body, which made a refused flood cost the router more than a served turn."""
    content = request.content
    if response.status < 400 or response.prepared or content.is_eof():
        return response
    length = request.content_length
    if length is not None and length - content.total_bytes <= LINGER_BYTES:
        return response
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    request.protocol.force_close()  # the answer is written (flushed before the close); the unread body never read
    return response


def charge_messages(body: Any, tenant: str, bucket: TokenBucket, tunables: Any) -> None:
    """Charge the request's messages to the tenant's ``tenant_message_rate`` (the hashing they will cost);
    LimitError 429 when over it."""
    if not isinstance(body, dict):
        return
    items = body.get("messages") if isinstance(body.get("messages"), list) else body.get("input")
    count = len(items) if isinstance(items, list) else 1
    rate = float(tunables.tenant_message_rate)
    if not bucket.allow(tenant, rate, max(2 * rate, 2.0 * int(tunables.max_messages)), count):
        raise LimitError(429, "tenant_message_rate", f"too many messages per second for this API key "
                                                     f"(tenant_message_rate {rate:g}/s); slow down",
                         retry_after=max(1, int(count / rate + 0.999)))
