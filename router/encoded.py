"""The client's request serialised once, as the engine legs send it (pure, no I/O).

Every leg sends the client's body with a few fields of its own (prefill: one token, no stream; both: the
``kv_transfer_params``). A large body less those fields is serialised once, at intake, and its legs send those bytes
and their own fields' as parts the leg client joins into its one write (``router.upstream``): the prompt, the bulk of
a body, is neither serialised nor copied again per leg.

That serialisation is also the intake's depth check. orjson parses JSON nested up to 1,024 levels but serialises at
most ``MAX_DEPTH`` (a ``TypeError`` past it), so a body between the two would otherwise fail later, as a 500 from a leg
or a digest: it is refused with a 400 naming the limit, before anything is hashed, stored or sent. A body under
``SHARE_MIN`` with no more braces and brackets than the limit (counted as it arrives, ``router.body``) cannot nest past
it: it is not serialised at intake, and its legs serialise it whole, as they always did.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeAlias

import orjson

from router.guard import RequestError

#: Objects and arrays within one another (the body itself is level 1) that orjson serialises.
MAX_DEPTH = 254
#: Fields a leg sets itself (``router.legs``): left out of the shared bytes, spliced in per leg. The intake checks
#: their types (``router.intake``), so they nest no deeper than an object of flags.
LEG_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens", "stream", "stream_options", "return_token_ids")
_LEFT_OUT = frozenset({*LEG_FIELDS, "kv_transfer_params"})
#: A leg's body: bytes, or parts in order (``router.upstream`` joins them into the request it writes).
Parts: TypeAlias = bytes | tuple[bytes | memoryview, ...]
#: Bodies from this size on are serialised once at intake and spliced per leg, whatever their nesting: at 137 KB it
#: takes a third of the legs' CPU off (``bench.leg_bodies``); under about 32 KB it saves nothing.
SHARE_MIN = 32 * 1024
#: Shared bytes from which a leg's body is spliced (``router.legs``; the intake made them: large, or nested past a
#: bound); smaller ones are serialised whole per leg, which costs less than splicing under about 4 KB.
SPLICE_MIN = 4 * 1024


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
    trimmed = dict(body)
    for name in _LEFT_OUT:
        trimmed.pop(name, None)
    return dumps(trimmed)


def splice(shared: bytes, fields: Mapping[str, Any]) -> Parts:
    """A leg's body: the shared bytes of an object with ``fields`` added (none of them is in it), as parts."""
    if not fields:
        return shared
    tail = orjson.dumps(fields)
    if len(shared) <= 2:  # b"{}"
        return tail
    return memoryview(shared)[:-1], b",", tail[1:]
