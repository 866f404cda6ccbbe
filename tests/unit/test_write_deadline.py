"""router.deadline: one timer bounds every write of a stream, as asyncio.timeout around each write would."""

from __future__ import annotations

import asyncio

import pytest

from router.deadline import WriteDeadline


async def test_quick_writes_pass_and_a_stuck_one_times_out() -> None:
    deadline = WriteDeadline(0.05)
    for _ in range(3):  # across several timer rounds: idle time between writes is not counted
        assert await deadline.run(asyncio.sleep(0, result="ok")) == "ok"
        await asyncio.sleep(0.04)
    with pytest.raises(TimeoutError):
        await deadline.run(asyncio.sleep(1))
    deadline.close()
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_a_write_that_ends_in_time_after_a_long_idle_is_not_cut() -> None:
    deadline = WriteDeadline(0.05)
    await asyncio.sleep(0.12)
    assert await deadline.run(asyncio.sleep(0.03, result=1)) == 1
    deadline.close()


async def test_a_cancellation_from_elsewhere_still_propagates() -> None:
    async def stream() -> None:
        deadline = WriteDeadline(5)
        try:
            await deadline.run(asyncio.sleep(5))
        finally:
            deadline.close()

    task = asyncio.create_task(stream())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
