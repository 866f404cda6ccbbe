"""The router's request vocabulary as types: the kind of a request and why it did or did not reuse KV.

Both are ``StrEnum``s: a member is its value wherever it leaves the process (``str()``, f-strings, ``==`` with a
plain string, Prometheus labels, EMF fields, the ``X-TurnKV-Reuse-Outcome`` header, the SSE trailer comment), so
the wire stays byte-identical while the code compares members, not literals. Pure data, no imports from the
router: every module (the flow, the legs, ``router.guard``, telemetry) can read it. ``ReuseOutcome`` is defined
in ``turnkv.wire`` (clients of the router read it there) and re-exported here.
"""

from __future__ import annotations

from enum import StrEnum

from turnkv.wire import ReuseOutcome  # the protocol's values, named once for router and clients

__all__ = ["RequestKind", "ReuseOutcome"]


class RequestKind(StrEnum):
    """The engine API a request is dispatched as (other APIs are translated to chat, ``router.apis``)."""

    CHAT = "chat"  # /v1/chat/completions: turns addressed by their messages
    COMPLETION = "completion"  # /v1/completions: a raw prompt, addressed by a session hint
