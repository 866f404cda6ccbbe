"""Per-tenant shares of the router's event loop (router.limits.LoopShare, Meter, Metered)."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.limits import LoopShare, Meter, Metered


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def _metered(coro, meter: Meter):
    return await Metered(coro, meter)


def test_share_decays_over_the_window():
    clock = Clock()
    ledger = LoopShare(window=2.0, clock=clock)
    ledger.charge("a", 1.0)
    assert ledger.share("a") == pytest.approx(0.5)
    clock.now += 2.0
    assert ledger.share("a") == pytest.approx(0.5 / 2.718281828, rel=1e-6)
    assert ledger.share() == pytest.approx(ledger.share("a"))


def test_a_tenant_over_its_share_is_refused_only_while_the_loop_is_busy_and_shared():
    clock = Clock()
    ledger = LoopShare(window=2.0, clock=clock)
    ledger.charge("a", 1.2)  # 60% of the loop
    assert ledger.refuse("a", 0.25) is None  # alone: work-conserving
    ledger.charge("b", 0.01)
    wait = ledger.refuse("a", 0.25)
    assert wait is not None and wait >= 1  # 2 s x ln(0.6 / 0.25) ~ 1.75 s
    assert ledger.refuse("b", 0.25) is None
    assert ledger.refuse("a", 1.0) is None  # 1: off
    clock.now += wait
    assert ledger.refuse("a", 0.25) is None


def test_a_light_loop_refuses_no_one():
    ledger = LoopShare(window=2.0, clock=Clock())
    ledger.charge("a", 0.3)  # 15% of the loop: over a 10% share
    ledger.charge("b", 0.05)
    assert ledger.refuse("a", 0.10) is None  # 17.5% in all: under twice the share


def test_many_tenants_stay_bounded():
    clock = Clock()
    ledger = LoopShare(window=2.0, clock=clock, max_keys=10)
    for i in range(10):
        ledger.charge(f"t{i}", 0.001)
    clock.now += 60
    ledger.charge("new", 0.001)
    assert len(ledger._used) == 1


def test_metered_times_each_step_and_charges_the_tenant_once_known():
    ledger = LoopShare(window=2.0)
    meter = Meter(ledger)

    async def work() -> str:
        time.sleep(0.02)  # before the tenant is known: held
        meter.known("a")
        await asyncio.sleep(0.5)  # suspended: not charged
        time.sleep(0.02)
        return "done"

    assert asyncio.run(_metered(work(), meter)) == "done"
    used = ledger.share("a") * ledger.window
    assert 0.035 < used < 0.3  # both sleeps (with room for a loaded host), not the suspension


def test_metered_passes_exceptions_and_cancellation_through():
    meter = Meter(LoopShare())

    async def fails() -> None:
        await asyncio.sleep(0)
        raise KeyError("x")

    with pytest.raises(KeyError):
        asyncio.run(_metered(fails(), meter))

    async def cancelled() -> bool:
        async def slow() -> None:
            try:
                await asyncio.sleep(10)
            finally:
                meter.known("t")

        async def outer() -> None:
            await Metered(slow(), meter)

        task = asyncio.create_task(outer())
        await asyncio.sleep(0.01)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return True
        return False

    assert asyncio.run(cancelled())


def test_a_failed_metered_coroutine_leaves_no_cycle_holding_its_buffers():
    """A request cancelled while it reads its body must free the body at once, not at the next full GC pass (the
    driver's frame held the thrown exception, whose traceback held the frame: RSS grew by the parked bodies)."""
    import gc
    import weakref

    class Buffer:
        pass

    refs: list[weakref.ref] = []

    async def reading() -> None:
        buffer = Buffer()
        refs.append(weakref.ref(buffer))
        await asyncio.sleep(10)

    async def run() -> None:
        task = asyncio.create_task(_drive())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    async def _drive() -> None:
        await Metered(reading(), Meter(LoopShare()))

    gc.disable()
    try:
        asyncio.run(run())
        assert refs and refs[-1]() is None
    finally:
        gc.enable()
