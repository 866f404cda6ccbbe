"""How turnkv's engines create their NIXL agents, on every platform (GPU, Neuron, CPU).

1. **Progress thread.** NIXL's Python API starts the agent's progress thread with zero delay: every engine
   busy-polls a core (the GPU engine's host core included). What an agent gets depends on the backends it is
   created with (:func:`progress_setting`, the one place that decides):

   - ``TURNKV_NIXL_PROGRESS_US`` set: that delay for every agent, whatever its backends (0: no thread);
   - unset, UCX only (vLLM's default; TCP on CPU hosts): a thread that sleeps 1000 µs between polls. Over
     TCP a peer's READ needs this engine's progress: the thread serves it even while the engine loop is idle;
   - unset, any other backend (LIBFABRIC over EFA): upstream's thread with no delay. The 1 ms was measured
     for idle CPU over TCP; with TP 8 and many descriptors per READ it could cap EFA bandwidth.

   Each agent's setting is logged at creation (``vllm.turnkv.nixl``).
2. **Thread sync.** Push + bi-directional (``TurnkvPushConnector`` with ``bidirectional_kv_xfer``) uses one
   agent from two threads: prefill posts its READs of decode's retained KV from the engine thread while the
   ``nixl-push-writer`` thread WRITEs and polls notifications. Those agents are created with the strict
   thread-sync mode, whatever the platform (without it the UCX worker is used concurrently: a segfault in
   ``uct_tcp_ep_am_zcopy`` under load on CPU; the same race on GPU). What decides it is what the connector
   does, not the platform: :func:`strict_thread_sync` wraps the push worker's construction.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import types
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("vllm.turnkv.nixl")

#: The connector classes that run upstream's push writer thread beside the engine thread.
PUSH_CONNECTORS = frozenset({"TurnkvPushConnector"})
_BIDI_KEY = "bidirectional_kv_xfer"


#: The one setting of the progress thread; unset, the delay follows the agent's backends.
PROGRESS_ENV = "TURNKV_NIXL_PROGRESS_US"
#: The delay measured for UCX over TCP on CPU hosts (``bench.idle_cpu``: an idle engine at ~6 % of a core).
UCX_DELAY_US = 1000
#: Backends the default delay is for. Any other backend in an agent keeps upstream's zero-delay thread.
DELAYED_BACKENDS = frozenset({"UCX"})
#: What ``nixl_agent_config`` creates when no backends are named (NIXL's default).
DEFAULT_BACKENDS = ("UCX",)


@dataclass(frozen=True)
class ProgressSetting:
    """The progress thread an agent gets: whether it runs, its delay between polls, and why."""

    thread: bool
    delay_us: int
    source: str

    def describe(self) -> str:
        if not self.thread:
            return f"no progress thread ({self.source})"
        return f"progress thread polling every {self.delay_us} us ({self.source})"


def progress_setting(backends: Iterable[str] | None, env: Mapping[str, str] | None = None) -> ProgressSetting:
    """The progress thread for an agent created with ``backends`` (None: NIXL's default, UCX), pure.

    ``TURNKV_NIXL_PROGRESS_US`` in ``env``, when set to an integer, applies to every backend; unset (or not an
    integer), UCX-only agents get :data:`UCX_DELAY_US` and any other backend upstream's thread with no delay.
    """
    env = os.environ if env is None else env
    names = sorted({str(b) for b in (DEFAULT_BACKENDS if backends is None else backends)}) or list(DEFAULT_BACKENDS)
    raw = env.get(PROGRESS_ENV)
    note = ""
    if raw is not None and raw.strip():
        try:
            delay = max(0, int(raw))
        except ValueError:
            note = f"; {PROGRESS_ENV}={raw!r} is not an integer, ignored"
        else:
            return ProgressSetting(delay > 0, delay, f"{PROGRESS_ENV}={delay}, backends {','.join(names)}")
    if set(names) <= DELAYED_BACKENDS:
        return ProgressSetting(True, UCX_DELAY_US, f"turnkv's default for {','.join(names)}{note}")
    return ProgressSetting(True, 0, f"upstream's for {','.join(names)}: no added delay{note}")


def progress_delay_us(backends: Iterable[str] | None = None) -> int:
    """The delay an agent with ``backends`` gets (0 also when it gets no thread)."""
    return progress_setting(backends).delay_us


def needs_strict_sync(kv_connector: str | None, extra_config: Mapping[str, Any] | None) -> bool:
    """True when one agent is driven from two threads: push + bi-directional (any platform)."""
    return kv_connector in PUSH_CONNECTORS and bool((extra_config or {}).get(_BIDI_KEY, False))


def _strict_mode() -> Any:
    from nixl._api import nixl_thread_sync_t

    return nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT


def quiet_agent_config(original: Any) -> Any:
    """Wrap ``nixl_agent_config``: a progress thread or none, as :func:`progress_setting` decides for the
    backends the config names (the delay itself is set when the agent is created: :func:`delayed_agent_init`)."""
    if original is None or getattr(original, "_turnkv_wrapped", False):
        return original

    def make(*args: Any, **kwargs: Any) -> Any:
        kwargs["enable_prog_thread"] = progress_setting(kwargs.get("backends")).thread
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


#: The setting of the agent being constructed on this thread (set by :func:`delayed_agent_init`).
_constructing = threading.local()


class DelayedProgressBindings(types.ModuleType):
    """nixl's bindings as nixl._api sees them, except that agents get the progress delay turnkv decided.

    nixl._api hard-codes ``pthrDelay = 0`` (a busy loop); the agent constructor is the last point
    where the value can be changed before the C++ agent starts its thread. The setting is the one
    :func:`delayed_agent_init` decided for the agent under construction on this thread; a call from
    elsewhere gets the setting of NIXL's default backends.
    """

    def __init__(self, bindings: Any) -> None:
        super().__init__(bindings.__name__)
        self._bindings = bindings

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bindings, name)

    def nixlAgent(self, name: str, config: Any) -> Any:
        setting = getattr(_constructing, "setting", None) or progress_setting(None)
        if config.useProgThread and setting.delay_us > 0:
            config.pthrDelay = setting.delay_us
        return self._bindings.nixlAgent(name, config)


def delayed_agent_init(init: Any) -> Any:
    """Wrap ``nixl_agent.__init__``: decide the agent's progress setting from the backends its config names,
    log it, and hand it to :class:`DelayedProgressBindings` for the C++ agent this constructor creates."""
    if getattr(init, "_turnkv_wrapped", False):
        return init

    @functools.wraps(init)
    def __init__(self: Any, agent_name: str, nixl_conf: Any = None, instantiate_all: bool = False) -> None:
        if nixl_conf is not None:
            backends = getattr(nixl_conf, "backends", None)
        else:  # every plugin NIXL finds when instantiate_all, else its default (UCX)
            backends = ["ALL"] if instantiate_all else None
        setting = progress_setting(backends)
        thread = nixl_conf is None or getattr(nixl_conf, "enable_pthread", True)
        logger.info("turnkv: NIXL agent %s: %s", agent_name,
                    setting.describe() if thread else "no progress thread (its config)")
        previous = getattr(_constructing, "setting", None)
        _constructing.setting = setting
        try:
            init(self, agent_name, nixl_conf, instantiate_all)
        finally:
            _constructing.setting = previous

    __init__._turnkv_wrapped = True  # type: ignore[attr-defined]
    return __init__


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
    import nixl._api as nixl_api

    if not isinstance(nixl_api.nixlBind, DelayedProgressBindings):
        nixl_api.nixlBind = DelayedProgressBindings(nixl_api.nixlBind)
    nixl_api.nixl_agent.__init__ = delayed_agent_init(nixl_api.nixl_agent.__init__)
    ucx, libfabric = progress_setting(["UCX"]), progress_setting(["LIBFABRIC"])
    logger.info("turnkv: NIXL progress thread for UCX agents: %s; for LIBFABRIC agents: %s",
                ucx.describe(), libfabric.describe())
    return [f"nixl-progress-thread(UCX {ucx.delay_us if ucx.thread else 'off'}, "
            f"LIBFABRIC {libfabric.delay_us if libfabric.thread else 'off'})"]
