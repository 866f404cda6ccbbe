"""Max-min fair shares (pure): how a capacity is divided among the tenants that want it.

Every tenant gets what it asks for when the asks fit; otherwise the *water level* ``L`` is the largest share such
that ``sum(min(ask, L)) == capacity``: tenants asking less than ``L`` get all they ask, the others get ``L`` each.
So a tenant alone may use the whole capacity, a light tenant is never cut while a heavier one is over the level,
and under contention the heaviest is cut first (its excess goes to nobody's cost but its own). Shown by Bertsekas
and Gallager, *Data Networks*, 6.5.2 (the classic water-filling argument).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping


def water_level(capacity: float, asks: Iterable[float]) -> float:
    """The level ``L`` each ask is cut to (``math.inf`` when every ask fits: nobody is cut)."""
    ordered = sorted(a for a in asks if a > 0)
    if sum(ordered) <= capacity:
        return math.inf
    left, n = max(0.0, capacity), len(ordered)
    for i, ask in enumerate(ordered):
        fair = left / (n - i)
        if ask > fair:
            return fair
        left -= ask
    return math.inf  # not reached: the asks exceed the capacity, so some ask is above its fair part


def shares(capacity: float, asks: Mapping[str, float]) -> dict[str, float]:
    """Each tenant's max-min share of ``capacity`` given what it asks."""
    level = water_level(capacity, asks.values())
    return {tenant: min(max(ask, 0.0), level) for tenant, ask in asks.items()}

