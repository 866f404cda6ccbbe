"""Engine time for fake engines: the step loops of a GPU engine, so a fake takes as long as the real one would.

A fake engine that answers at once has no capacity but this machine's CPU: whoever sends the most requests fills
its event loop, and a benchmark of fairness then measures the operating system's scheduler, not the router. A real
vLLM engine has a step loop instead (``vllm.v1.core.sched.scheduler``): each step schedules the running requests,
then the waiting ones first come first served, within a token budget (``--max-num-batched-tokens``; a prompt larger
than what is left of it is chunked over several steps), and takes a time that grows with the tokens it computes
(prefill) or the sequences it decodes. ``PrefillClock`` and ``DecodeClock`` play those loops with ``asyncio.sleep``:
time passes as on the engine while this process's CPU stays nearly idle.

The step costs come from the planner (``turnkv.plan.closed_form``): its prefill compute over scheduled tokens and
a line through its decode step over batch size, for a model on an instance at a tensor-parallel size
(``ComputeModel.from_plan``). ``COMPUTE_MODELS`` names the ones benchmarks use.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np

#: Scheduled tokens at which the planner's prefill compute is sampled; between them it is interpolated.
PREFILL_GRID = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass(frozen=True)
class ComputeModel:
    """Step costs of one engine: prefill from a table of the planner's compute over scheduled tokens (linear in
    between: small steps sit on the weight-read floor, large ones grow with attention), decode
    ``step + seq x batch``."""

    name: str
    prefill_tokens: tuple[int, ...]
    prefill_seconds: tuple[float, ...]
    #: vLLM's token budget per step (``--max-num-batched-tokens``): its default for online serving on GPUs with
    #: 70 GiB or more (H100, H200) is 8,192 (``vllm.engine.arg_utils.EngineArgs``, usage context OPENAI_API_SERVER).
    max_batched_tokens: int
    decode_step_s: float
    decode_seq_s: float

    def prefill_s(self, tokens: int) -> float:
        return float(np.interp(tokens, self.prefill_tokens, self.prefill_seconds))

    def decode_s(self, batch: int) -> float:
        return self.decode_step_s + self.decode_seq_s * batch

    @classmethod
    def from_plan(cls, name: str, model: str, instance: str, tp: int, max_batched_tokens: int = 8192,
                  context: int = 2048) -> ComputeModel:
        """The planner's prefill compute (no cached context) at ``PREFILL_GRID`` and a line through its decode step
        (batch 1..64 at ``context`` tokens each) for ``model`` on ``instance`` at tensor-parallel size ``tp``."""
        from turnkv.plan import architectures, closed_form, hardware

        inst = hardware.load(instance)
        fleet = closed_form.Fleet(architectures.load(model), inst, inst, tp_prefill=tp, tp_decode=tp)
        tokens = np.array(PREFILL_GRID)
        prefill = closed_form.compute_s(fleet, tokens, np.zeros_like(tokens))
        batch = np.array([1, 4, 16, 32, 64])
        decode = np.array([float(closed_form.decode_step_s(fleet, np.array([context]), b)[0]) for b in batch])
        d_slope, d_step = np.polyfit(batch, decode, 1)
        return cls(name, PREFILL_GRID, tuple(float(x) for x in prefill), max_batched_tokens,
                   max(0.0, float(d_step)), max(0.0, float(d_slope)))


def compute_model(name: str) -> ComputeModel | None:
    """The named compute model; ``"instant"`` (None) answers at once, as fake engines always did."""
    if name == "instant":
        return None
    try:
        model, instance, tp = COMPUTE_MODELS[name]
    except KeyError:
        raise ValueError(f"unknown compute model {name!r}: use one of instant, {', '.join(COMPUTE_MODELS)}") from None
    return ComputeModel.from_plan(name, model, instance, tp)


#: name -> (planner model, instance, tensor-parallel size). The first is the deploy config's default engine.
COMPUTE_MODELS: dict[str, tuple[str, str, int]] = {
    "qwen3-32b-p5en-tp8": ("Qwen3-32B", "p5en.48xlarge", 8),
    "qwen3-32b-p5en-tp2": ("Qwen3-32B", "p5en.48xlarge", 2),
}


class _Prefill:
    __slots__ = ("done", "left")

    def __init__(self, tokens: int, done: asyncio.Future[None]) -> None:
        self.left = tokens
        self.done = done


class PrefillClock:
    """A prefill engine's step loop: requests first come first served within ``max_batched_tokens`` per step (a
    request already started keeps its place at the head, as vLLM schedules its running requests first), each step
    ``prefill_s(tokens scheduled)`` long."""

    def __init__(self, model: ComputeModel) -> None:
        self.model = model
        self._queue: collections.deque[_Prefill] = collections.deque()
        self._loop: asyncio.Task[None] | None = None
        self.steps = 0
        self.busy_s = 0.0
        self.tokens = 0  # tokens computed, over all steps

    async def prefill(self, tokens: int) -> None:
        """Return once ``tokens`` prompt tokens have been computed (at once for none)."""
        if tokens <= 0:
            return
        item = _Prefill(int(tokens), asyncio.get_running_loop().create_future())
        self._queue.append(item)
        if self._loop is None or self._loop.done():
            self._loop = asyncio.create_task(self._run())
        try:
            await item.done
        finally:
            if item.left > 0:  # the client went away (this await was cancelled): vLLM aborts the request
                with contextlib.suppress(ValueError):
                    self._queue.remove(item)

    async def _run(self) -> None:
        while self._queue:
            budget, scheduled, batch = self.model.max_batched_tokens, 0, []
            for item in self._queue:
                if budget <= 0:
                    break
                take = min(item.left, budget)
                batch.append((item, take))
                budget -= take
                scheduled += take
            cost = self.model.prefill_s(scheduled)
            await asyncio.sleep(cost)
            self.steps += 1
            self.busy_s += cost
            self.tokens += scheduled
            for item, take in batch:
                item.left -= take
                if item.left <= 0:
                    with contextlib.suppress(ValueError):
                        self._queue.remove(item)
                    if not item.done.done():
                        item.done.set_result(None)


class DecodeClock:
    """A decode engine's step loop: every running sequence gets one token per step, each step ``decode_s(batch)``
    long; a request joins at the next step after it arrives and leaves the batch with its last token. At most
    ``max_seqs`` run at once (vLLM's ``max_num_seqs``; 0: no bound): the others wait, first come first served, for a
    sequence to finish, as in the engine's waiting queue."""

    def __init__(self, model: ComputeModel, max_seqs: int = 0) -> None:
        self.model = model
        self.max_seqs = max_seqs
        self._members: dict[int, tuple[asyncio.Queue[None], list[int]]] = {}  # key -> (ticks, [tokens left])
        self._loop: asyncio.Task[None] | None = None
        self._ids = 0
        self.steps = 0
        self.busy_s = 0.0
        self.batched = 0  # sequences summed over steps: over ``steps``, the mean batch

    async def tokens(self, n: int) -> AsyncIterator[int]:
        """Yield 0..n-1, each when the step that makes that token ends."""
        if n <= 0:
            return
        self._ids += 1
        key, ticks = self._ids, asyncio.Queue()
        self._members[key] = (ticks, [n])
        if self._loop is None or self._loop.done():
            self._loop = asyncio.create_task(self._run())
        try:
            for i in range(n):
                await ticks.get()
                yield i
        finally:
            self._members.pop(key, None)  # gone early (client away): out of the next step

    async def _run(self) -> None:
        while self._members:
            # the oldest arrivals still here: the running set (the dict keeps arrival order)
            batch = list(itertools.islice(self._members.items(), self.max_seqs or None))
            cost = self.model.decode_s(len(batch))
            await asyncio.sleep(cost)
            self.steps += 1
            self.busy_s += cost
            self.batched += len(batch)
            for key, (ticks, left) in batch:
                ticks.put_nowait(None)
                left[0] -= 1
                if left[0] <= 0:  # its last token: the sequence finishes with this step, as on the engine
                    self._members.pop(key, None)
