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

    applied = register_connectors()
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


def register_connectors() -> list[str]:
    """turnkv's connectors in vLLM's connector registry, by class name, in every process. A config names them with
    ``kv_connector_module_path`` and needs no registry, but a ``MultiConnector`` (a prefill with vLLM's CPU
    offloading tier: ``turnkv.engine_args``) rebuilds its children's stats in the API server by registered name, and
    without it every metrics interval fails there ("Connector 'TurnkvPullConnector' is not registered") and the
    server answers 500 (tests/e2e/test_multi_connector.py)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from turnkv.engine_args import CONNECTORS

    registered = []
    for name, module_path in CONNECTORS.values():
        try:
            KVConnectorFactory.register_connector(name, module_path, name)
        except ValueError:  # registered already (a second plugin load in one process)
            continue
        registered.append(f"connector {name}")
    return registered
