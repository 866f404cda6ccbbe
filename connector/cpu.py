"""Fixes for vLLM + NIXL on CPU-only engines (see shared/notes/local-engines.md).

1. NIXL's progress thread polls with zero delay, so every idle engine burns a core. Agents get a
   progress thread that sleeps ``TURNKV_NIXL_PROGRESS_US`` (default 1000 µs) between polls, or none
   when that is 0, and the strict thread-sync mode, which protects the UCX worker from concurrent
   use (the push writer thread segfaults in ``uct_tcp_ep_am_zcopy`` otherwise). Over TCP a peer's
   READ needs this engine's UCX progress: the thread serves it even while the engine loop is idle.
2. On the CPU platform the NIXL worker pins its process to the last core of each NUMA node, so every
   engine on a host fights over one core. The engine's own placement (``taskset``) is kept instead.
Both apply only on the CPU platform; GPU engines are left untouched.
"""

from __future__ import annotations

import logging
import os
import types
from typing import Any

logger = logging.getLogger("vllm.turnkv.cpu")


def _is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.device_type == "cpu"


def progress_delay_us() -> int:
    try:
        return max(0, int(os.environ.get("TURNKV_NIXL_PROGRESS_US", "1000")))
    except ValueError:
        return 1000


def _quiet_agent_config(original: Any) -> Any:
    """Wrap nixl_agent_config: a slow (or no) progress thread and strict thread sync."""
    if original is None or getattr(original, "_turnkv_wrapped", False):
        return original
    from nixl._api import nixl_thread_sync_t

    delay = progress_delay_us()

    def make(*args: Any, **kwargs: Any) -> Any:
        kwargs["enable_prog_thread"] = delay > 0
        kwargs.setdefault("sync_mode", nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        return original(*args, **kwargs)

    make._turnkv_wrapped = True  # type: ignore[attr-defined]
    return make


class _DelayedProgressBindings(types.ModuleType):
    """nixl's bindings as nixl._api sees them, except that agents get a non-zero progress delay.

    nixl._api hard-codes ``pthrDelay = 0`` (a busy loop); the agent constructor is the last point
    where the value can be changed before the C++ agent starts its thread.
    """

    def __init__(self, bindings: Any, delay_us: int) -> None:
        super().__init__(bindings.__name__)
        self._bindings = bindings
        self._delay_us = delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bindings, name)

    def nixlAgent(self, name: str, config: Any) -> Any:
        if config.useProgThread:
            config.pthrDelay = self._delay_us
        return self._bindings.nixlAgent(name, config)


class _NoPinOs(types.ModuleType):
    """``os`` as the NIXL worker sees it, minus sched_setaffinity (the process keeps its taskset)."""

    def __init__(self) -> None:
        super().__init__("os")

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    @staticmethod
    def sched_setaffinity(pid: int, cores: Any) -> None:
        logger.info("turnkv: kept core affinity %s (NIXL asked for %s)", sorted(os.sched_getaffinity(pid)), cores)


def apply() -> list[str]:
    if not _is_cpu_platform():
        return []
    from vllm.distributed import nixl_utils
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    applied = []
    wrapped = _quiet_agent_config(nixl_utils.nixl_agent_config)
    if wrapped is not None:
        nixl_utils.nixl_agent_config = wrapped  # type: ignore[attr-defined]
        base_worker.nixl_agent_config = wrapped
        delay = progress_delay_us()
        if delay > 0:
            import nixl._api as nixl_api

            if not isinstance(nixl_api.nixlBind, _DelayedProgressBindings):
                nixl_api.nixlBind = _DelayedProgressBindings(nixl_api.nixlBind, delay)
        applied.append(f"nixl-progress-thread({delay}us)+strict-sync" if delay else "nixl-no-progress-thread")
    if not isinstance(base_worker.os, _NoPinOs):
        base_worker.os = _NoPinOs()  # type: ignore[assignment]
        applied.append("keep-core-affinity")
    return applied
