"""Run schedules: one seed (replay, with its trace), a range of seeds (the default run), or for a while (soak)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from tests.sim.model import Violation
from tests.sim.world import World

#: default: the deployment as configured today; spec: decode runs speculative decoding (lookahead slots); stall:
#: READs may stall past the margin decode keeps after a READ's last start.
SCENARIOS = ("default", "spec", "stall")


@dataclass
class Outcome:
    seed: int
    violations: list[Violation]
    stats: Counter[str]
    trace: list[str]


def run_one(seed: int, trace: bool = False, scenario: str = "default") -> Outcome:
    """One schedule. Without ``trace`` nothing is formatted (fast); a failing seed is run again with it."""
    world = World(seed, trace=trace, scenario=scenario)
    world.run()
    return Outcome(seed, world.violations, world.stats, world.trace.lines)


@dataclass
class Summary:
    schedules: int = 0
    seconds: float = 0.0
    failing: dict[int, list[Violation]] = field(default_factory=dict)
    stats: Counter[str] = field(default_factory=Counter)

    @property
    def per_minute(self) -> float:
        return 60.0 * self.schedules / self.seconds if self.seconds else 0.0

    def describe(self) -> str:
        kinds = Counter(v.kind for vs in self.failing.values() for v in vs[:1])
        reuse = ", ".join(f"{k} {v}" for k, v in sorted(self.stats.items()))
        return (f"{self.schedules} schedules in {self.seconds:.1f} s ({self.per_minute:.0f}/min); "
                f"{len(self.failing)} with violations {dict(kinds)}; {reuse}")


def run_many(seeds: range | list[int] | None = None, seconds: float | None = None, first: int = 0,
             stop_after: int | None = None, scenario: str = "default") -> Summary:
    """Schedules over ``seeds``, or from seed ``first`` on for ``seconds``; ``stop_after`` failing seeds ends it."""
    summary = Summary()
    started = time.perf_counter()
    seed_iter = iter(seeds) if seeds is not None else iter(range(first, 1 << 62))
    for seed in seed_iter:
        if seconds is not None and time.perf_counter() - started >= seconds:
            break
        outcome = run_one(seed, scenario=scenario)
        summary.schedules += 1
        summary.stats.update(outcome.stats)
        if outcome.violations:
            summary.failing[seed] = outcome.violations
            if stop_after is not None and len(summary.failing) >= stop_after:
                break
    summary.seconds = time.perf_counter() - started
    return summary


def report(seed: int, whole: bool = False, scenario: str = "default") -> str:
    """A seed's schedule again, with its trace: the whole trace, or the first violation's story (the lines naming
    the request, its conversation and its offer, and the deployment-wide events)."""
    world = World(seed, trace=True, scenario=scenario)
    world.run()
    verdict = "\n".join(str(v) for v in world.violations) or "no violation"
    lines = world.trace.lines if whole or not world.violations else world.trace.story(world.violations[0].related)
    return f"seed {seed} ({scenario}): {verdict}\n" + "\n".join(lines)
