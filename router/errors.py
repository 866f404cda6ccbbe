"""What a client is told when a leg fails: a status and a safe message (pure).

Engine error bodies can echo the request's ``kv_transfer_params`` (decode's block ids, hosts, ports, engine
ids); engine names are host:port. None of that reaches a client: the full error goes to the log only.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import orjson

if TYPE_CHECKING:
    from router.legs import UpstreamError

#: Engine error text that may name engine internals (params, addresses, block ids): never shown to clients.
_UNSAFE = re.compile(r"kv_transfer|remote_|turnkv_|block_ids|engine_id|https?://|\d{1,3}(?:\.\d{1,3}){3}|\[?[0-9a-f]*:[0-9a-f:]+\]?"
                     r"|localhost|side_channel|nixl", re.IGNORECASE)


def engine_message(body: bytes | None) -> str | None:
    """The engine's own error message when it is short and names nothing internal, else None."""
    if not body or len(body) > 65536:
        return None
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    error = data.get("error") if isinstance(data, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    if not isinstance(message, str) or not message or len(message) > 300 or _UNSAFE.search(message):
        return None
    return message


def public_message(exc: UpstreamError) -> str:
    """What a client is told about a failed leg: the status and a safe message, never an engine's body,
    name or address (those go to the log)."""
    if 400 <= exc.status < 500:
        said = engine_message(exc.body)
        return said or f"the model server refused the request (HTTP {exc.status}); check its parameters"
    if exc.status == 503:
        return "the router is short of connections right now; retry shortly"
    if exc.status == 504:
        return "the model server did not answer in time"
    return "the model server failed; try again"
