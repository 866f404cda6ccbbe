"""Drain an engine node that Auto Scaling is terminating (a roll, a scale-in), then let the termination go on.

``turnkv engine drain`` runs on every engine node (``turnkv-drain.service``). It watches the node's target lifecycle
state in instance metadata (``autoscaling/target-lifecycle-state``: ``Terminated`` once the terminate lifecycle
hook holds the instance in ``Terminating:Wait``). By then the hook's Lambda has taken the node's engines out of
Cloud Map, so:

1. it waits ``settle_s`` (twice the routers' ``discovery_interval``): every router has dropped the engines, so no
   new turn reaches them, and stored turns that name them are no longer replayed (the router's guard refuses an
   offer whose engine is not in its pool and recomputes; the retained KV goes with the node);
2. it waits until no request runs on the node's engines (``vllm:num_requests_running``): in-flight streams finish;
3. it completes the lifecycle action (CONTINUE), at the latest at ``timeout_s`` (the pool's ``drain_timeout_s``;
   the hook's own timeout, a minute longer, bounds a node that cannot answer).

The loop is pure over a ``DrainProbe`` (instance metadata, the engines' metrics, Auto Scaling, a clock).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

#: The target lifecycle state of an instance the terminate hook holds (EC2 Auto Scaling user guide, "Retrieve the
#: target lifecycle state through instance metadata").
TERMINATING = "Terminated"


class DrainProbe(Protocol):
    def lifecycle_state(self) -> str | None: ...

    def running(self) -> int | None:
        """Requests running on the node's engines (None: no engine answers, nothing left to wait for)."""

    def complete(self) -> None: ...

    def now(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


@dataclass(frozen=True)
class Drained:
    waited_s: float
    #: Requests still running when the action was completed (0 unless the timeout cut them).
    running: int
    timed_out: bool


def drain(probe: DrainProbe, timeout_s: float, settle_s: float, poll_s: float = 5.0) -> Drained:
    """Steps 1-3 above, from the moment the node learned it is terminating."""
    start = probe.now()
    deadline = start + timeout_s
    probe.sleep(max(0.0, min(settle_s, deadline - probe.now())))
    running = probe.running() or 0
    while running > 0 and probe.now() < deadline:
        probe.sleep(max(0.0, min(poll_s, deadline - probe.now())))
        running = probe.running() or 0
    probe.complete()
    return Drained(waited_s=probe.now() - start, running=running, timed_out=running > 0)


def watch(probe: DrainProbe, timeout_s: float, settle_s: float, poll_s: float = 5.0) -> Drained:
    """Wait for the terminate hook (polling instance metadata every ``poll_s``), then ``drain``."""
    while probe.lifecycle_state() != TERMINATING:
        probe.sleep(poll_s)
    return drain(probe, timeout_s, settle_s, poll_s)


def running_requests(metrics_text: str) -> int:
    """The sum of ``vllm:num_requests_running`` over an engine's Prometheus text (every label set)."""
    from turnkv import metric_names as mn

    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(mn.VLLM_RUNNING) and line[len(mn.VLLM_RUNNING):len(mn.VLLM_RUNNING) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)
