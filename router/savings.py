"""What reuse saved, in prefill seconds and in dollars (pure: no I/O).

A turn that pulled N tokens from decode did not compute them on prefill. The prefill seconds saved are
``N x`` prefill's seconds per computed token, as this router measures it (``router.telemetry.PrefillRate``: the
prefill leg's time over the prompt tokens prefill computed, on turns that reused nothing; the source is stated in
the metric's help). Dollars are those seconds at the price of one prefill engine-hour: the prefill pool's instance
price (``turnkv.plan.hardware``, the one price table) over the engines one instance runs, which the deployment
passes in ``TURNKV_PREFILL_ENGINE_PRICE_PER_HOUR`` (``turnkv.router_env``); unknown (0): seconds only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: The Prometheus label of requests without a tenant (a router serving without API keys).
NO_TENANT = "default"


def tenant_label(tenant: str) -> str:
    return tenant or NO_TENANT


@dataclass(frozen=True)
class Saved:
    """One turn's saving."""

    seconds: float
    dollars: float | None  # None when the price is unknown


def saved(reused_tokens: int, seconds_per_token: float, price_per_hour: float) -> Saved | None:
    """The prefill time (and its price) a turn's reused tokens saved; None when nothing was reused or the rate is not
    measured yet."""
    if reused_tokens <= 0 or seconds_per_token <= 0:
        return None
    seconds = reused_tokens * seconds_per_token
    return Saved(seconds, seconds * price_per_hour / 3600 if price_per_hour > 0 else None)


@dataclass
class Ledger:
    """Turns and savings since start, per tenant: the dollars saved per 1,000 turns a user reads."""

    turns: dict[str, int] = field(default_factory=dict)
    dollars: dict[str, float] = field(default_factory=dict)

    def add(self, tenant: str, saving: Saved | None) -> None:
        label = tenant_label(tenant)
        self.turns[label] = self.turns.get(label, 0) + 1
        if saving is not None and saving.dollars is not None:
            self.dollars[label] = self.dollars.get(label, 0.0) + saving.dollars

    def per_1k_turns(self, tenant: str | None = None) -> float:
        """Dollars saved per 1,000 turns, for one tenant or (None) the whole deployment."""
        if tenant is None:
            turns, dollars = sum(self.turns.values()), sum(self.dollars.values())
        else:
            label = tenant_label(tenant)
            turns, dollars = self.turns.get(label, 0), self.dollars.get(label, 0.0)
        return 1000 * dollars / turns if turns else 0.0
