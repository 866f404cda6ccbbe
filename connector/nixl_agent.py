"""How turnkv's engines create their NIXL agents, on every platform (GPU, Neuron, CPU).

1. **Progress thread.** NIXL's Python API starts the agent's progress thread with zero delay: every engine
   busy-polls a core (the GPU engine's host core included). Agents get a progress thread that sleeps
   ``TURNKV_NIXL_PROGRESS_US`` (default 1000 µs) between polls, or none when that is 0. Over TCP a peer's
   READ needs this engine's progress: the thread serves it even while the engine loop is idle.
2. **Thread sync.** Push + bi-directional (``TurnkvPushConnector`` with ``bidirectional_kv_xfer``) uses one
   agent from two threads: prefill posts its READs of decode's retained KV from the engine thread while the
   ``nixl-push-writer`` thread WRITEs and polls notifications. Those agents are created with the strict
   thread-sync mode, whatever the platform (without it the UCX worker is used concurrently: a segfault in
   ``uct_tcp_ep_am_zcopy`` under load on CPU; the same race on GPU). What decides it is what the connector
   does, not the platform: :func:`strict_thread_sync` wraps the push worker's construction.
"""

from __future__ import annotations

import contextlib
import os
import types
from collections.abc import Iterator, Mapping
from typing import Any

#: The connector classes that run upstream's push writer thread beside the engine thread.
PUSH_CONNECTORS = frozenset({"TurnkvPushConnector"})
_BIDI_KEY = "bidirectional_kv_xfer"


def progress_delay_us() -> int:
    try:
        return max(0, int(os.environ.get("TURNKV_NIXL_PROGRESS_US", "1000")))
    except ValueError:
        return 1000


def needs_strict_sync(kv_connector: str | None, extra_config: Mapping[str, Any] | None) -> bool:
    """True when one agent is driven from two threads: push + bi-directional (any platform)."""
    return kv_connector in PUSH_CONNECTORS and bool((extra_config or {}).get(_BIDI_KEY, False))


def _strict_mode() -> Any:
    from nixl._api import nixl_thread_sync_t

    return nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT


def quiet_agent_config(original: Any) -> Any:
    """Wrap ``nixl_agent_config``: a progress thread with a delay (or none when the delay is 0)."""
    if original is None or getattr(original, "_turnkv_wrapped", False):
        return original
    delay = progress_delay_us()

    def make(*args: Any, **kwargs: Any) -> Any:
        kwargs["enable_prog_thread"] = delay > 0
        return original(*args, **kwargs)

    make._turnkv_wrapped = True  # type: ignore[attr-defined]
    return make


@contextlib.contextmanager
def strict_thread_sync(module: Any) -> Iterator[None]:
    """While a worker is built, the agents ``module.nixl_agent_config`` makes use NIXL's strict thread sync.

    Composes with :func:`quiet_agent_config` (the plugin's wrapper, if installed, stays underneath), and
    works without the plugin too: the push + bi-directional worker applies it itself.
    """
    original = getattr(module, "nixl_agent_config", None)
    if original is None:  # NIXL without the config API: nothing to set
        yield
        return
    mode = _strict_mode()

    def strict(*args: Any, **kwargs: Any) -> Any:
        kwargs["sync_mode"] = mode
        return original(*args, **kwargs)

    module.nixl_agent_config = strict
    try:
        yield
    finally:
        module.nixl_agent_config = original


class DelayedProgressBindings(types.ModuleType):
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


def apply() -> list[str]:
    """General-plugin side, every platform: the progress-thread delay for every agent vLLM creates."""
    from vllm.distributed import nixl_utils
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    wrapped = quiet_agent_config(nixl_utils.nixl_agent_config)
    if wrapped is None:
        return []
    if wrapped is nixl_utils.nixl_agent_config and base_worker.nixl_agent_config is wrapped:
        return []  # applied already
    nixl_utils.nixl_agent_config = wrapped  # type: ignore[attr-defined]
    base_worker.nixl_agent_config = wrapped
    delay = progress_delay_us()
    if delay > 0:
        import nixl._api as nixl_api

        if not isinstance(nixl_api.nixlBind, DelayedProgressBindings):
            nixl_api.nixlBind = DelayedProgressBindings(nixl_api.nixlBind, delay)
    return [f"nixl-progress-thread({delay}us)" if delay else "nixl-no-progress-thread"]
