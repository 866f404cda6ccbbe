"""Fixes for vLLM + NIXL on CPU-only engines (see shared/notes/local-engines.md).

1. NIXL's progress thread polls with zero delay, so every idle engine burns a core. Agents are
   created without it, and with the strict thread-sync mode, which then protects the UCX worker from
   concurrent use by the push writer thread (it segfaults in ``uct_tcp_ep_am_zcopy`` otherwise).
2. On the CPU platform the NIXL worker pins its process to the last core of each NUMA node, so every
   engine on a host fights over one core. The engine's own placement (``taskset``) is kept instead.
Both apply only on the CPU platform; GPU engines are left untouched.
"""

from __future__ import annotations

import logging
import os
import types
from typing import Any

logger = logging.getLogger("turnkv.connector.cpu")


def _is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.device_type == "cpu"


def _quiet_agent_config(original: Any) -> Any:
    """Wrap nixl_agent_config so that agents get no progress thread and strict thread sync."""
    if original is None or getattr(original, "_turnkv_wrapped", False):
        return original
    from nixl._api import nixl_thread_sync_t

    def make(*args: Any, **kwargs: Any) -> Any:
        kwargs["enable_prog_thread"] = False
        kwargs.setdefault("sync_mode", nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        return original(*args, **kwargs)

    make._turnkv_wrapped = True  # type: ignore[attr-defined]
    return make


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
        applied.append("nixl-no-progress-thread+strict-sync")
    if not isinstance(base_worker.os, _NoPinOs):
        base_worker.os = _NoPinOs()  # type: ignore[assignment]
        applied.append("keep-core-affinity")
    return applied
