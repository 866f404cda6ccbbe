"""One admission record per prefill request that carries decode's offer (pure: no vLLM, no I/O).

vLLM's scheduler asks the connector about a waiting request on every step until the request gets KV room
(``get_num_new_matched_tokens``), then allocates it (``update_state_after_alloc``), then hands the step's metadata to
the workers (``build_connector_meta``), which READ. Before this record, what the first look decided (refused, pull
or recompute, from which tier, by when) was spread over side tables popped at different points, and a later look
asked upstream afresh: a host-tier offer the cost model declined at the first look lost its host entry there, the
next look pulled anyway, and the worker READ decode's device blocks at the host pool's slot numbers (issue 50).

Now the first look decides once and writes an :class:`Admission`; every later look, the allocation, the workers'
read plan and the request's end read that record and nothing else, and :meth:`Admissions.drop` forgets it in one
place. A verdict other than ``PULL`` also cuts the offer in the request's params (``connector.scheduler``), so
upstream cannot pull what the record declined.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from connector.retention import Tier


class Verdict(StrEnum):
    """What the first look decided for an offer."""

    #: Read (all of it, or the verified prefix).
    PULL = "pull"
    #: A valid offer not worth reading (cost model, threshold, no verified token): nothing read, decode notified.
    RECOMPUTE = "recompute"
    #: Not read at all (forged, expired, replayed, not cleared, late): neutralized, no peer contacted.
    REFUSED = "refused"


@dataclass(frozen=True)
class ReadPlan:
    """What the workers need for one admitted READ, sent once in the step's metadata (``turnkv_reads``)."""

    #: Wall instant from which the READ must not be posted (``turnkv.wire.read_deadline``); None: no deadline.
    deadline: float | None = None
    #: Wall instant from which decode may have freed the blocks (the deadline plus ``expiry_skew_margin``: decode
    #: frees an evicted, expired or fork-window-ended turn no earlier): a READ that ends later may have read another
    #: turn's KV, and its blocks are recomputed. The deadline bounds when a READ starts; this, when it ends.
    safe_until: float | None = None
    #: Decode's boot stamp the offer came from (``connector.boot``): a READ from another process is refused.
    boot: str | None = None
    #: Host-tier offer: decode's pool base on each rank and the pool's slot count (``connector.host_tier``).
    host: tuple[tuple[int, ...], int] | None = None
    #: Read inside the step that computes the request (``connector.inline``).
    inline: bool = False
    #: Decode's per-block digests of the KV bytes, one tuple per decode rank, aligned with the offer's block ids
    #: (``connector.fingerprint``): the workers check every block the READ brought against them. None: unsealed.
    seal: tuple[tuple[int, ...], ...] | None = None

    @property
    def tier(self) -> Tier:
        return Tier.HOST if self.host is not None else Tier.DEVICE


@dataclass
class Admission:
    """One request's admission, decided at its first look."""

    verdict: Verdict
    #: Why (an offer verdict such as ``late`` or ``forged``, a cost-model reason, ``ok``).
    reason: str
    plan: ReadPlan = field(default_factory=ReadPlan)
    #: The token proof's verdict, reported in prefill's answer (``connector.token_proof``); None when not checked.
    proof: Any = None
    #: Tokens the allocation was made for (None until allocated): the workers READ only when it is > 0.
    allocated: int | None = None
    #: Whether the workers were given the read plan (it travels once).
    sent: bool = False

    @property
    def pulls(self) -> bool:
        return self.verdict is Verdict.PULL


class Admissions:
    """The records of the requests this prefill engine has looked at and not finished (pure)."""

    def __init__(self) -> None:
        self._by_id: dict[str, Admission] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, request_id: str) -> Admission | None:
        return self._by_id.get(request_id)

    def decide(self, request_id: str, admission: Admission) -> Admission:
        """The first look's decision (a second decision for one request is a bug: later looks read the record)."""
        if request_id in self._by_id:
            raise RuntimeError(f"request {request_id} was already admitted: later looks must read its record")
        self._by_id[request_id] = admission
        return admission

    def refuse(self, request_id: str, reason: str) -> Admission | None:
        """A pull that may no longer be read (its deadline passed while it waited): refused from now on."""
        admission = self._by_id.get(request_id)
        if admission is not None:
            admission.verdict, admission.reason = Verdict.REFUSED, reason
            admission.plan = ReadPlan()
        return admission

    def past_deadline(self, request_id: str, now: float) -> bool:
        """A pull whose READ was not handed to the workers yet and may no longer start."""
        admission = self._by_id.get(request_id)
        if admission is None or not admission.pulls or admission.sent:
            return False
        deadline = admission.plan.deadline
        return deadline is not None and now >= deadline

    def set_inline(self, request_id: str, inline: bool) -> None:
        """The inline plan of the look that is about to be allocated (each look of a pull plans it anew)."""
        admission = self._by_id.get(request_id)
        if admission is not None and admission.pulls and admission.plan.inline != inline:
            admission.plan = dataclasses.replace(admission.plan, inline=inline)

    def allocated(self, request_id: str, num_external_tokens: int) -> Admission | None:
        admission = self._by_id.get(request_id)
        if admission is not None:
            admission.allocated = int(num_external_tokens)
        return admission

    def for_workers(self, request_ids: Any) -> dict[str, ReadPlan]:
        """The read plans of the step's receives (``reqs_to_recv``) that READ something, each handed over once. A
        receive with no plan is a notification only (nothing allocated to read, or a declined offer: decode is told
        it may free the turn)."""
        plans = {}
        for request_id in request_ids:
            admission = self._by_id.get(request_id)
            if admission is None or not admission.pulls or admission.sent or not admission.allocated:
                continue
            admission.sent = True
            plans[request_id] = admission.plan
        return plans

    def drop(self, request_id: str) -> Admission | None:
        """The request finished (or was aborted): the one place a record is forgotten."""
        return self._by_id.pop(request_id, None)
