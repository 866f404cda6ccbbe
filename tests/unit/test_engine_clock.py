"""bench.engine_clock: fake engines' step loops schedule as vLLM's does (token budget, running first, one token per
decode step for the whole batch) and take the modelled time; the planner's costs behind the named models."""

from __future__ import annotations

import asyncio
import time

import pytest

from bench.engine_clock import COMPUTE_MODELS, ComputeModel, DecodeClock, PrefillClock, compute_model

#: 10 ms per step plus 10 us per token; a 512-token budget; decode 10 ms plus 1 ms per sequence.
FAST = ComputeModel("test", (0, 1000), (0.010, 0.020), 512, 0.010, 0.001)


async def test_prefill_chunks_over_the_budget_and_keeps_a_started_request_first():
    clock = PrefillClock(FAST)
    done: dict[str, float] = {}
    t0 = time.perf_counter()

    async def one(name: str, tokens: int, after: float = 0.0) -> None:
        await asyncio.sleep(after)
        await clock.prefill(tokens)
        done[name] = time.perf_counter() - t0

    # a: 300 tokens, b: 400 (212 in step 1, 188 in step 2), c arrives during step 1 and goes after b's rest
    await asyncio.gather(one("a", 300), one("b", 400), one("c", 100, after=0.005))
    assert clock.steps == 2 and clock.tokens == 800
    assert done["a"] < done["b"] and done["b"] == pytest.approx(done["c"], abs=0.003)
    # step 1: 512 tokens (15.1 ms), step 2: 288 (12.9 ms)
    assert clock.busy_s == pytest.approx(FAST.prefill_s(512) + FAST.prefill_s(288))
    assert done["c"] >= clock.busy_s - 0.001


async def test_a_cancelled_prefill_leaves_the_queue_and_the_loop_stops():
    clock = PrefillClock(FAST)
    first = asyncio.create_task(clock.prefill(512))
    second = asyncio.create_task(clock.prefill(512))
    await asyncio.sleep(0.005)  # both queued, step 1 (the first's 512) under way
    second.cancel()
    await first
    with pytest.raises(asyncio.CancelledError):
        await second
    await asyncio.sleep(0.03)
    assert clock.steps == 1 and clock.tokens == 512, "the cancelled request was never computed"
    assert clock._loop is not None and clock._loop.done()


async def test_nothing_to_compute_returns_at_once():
    clock = PrefillClock(FAST)
    await clock.prefill(0)
    assert clock.steps == 0


async def test_decode_gives_every_sequence_one_token_per_step_and_a_late_one_joins_the_next_step():
    clock = DecodeClock(FAST)
    seen: dict[str, list[int]] = {"a": [], "b": [], "late": []}

    async def run(name: str, n: int, after: float = 0.0) -> None:
        await asyncio.sleep(after)
        async for i in clock.tokens(n):
            seen[name].append(clock.steps)  # the step that made token i
            assert i == len(seen[name]) - 1

    await asyncio.gather(run("a", 3), run("b", 5), run("late", 2, after=0.004))
    assert seen["a"] == [1, 2, 3] and seen["b"] == [1, 2, 3, 4, 5]
    assert seen["late"] == [2, 3], "joined at the step after it arrived"
    assert clock.steps == 5 and clock.batched == 2 + 3 + 3 + 1 + 1


async def test_decode_step_time_grows_with_the_batch():
    clock = DecodeClock(FAST)
    t0 = time.perf_counter()

    async def drain(n: int) -> None:
        async for _ in clock.tokens(n):
            pass

    await asyncio.gather(*(drain(4) for _ in range(20)))
    assert clock.busy_s == pytest.approx(4 * FAST.decode_s(20))
    assert time.perf_counter() - t0 >= clock.busy_s - 0.002


async def test_decode_runs_at_most_max_seqs_and_the_others_wait_first_come():
    clock = DecodeClock(FAST, max_seqs=2)
    first: dict[str, int] = {}

    async def run(name: str, n: int, after: float = 0.0) -> None:
        await asyncio.sleep(after)
        async for _ in clock.tokens(n):
            first.setdefault(name, clock.steps)

    # a and b fill the two slots; c waits for a's slot (a ends at step 2), d for b's (step 4)
    await asyncio.gather(run("a", 2), run("b", 4), run("c", 3, after=0.001), run("d", 1, after=0.002))
    assert first == {"a": 1, "b": 1, "c": 3, "d": 5}
    assert clock.steps == 5 and clock.batched == 10  # two sequences in every step, never three


def test_the_named_models_come_from_the_planner():
    model = compute_model("qwen3-32b-p5en-tp8")
    assert model is not None and model.max_batched_tokens == 8192
    small, large = model.prefill_s(256), model.prefill_s(4096)
    assert 0 < small < large and large / small > 8, "prefill grows with the tokens computed"
    assert model.prefill_s(1) > 0, "a step has a floor: the weights are read whatever the batch"
    assert model.decode_s(64) > model.decode_s(1) > 0
    # TP 2 is slower per token than TP 8 for the same model
    tp2 = compute_model("qwen3-32b-p5en-tp2")
    assert tp2 is not None and tp2.prefill_s(2048) > model.prefill_s(2048) and tp2.decode_s(1) > model.decode_s(1)
    assert compute_model("instant") is None
    with pytest.raises(ValueError, match="use one of instant, " + next(iter(COMPUTE_MODELS))):
        compute_model("h200-fast")
