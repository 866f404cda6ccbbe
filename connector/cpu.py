"""The one fix for vLLM + NIXL that only CPU engines need (see shared/notes/local-engines.md).

On the CPU platform the NIXL worker pins its process to the last core of each NUMA node, so every engine
on a host fights over one core. The engine's own placement (``taskset``) is kept instead. GPU and Neuron
workers do not pin. The NIXL agent settings (progress-thread delay, thread sync) apply on every platform:
``connector.nixl_agent``.

CPU agents also keep the strict thread-sync mode for every connector mode, as the engine suites have always
run them; push + bi-directional gets it on every platform from the connector itself.
"""

from __future__ import annotations

import logging
import os
import types
from typing import Any

logger = logging.getLogger("vllm.turnkv.cpu")


def _is_cpu_platform() -> bool:
    """vLLM's CPU platform, not vllm-neuron's (device type "neuron", or "cpu" in the plugin's CPU mode: told apart by
    its class and module, ``turnkv.platforms.platform_name``)."""
    from connector.compat import current_platform_name

    return current_platform_name() == "cpu"


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
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    applied = []
    config = base_worker.nixl_agent_config
    if config is not None and not getattr(config, "_turnkv_cpu_strict", False):
        from nixl._api import nixl_thread_sync_t

        def strict_by_default(*args: Any, **kwargs: Any) -> Any:
            kwargs.setdefault("sync_mode", nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
            return config(*args, **kwargs)

        strict_by_default._turnkv_cpu_strict = True  # type: ignore[attr-defined]
        strict_by_default._turnkv_wrapped = True  # type: ignore[attr-defined]
        base_worker.nixl_agent_config = strict_by_default
        applied.append("strict-sync")
    if not isinstance(base_worker.os, _NoPinOs):
        base_worker.os = _NoPinOs()  # type: ignore[assignment]
        applied.append("keep-core-affinity")
    return applied
