"""The router's request vocabulary as types: the kind of a request and why it did or did not reuse KV.

Both are ``StrEnum``s: a member is its value wherever it leaves the process (``str()``, f-strings, ``==`` with a
plain string, Prometheus labels, EMF fields, the ``X-TurnKV-Reuse-Outcome`` header, the SSE trailer comment), so
the wire stays byte-identical while the code compares members, not literals. Pure data, no imports from the
router: every module (the flow, the legs, ``router.guard``, telemetry) can read it.
"""

from __future__ import annotations

from enum import StrEnum


class RequestKind(StrEnum):
    """The engine API a request is dispatched as (other APIs are translated to chat, ``router.apis``)."""

    CHAT = "chat"  # /v1/chat/completions: turns addressed by their messages
    COMPLETION = "completion"  # /v1/completions: a raw prompt, addressed by a session hint


class ReuseOutcome(StrEnum):
    """Why a request did or did not reuse the previous turn's KV (docs/router.md "Reuse outcomes").

    The order is the order of the Prometheus label children (``router.telemetry.OUTCOMES``).
    """

    HIT = "hit"  # replayed
    MISS = "miss"  # nothing stored at this history's address
    MISMATCH = "mismatch"  # the prompt does not extend the stored history
    EXPIRED = "expired"  # the entry's blocks are (nearly) freed
    REFUSED = "refused"  # the stored params name an unknown engine (or decode ejected / evicted them since)
    RECOMPUTE = "recompute"  # replayed, but prefill recomputed (pull failed or below kv_recompute_threshold)
    TOKEN_MISMATCH = "token_mismatch"  # the text matched but prefill's token proof pulled less
    DISABLED = "disabled"  # the client turned reuse off
    STORE_ERROR = "store_error"  # the store was down or slow
    #: Nothing to look up: a first turn (no assistant message yet), n > 1, a token prompt, a raw-prompt completion
    #: without a session hint.
    NONE = "none"

