"""Pull or recompute: an online cost model of prefill's own compute and of pulls (pure, no I/O).

vLLM's ``kv_recompute_threshold`` is a constant token count: it ignores how fast this engine computes
and how fast the network moves KV. Prefill here learns both online, as exponentially weighted
averages: seconds per computed prompt token (from prefill-heavy engine steps), and a line
``seconds = overhead + tokens * per_token`` fitted by exponentially forgetting least squares over
finished pulls (the fixed part is handshake and notification, the slope is bandwidth). It pulls only
when the pull is expected to be faster than computing the same tokens; the configured threshold stays a floor. With no
measurements yet it pulls (the floor alone decides), and it keeps probing: every ``probe_every``-th
refused offer is pulled anyway so that a recovered network is noticed.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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

    def fit(self) -> tuple[float, float] | None:
        """(intercept, slope), both >= 0, or None without samples."""
        if self.w == 0 or self.sx <= 0:
            return None
        denominator = self.w * self.sxx - self.sx * self.sx
        if denominator <= 1e-12 * max(1.0, self.w * self.sxx):  # all samples the same size: a rate only
            return 0.0, self.sy / self.sx
        slope = (self.w * self.sxy - self.sx * self.sy) / denominator
        if slope <= 0:  # noise made bigger pulls look no slower: fall back to the average rate, no fixed part
            return 0.0, self.sy / self.sx
        intercept = max(0.0, (self.sy - slope * self.sx) / self.w)
        return intercept, slope


@dataclass
class Decision:
    pull: bool
    reason: str  # "floor", "no-estimate", "faster", "slower", "probe"
    predicted_pull_s: float | None = None
    predicted_compute_s: float | None = None


@dataclass
class CostModel:
    #: Steps with at least this many scheduled tokens count as prefill samples (decode steps are not).
    min_prefill_tokens: int = 256
    probe_every: int = 20
    compute_per_token: Ewma = field(default_factory=Ewma)
    pulls: DecayingLine = field(default_factory=DecayingLine)
    _refused: int = 0

    def observe_step(self, seconds: float, scheduled_tokens: int, pulled_in_step: bool = False) -> None:
        if scheduled_tokens >= self.min_prefill_tokens and seconds > 0 and not pulled_in_step:
            self.compute_per_token.update(seconds / scheduled_tokens)

    def observe_pull(self, seconds: float, tokens: int) -> None:
        if tokens > 0 and seconds > 0:
            self.pulls.update(tokens, seconds)

    @property
    def pull_overhead(self) -> float | None:
        fit = self.pulls.fit()
        return None if fit is None else fit[0]

    @property
    def pull_per_token(self) -> float | None:
        fit = self.pulls.fit()
        return None if fit is None else fit[1]

    def predicted_pull(self, tokens: int) -> float | None:
        fit = self.pulls.fit()
        return None if fit is None else fit[0] + fit[1] * tokens

    def predicted_compute(self, tokens: int) -> float | None:
        if self.compute_per_token.value is None:
            return None
        return self.compute_per_token.value * tokens

    def decide(self, tokens: int, floor: int) -> Decision:
        if tokens <= 0 or (floor > 0 and tokens < floor):
            return Decision(False, "floor")
        pull_s, compute_s = self.predicted_pull(tokens), self.predicted_compute(tokens)
        if pull_s is None or compute_s is None:
            return Decision(True, "no-estimate", pull_s, compute_s)
        if pull_s < compute_s:
            return Decision(True, "faster", pull_s, compute_s)
        self._refused += 1
        if self.probe_every and self._refused % self.probe_every == 0:
            return Decision(True, "probe", pull_s, compute_s)
        return Decision(False, "slower", pull_s, compute_s)
