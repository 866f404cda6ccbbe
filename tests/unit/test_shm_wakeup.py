"""A wake-up lost in vLLM's shared-memory queue costs the recheck, and the CPU spin cut bounds it
(connector/idle.py). The real ``MessageQueue``: a writer sends two messages 0.5 ms apart (``execute_model``, then
``sample_tokens``), the reader is descheduled 3 ms between its look at the buffer and its wait (past the 2 ms
spin), and the second wake-up is dropped by the writer's socket."""

from __future__ import annotations

import threading
import time

import pytest

from connector import idle

shm_broadcast = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")


def second_message_latency(recheck_ms: int) -> float:
    """Seconds from the second message's send to its read."""
    writer = shm_broadcast.MessageQueue(1, 1)
    reader = shm_broadcast.MessageQueue.create_from_handle(writer.export_handle(), 0)
    cond = reader._spin_condition
    cond.busy_loop_s = idle.worker_spin_seconds()
    wait = cond.wait

    def descheduled_wait(timeout_ms: int | None = None) -> None:
        time.sleep(0.003)  # the reader loses the CPU between check() and wait(): its 2 ms spin is over
        wait(timeout_ms)

    cond.wait = descheduled_wait
    got: list[float] = []

    def read() -> None:
        reader.wait_until_ready()
        for _ in range(2):
            reader.dequeue()
            got.append(time.monotonic())

    thread = threading.Thread(target=read, daemon=True)
    old = shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS
    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = recheck_ms
    try:
        thread.start()
        writer.wait_until_ready()
        time.sleep(0.05)  # the reader goes idle: it now waits on the notify socket
        writer.enqueue("execute_model")
        time.sleep(0.0005)
        writer.enqueue("sample_tokens")
        sent = time.monotonic()
        thread.join(10)
    finally:
        shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = old
    assert len(got) == 2, "the reader never got the second message"
    return got[1] - sent


def test_a_lost_wake_up_waits_for_the_recheck():
    """Without the bound (a 0.6 s recheck standing in for upstream's 5 s), the second message waits the recheck out.
    The drop needs the two sends within zmq's command throttle (about 1 ms): a sleep that overshoots on a busy
    machine may let one pair through, so up to three pairs."""
    assert any(second_message_latency(600) > 0.4 for _ in range(3))


def test_the_spin_cut_bounds_a_lost_wake_up(monkeypatch):
    monkeypatch.setattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS", 5000)
    init = shm_broadcast.SpinCondition.__init__  # unwrapped (the plugin may have run in this process), restored after
    monkeypatch.setattr(shm_broadcast.SpinCondition, "__init__", getattr(init, "__wrapped__", init))
    monkeypatch.delenv("TURNKV_WORKER_RECHECK_MS", raising=False)
    applied = idle._shorter_worker_spin()
    assert applied == ["worker-spin(2ms, recheck 10ms)"]
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == 10
    assert second_message_latency(shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS) < 0.1


def test_recheck_setting(monkeypatch):
    monkeypatch.setenv("TURNKV_WORKER_RECHECK_MS", "25")
    assert idle.worker_recheck_ms() == 25
    monkeypatch.setenv("TURNKV_WORKER_RECHECK_MS", "0")
    assert idle.worker_recheck_ms() == 1
