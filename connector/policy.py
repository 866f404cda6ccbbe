"""Pull or recompute: an online cost model of prefill's compute and of KV transfers (pure, no I/O).

vLLM's ``kv_recompute_threshold`` is a constant token count: it ignores how fast this engine computes,
how fast the network moves KV, and how much other work waits for the engine. Prefill here learns, by
decaying least squares (recent samples weigh most):

- **compute**: engine step seconds against the tokens scheduled in the step; the slope is the marginal
  cost of one more token (the step's fixed part is paid anyway). Steps are timed by :class:`StepClock`,
  which stays right when steps overlap (async scheduling schedules step N+1 before step N's output).
- **transfer**: seconds of each NIXL READ the worker posted (NIXL's own telemetry) against the tokens it
  moved (one READ far slower than predicted is fitted only if the next is too: ``TRANSFER_OUTLIER``); the
  intercept is the per-READ fixed cost, the slope the bandwidth. Reads of decode's host tier are
  fitted apart (``host_transfers``) and an offer from the host tier is predicted at that rate. The first READ from an
  engine also pays the NIXL handshake: that is learned apart (``handshake``) and added only to an offer
  from an engine not handshaken yet. Time a pulling request then waits for the engine's next step is
  the engine's queue, not the transfer: it is kept apart (``observe_wait``, exported, never compared).

The decision (:meth:`CostModel.decide`) weighs, for an offer of N tokens:

- recompute: ``N x compute`` seconds of engine time, which this request waits for **and which also
  delays every other request with prefill work in the engine** (``load.requests`` of them);
- pull: the transfer's predicted seconds; the engine keeps computing other work meanwhile.

It pulls when ``pull < compute x (1 + waiting requests)``. ``kv_recompute_threshold`` stays a floor.
Without estimates it pulls. A refused pull is probed every ``probe_every``-th refusal, so that a
recovered network is noticed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: A busy engine fills every step to its token budget: step sizes then barely vary and a fitted slope is
#: noise, so below this spread (standard deviation over mean of step sizes) compute is the average rate.
STEP_SPREAD = 0.2
#: A READ slower than this many times the prediction is an outlier: fitted only when the next READ is one too. One
#: READ that stalls (a progress thread descheduled on a busy host: 179 ms for a 2 MiB READ that otherwise takes
#: 0.5-13 ms, in ``bench.pull_cost``) would otherwise steer the fit, and with it every decision, to recompute until
#: the next probe (no pull, so no sample to undo it): 5 of 12 later turns there. A lasting slowdown is learned from
#: its second READ on.
TRANSFER_OUTLIER = 3.0
#: Every reason a decision can give (one Prometheus label value each).
REASONS = ("floor", "no-estimate", "faster", "load", "slower", "probe")
#: Decode's tiers an offer is read from (``turnkv.metric_names.TIERS``): each has its own transfer fit.
DEVICE, HOST = "device", "host"


@dataclass
class Ewma:
    alpha: float = 0.2
    value: float | None = None

    def update(self, sample: float) -> float:
        self.value = sample if self.value is None else self.value + self.alpha * (sample - self.value)
        return self.value


@dataclass
class DecayingLine:
    """Least-squares fit of y = a + b*x over samples whose weight decays by ``decay`` per new sample."""

    decay: float = 0.9
    w: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def update(self, x: float, y: float) -> None:
        d = self.decay
        self.w, self.sx, self.sy = d * self.w + 1, d * self.sx + x, d * self.sy + y
        self.sxx, self.sxy = d * self.sxx + x * x, d * self.sxy + x * y

    def fit(self, min_spread: float = 0.0) -> tuple[float, float] | None:
        """(intercept, slope), both >= 0, or None without samples. When the samples' sizes vary by less than
        ``min_spread`` (standard deviation over mean), a slope would be noise: the average rate is returned."""
        if self.w == 0 or self.sx <= 0:
            return None
        denominator = self.w * self.sxx - self.sx * self.sx
        if denominator <= max(1e-12, min_spread * min_spread) * self.sx * self.sx:  # sizes (nearly) all equal
            return 0.0, self.sy / self.sx
        slope = (self.w * self.sxy - self.sx * self.sy) / denominator
        if slope <= 0:  # noise made bigger samples look no slower: fall back to the average rate, no fixed part
            return 0.0, self.sy / self.sx
        intercept = max(0.0, (self.sy - slope * self.sx) / self.w)
        return intercept, slope


class StepClock:
    """Engine-busy seconds of each step, by step number, when steps may overlap.

    ``scheduled(step, tokens, now)`` when the scheduler hands step ``step`` out, ``finished(step, now)``
    when its output comes back. With async scheduling step N+1 is scheduled before step N's output is
    processed, so one "step started" slot would be overwritten: each step is kept under its number, and
    a step's busy time starts when it was scheduled or when the step before it finished, whichever is
    later (the engine runs one step at a time). Steps whose output never comes back are dropped when a
    later step finishes.
    """

    def __init__(self, limit: int = 64) -> None:
        self._started: dict[int, tuple[float, int]] = {}
        self._last_end: float | None = None
        self._limit = limit

    def scheduled(self, step: int, tokens: int, now: float) -> None:
        self._started[step] = (now, tokens)
        while len(self._started) > self._limit:
            self._started.pop(next(iter(self._started)))

    def finished(self, step: int, now: float) -> tuple[float, int] | None:
        """(busy seconds, tokens) of ``step``, or None for a step not (or no longer) known."""
        entry = self._started.pop(step, None)
        for older in [s for s in self._started if s < step]:
            del self._started[older]
        if entry is None:
            return None
        started, tokens = entry
        if self._last_end is not None:
            started = max(started, self._last_end)
        self._last_end = now
        return max(0.0, now - started), tokens

    @property
    def in_flight(self) -> int:
        return len(self._started)


@dataclass(frozen=True)
class Load:
    """Prefill work in the engine besides the request being decided: requests and their uncomputed tokens."""

    requests: int = 0
    tokens: int = 0


@dataclass
class Decision:
    pull: bool
    reason: str  # one of REASONS
    tokens: int = 0
    predicted_pull_s: float | None = None
    #: Engine seconds to recompute the offered tokens (what this request would wait for).
    predicted_compute_s: float | None = None
    #: What recomputing would add to the other requests' waits (compute x waiting requests).
    queue_delay_s: float = 0.0
    load: Load = field(default_factory=Load)


@dataclass
class CostModel:
    probe_every: int = 20
    #: Engine step seconds against scheduled tokens (slope: marginal compute per token).
    steps: DecayingLine = field(default_factory=lambda: DecayingLine(decay=0.95))
    #: READ seconds against tokens moved (intercept: per-READ fixed cost; slope: per token): reads of decode's
    #: device cache.
    transfers: DecayingLine = field(default_factory=DecayingLine)
    #: The same for reads of decode's host tier (pinned host memory: another rate over the fabric, PCIe on neither
    #: side's GPU), learned apart so neither tier's samples skew the other's predictions.
    host_transfers: DecayingLine = field(default_factory=DecayingLine)
    #: NIXL handshake seconds (first READ from an engine).
    handshake: Ewma = field(default_factory=Ewma)
    #: Seconds a pulling request waited for the engine beyond its transfer (the queue; shown, not compared).
    wait: Ewma = field(default_factory=Ewma)
    _refused: int = 0
    #: An outlier READ (tokens, seconds) not fitted yet, and whether the READs fitted last were outliers in a row.
    _held: tuple[float, float] | None = None
    _slow_run: bool = False

    # inputs ------------------------------------------------------------------------------------

    def observe_step(self, seconds: float, scheduled_tokens: int) -> None:
        if scheduled_tokens > 0 and seconds > 0:
            self.steps.update(scheduled_tokens, seconds)

    def observe_transfer(self, seconds: float, tokens: float, tier: str = DEVICE) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        if tier == HOST:
            self.host_transfers.update(tokens, seconds)
            return
        predicted = self.predicted_pull(int(tokens))
        slow = bool(predicted) and seconds > TRANSFER_OUTLIER * predicted  # type: ignore[operator]
        if slow and not self._slow_run:
            if self._held is None:  # one outlier: held back until the next READ tells whether it lasts
                self._held = (tokens, seconds)
                return
            self.transfers.update(*self._held)  # two in a row: the link is slower now
            self._slow_run = True
        elif not slow:
            self._slow_run = False
        self._held = None
        self.transfers.update(tokens, seconds)

    def _line(self, tier: str) -> DecayingLine:
        return self.host_transfers if tier == HOST else self.transfers

    def observe_handshake(self, seconds: float) -> None:
        if seconds > 0:
            self.handshake.update(seconds)

    def observe_wait(self, seconds: float) -> None:
        self.wait.update(max(0.0, seconds))

    # estimates ---------------------------------------------------------------------------------

    @property
    def compute_per_token(self) -> float | None:
        fit = self.steps.fit(STEP_SPREAD)
        return None if fit is None else fit[1]

    @property
    def step_overhead(self) -> float | None:
        fit = self.steps.fit(STEP_SPREAD)
        return None if fit is None else fit[0]

    @property
    def pull_overhead(self) -> float | None:
        fit = self.transfers.fit()
        return None if fit is None else fit[0]

    @property
    def pull_per_token(self) -> float | None:
        fit = self.transfers.fit()
        return None if fit is None else fit[1]

    @property
    def host_pull_overhead(self) -> float | None:
        fit = self.host_transfers.fit()
        return None if fit is None else fit[0]

    @property
    def host_pull_per_token(self) -> float | None:
        fit = self.host_transfers.fit()
        return None if fit is None else fit[1]

    def predicted_pull(self, tokens: int, new_engine: bool = False, tier: str = DEVICE) -> float | None:
        """Seconds to READ ``tokens`` from ``tier`` of decode (its own fit: none until that tier was read)."""
        fit = self._line(tier).fit()
        if fit is None:
            return None
        handshake = (self.handshake.value or 0.0) if new_engine else 0.0
        return fit[0] + fit[1] * tokens + handshake

    def predicted_compute(self, tokens: int) -> float | None:
        per_token = self.compute_per_token
        return None if per_token is None else per_token * tokens

    # the decision ------------------------------------------------------------------------------

    def decide(self, tokens: int, floor: int, load: Load = Load(), new_engine: bool = False,
               tier: str = DEVICE) -> Decision:
        if tokens <= 0 or (floor > 0 and tokens < floor):
            return Decision(False, "floor", tokens, load=load)
        pull_s, compute_s = self.predicted_pull(tokens, new_engine, tier), self.predicted_compute(tokens)
        if pull_s is None or compute_s is None:
            return Decision(True, "no-estimate", tokens, pull_s, compute_s, load=load)
        queue_s = compute_s * load.requests
        if pull_s < compute_s:
            return Decision(True, "faster", tokens, pull_s, compute_s, queue_s, load)
        if pull_s < compute_s + queue_s:
            return Decision(True, "load", tokens, pull_s, compute_s, queue_s, load)
        self._refused += 1
        if self.probe_every and self._refused % self.probe_every == 0:
            return Decision(True, "probe", tokens, pull_s, compute_s, queue_s, load)
        return Decision(False, "slower", tokens, pull_s, compute_s, queue_s, load)
