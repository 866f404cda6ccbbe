"""The client's request serialised once, as the engine legs send it (pure, no I/O).

Every leg sends the client's body with a few fields of its own (prefill: one token, no stream; both: the
``kv_transfer_params``). The body less those fields is serialised once, at intake, and each leg's body is those bytes
with its fields spliced in: the prompt, the bulk of a body, is not serialised again per leg.

That one serialisation is also the intake's depth check. orjson parses JSON nested up to 1,024 levels but serialises
at most ``MAX_DEPTH`` (a ``TypeError`` past it), so a body between the two would otherwise fail later, as a 500 from a
leg or a digest: it is refused here with a 400 naming the limit, before anything is hashed, stored or sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from router.guard import RequestError

#: Objects and arrays within one another (the body itself is level 1) that orjson serialises.
MAX_DEPTH = 254
#: Fields a leg sets itself (``router.legs``): left out of the shared bytes, spliced in per leg. The intake checks
#: their types (``router.intake``), so they nest no deeper than an object of flags.
LEG_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens", "stream", "stream_options", "return_token_ids")
_LEFT_OUT = frozenset({*LEG_FIELDS, "kv_transfer_params"})


def too_deep() -> RequestError:
    return RequestError(f"the request nests objects and arrays more than {MAX_DEPTH} levels deep; the router passes "
                        f"on at most {MAX_DEPTH} (the body itself is level 1)")


def dumps(value: Any) -> bytes:
    """``value`` serialised; RequestError (400) naming the limit when it nests deeper than ``MAX_DEPTH``."""
    try:
        return orjson.dumps(value)
    except TypeError:  # parsed JSON holds only JSON types: orjson's only refusal is its recursion limit
        raise too_deep() from None


def base(body: Mapping[str, Any]) -> bytes:
    """The body without the legs' own fields, serialised (what every leg's body starts from)."""
    return dumps({k: v for k, v in body.items() if k not in _LEFT_OUT})


def splice(shared: bytes, fields: Mapping[str, Any]) -> bytes:
    """A leg's body: the shared bytes of an object with ``fields`` added (none of them is in it)."""
    if not fields:
        return shared
    tail = orjson.dumps(fields)
    if len(shared) <= 2:  # b"{}"
        return tail
    return b"".join((memoryview(shared)[:-1], b",", memoryview(tail)[1:]))
