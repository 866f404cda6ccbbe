"""No busy engine while it only holds retained KV blocks.

A finished request whose blocks are kept for another engine to read (decode's retained turn in
bi-directional mode, prefill's blocks under lease) keeps vLLM's engine loop stepping about every
millisecond, scheduling nothing, until the blocks are read or expire: a whole core for up to
``decoder_kv_blocks_ttl``. Two loops burn it:

1. the engine core steps every 1 ms. When nothing is running or waiting, it now waits on its input
   queue for up to ``TURNKV_IDLE_TICK_MS`` (default 100 ms) between steps instead: a new request
   still wakes it at once, and retained blocks are still released when read or expired, a tick later;
2. every step wakes the model worker, whose shared-memory queue then spins for 1 s after each read
   before it sleeps, so steps closer than a second keep it spinning for good. On CPU engines the spin
   window is cut to ``TURNKV_WORKER_SPIN_MS`` (default 2 ms); under load the next step follows within a
   millisecond and it still spins. Not on GPUs (:func:`spin_cut_applies`).
   A reader past its spin waits on a zmq wake-up, and the writer's socket drops a wake-up sent while the
   previous one is unacknowledged (``SNDHWM`` 1; zmq applies the acknowledgement at most about once a
   millisecond): vLLM sends ``execute_model`` and ``sample_tokens`` that close together. A reader descheduled
   past its 2 ms spin between its look at the buffer and its wait then slept until its recheck, 5 s upstream:
   the whole engine stood still (``bench pressure`` p4 at 40 conversations: 27 requests held 5.6 s, the CPU
   idle). With the spin cut the recheck is cut to ``TURNKV_WORKER_RECHECK_MS`` (default 10 ms), which bounds a
   lost wake-up; an idle reader wakes 100 times a second for it.

Measured with ``python -m bench.idle_cpu`` (decode CPU over the minute after a burst of conversations):
a 1 s tick saved the most CPU but let a peer's pull wait up to a tick for this engine's transfer
progress; 100 ms keeps turn-2 TTFT where upstream's loop has it at about 5 % of a core.

Reads by other engines need neither loop: NIXL's progress thread serves them (see nixl_agent.py).
"""

from __future__ import annotations

import functools
import logging
import os
import queue
from typing import Any

logger = logging.getLogger("vllm.turnkv.idle")


def _ms_setting(name: str, default_ms: float) -> float:
    try:
        return max(0.0, float(os.environ.get(name, str(default_ms))) / 1000)
    except ValueError:
        return default_ms / 1000


def idle_tick_seconds() -> float:
    return _ms_setting("TURNKV_IDLE_TICK_MS", 100)


def worker_spin_seconds() -> float:
    return _ms_setting("TURNKV_WORKER_SPIN_MS", 2)


def worker_recheck_ms() -> int:
    """How long an idle shared-memory reader waits for a wake-up before it looks at the buffer again."""
    return max(1, round(_ms_setting("TURNKV_WORKER_RECHECK_MS", 10) * 1000))


def only_holding_blocks(core: Any) -> bool:
    """True when the engine has no request to compute, only connector bookkeeping."""
    scheduler = core.scheduler
    connector = getattr(scheduler, "connector", None)
    return (scheduler.get_num_unfinished_requests() == 0 and not core.batch_queue
            and not (connector is not None and connector.has_pending_push_work()))


def spin_cut_applies(platform: str) -> bool:
    """The worker spin cut is for CPU engines only. There a step is a few milliseconds and a spinning reader is a
    core taken from the engine; on a GPU a step takes 20-50 ms of kernel time, the worker's spin is what takes the
    next step's broadcast without a wake-up, and cutting it to 2 ms would add a sleep-and-wake to every step."""
    return platform == "cpu"


def apply(platform: str | None = None) -> list[str]:
    if platform is None:
        from connector.compat import current_platform_name

        platform = current_platform_name()
    return (_shorter_worker_spin() if spin_cut_applies(platform) else []) + _idle_engine_tick()


def _shorter_worker_spin() -> list[str]:
    from vllm.distributed.device_communicators import shm_broadcast
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    spin = worker_spin_seconds()
    init = SpinCondition.__init__
    if getattr(init, "_turnkv_wrapped", False):
        return []
    # Read at every wait (``ReadTimeoutWithWarnings.timeout_ms``), so the module constant is the setting.
    recheck = min(int(shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS), worker_recheck_ms())
    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = recheck

    @functools.wraps(init)
    def spin_condition_init(self: Any, is_reader: bool, *args: Any, **kwargs: Any) -> None:
        init(self, is_reader, *args, **kwargs)
        if is_reader:
            self.busy_loop_s = min(self.busy_loop_s, spin)

    spin_condition_init._turnkv_wrapped = True  # type: ignore[attr-defined]
    SpinCondition.__init__ = spin_condition_init
    return [f"worker-spin({spin * 1000:.0f}ms, recheck {recheck}ms)"]


def _idle_engine_tick() -> list[str]:
    from vllm.v1.engine.core import EngineCoreProc

    tick = idle_tick_seconds()
    step = EngineCoreProc._process_engine_step
    if tick <= 0 or getattr(step, "_turnkv_wrapped", False):
        return []

    @functools.wraps(step)
    def process_engine_step(self: Any) -> bool:
        model_executed = step(self)
        if not model_executed and self.scheduler.has_requests() and only_holding_blocks(self):
            try:
                request = self.input_queue.get(timeout=tick)
            except queue.Empty:
                pass
            else:
                self._handle_client_request(*request)
        return model_executed

    process_engine_step._turnkv_wrapped = True  # type: ignore[attr-defined]
    EngineCoreProc._process_engine_step = process_engine_step
    return [f"idle-tick({tick * 1000:.0f}ms)"]
