"""One client request's state on its way through the two legs (``router.flow``).

A module of its own so that the parts the flow drives (the engine legs, the client relay) can read and fill it in
without importing the flow: no import cycle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from router import apis, guard, hints
from router.choices import ONE, Plan
from router.engines import Engine
from router.fairqueue import Ticket
from router.outcomes import RequestKind, ReuseOutcome


@dataclass
class Dispatch:
    """One client request on its way through the two legs."""

    kind: RequestKind
    path: str
    body: dict[str, Any]
    request_id: str  # the client's (or ours): echoed in the reply header and logged, never sent to an engine
    turn: guard.Turn | None
    key: str | None  # where this turn's previous turn is looked up (None: nothing to look up)
    outcome: ReuseOutcome = ReuseOutcome.NONE
    reused_tokens: int = 0
    #: Prompt tokens prefill found in its own prefix cache (not computed, not pulled).
    prefill_cached_tokens: int = 0
    #: A fork: the stored turn was already read by another request of the same history (``router.flow``).
    fork: bool = False
    started: float = 0.0
    tenant: str = ""
    #: The tenant as decode and prefill see it (``turnkv.wire.TENANT``): a keyed digest, never the key's name.
    tenant_tag: str = ""
    tokens: int = 0  # prompt size estimate (load accounting)
    stream: bool = False
    leg_request_id: str = ""  # router-generated, sent to both engines; a fresh one per dispatch and retry
    affinity: str = ""  # decode engine holding the conversation's blocks
    #: Tenant-scoped key of the shared prompt prefix ("": none), set at the first prefill choice (prefill affinity,
    #: ``router.engines.prefix``); None: not computed yet.
    prefix_key: str | None = None
    prompt_tokens: int = 0
    prefill_ms: float | None = None
    ttft: float | None = None
    retries: int = 0
    retain: bool = False  # decode is asked to keep this turn's KV (a conversation turn within the tenant's limits)
    migrate: bool = False  # a stream that may continue on another decode engine (router.migrate)
    prompt_ids: bytes | None = None  # the rendered prompt's token ids as prefill wrote them (when migrate)
    status: int = 0
    error: str = ""
    prefill_engine: str = ""
    decode_engine: str = ""
    hint: hints.Hint | None = None
    #: Reuse applies: decode retains its KV for the next turn and the reply is stored.
    storable: bool = False
    #: DNS names of the request's media URLs, resolved and checked before any engine sees it (``router.media``).
    media_names: set[str] = field(default_factory=set)
    #: Decode engines this dispatch must not use: a stream migration's dead engines (``router.relay``), tried
    #: already as far as the flow's retries are concerned.
    avoid_decode: list[Engine] = field(default_factory=list)
    #: Another API translated to chat completions (``router.apis``): its answers are translated back.
    api: apis.Translation | None = None
    route: str = ""  # the client's route when it differs from ``path`` (translated APIs)
    #: Its place in the decode pool's fair queue (``decode_fair_sequences``), held until the answer ends; a stream
    #: migration's continuation shares it.
    decode_slot: Ticket | None = None
    #: Gives the request's share of the prefill pool back (``router.flow``): an answer that is not streamed shows no
    #: first token, so its share goes back when prefill has answered instead of when the whole answer has.
    prefill_share_done: Callable[[], None] | None = None
    #: How the request is served and how many sequences it asks decode for (``router.choices``): one P/D pair, decode
    #: alone, or one P/D pair per prompt; its ``choices`` are the units it holds of the decode pool.
    plan: Plan = ONE
    #: The body less the legs' own fields, serialised once at intake (``router.encoded``); None: not made (a small
    #: body, serialised whole by each leg).
    encoded: bytes | None = None
