"""The vLLM general-plugin entry point (``vllm.general_plugins`` -> ``turnkv``).

vLLM calls :func:`register` in every process it starts (API server, engine core, workers), before
the KV connector is built. Each patch is idempotent and can be switched off through
``TURNKV_PATCHES`` (comma-separated names, or ``none``), which helps bisect an engine problem.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("vllm.turnkv")

_registered = False


def _enabled(name: str) -> bool:
    raw = os.environ.get("TURNKV_PATCHES", "all").strip().lower()
    if raw in ("", "all"):
        return True
    return name in {p.strip() for p in raw.split(",")}


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    from connector import cpu, idle, leases, nixl_agent, streaming

    applied = []
    patches = (("nixl", nixl_agent), ("cpu", cpu), ("idle", idle), ("leases", leases), ("streaming", streaming))
    for name, module in patches:
        if not _enabled(name):
            continue
        try:
            applied += module.apply()
        except Exception:  # an engine without one patch beats no engine: say so loudly
            logger.exception("turnkv plugin: patch %r failed; the engine runs without it", name)
    if applied:
        logger.info("turnkv plugin applied: %s", ", ".join(applied))
