"""The vLLM releases this connector is written against (``turnkv.versions.SUPPORTED_VLLM``), and the shims
for where their NIXL internals differ. Anything else is refused at start, naming the supported releases.

Shims are gated on the running release, each saying which release needs it, so moving the matrix (adding or
dropping a release) shows every place to revisit: ``grep -n "release()" connector/``.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Mapping
from typing import Any

from turnkv import platforms, versions


class UnsupportedVllmError(RuntimeError):
    pass


def _base(version: str) -> str:
    return version.split("+", 1)[0]


def check_vllm_version(version: str | None = None) -> str:
    """Return the running vLLM version, or raise naming the supported ones."""
    if version is None:
        import vllm

        version = vllm.__version__
    if _base(version) not in versions.SUPPORTED_VLLM:
        images = ", ".join(f"{image} image {release}" for image, release in versions.IMAGE_VLLM.items())
        raise UnsupportedVllmError(
            f"turnkv's connector supports vLLM {' and '.join(versions.SUPPORTED_VLLM)} ({images}; it subclasses "
            f"their NIXL connector internals), but vLLM {version} is installed. Install a supported version "
            f"(see turnkv/versions.py) or use the upstream NixlConnector without turnkv's connector.")
    return version


def as_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in _base(version).split(".")[:3])


@functools.cache
def release() -> tuple[int, ...]:
    """The running vLLM release as a tuple, e.g. (0, 32, 0)."""
    import vllm

    return as_tuple(vllm.__version__)


def fail_read(worker: object, req_id: str) -> None:
    """Fail one READ before it is posted (prefill then recomputes), in the running release's terms."""
    handle_failed = worker._handle_failed_transfer  # type: ignore[attr-defined]
    if release() < (0, 32):
        # 0.29: (req_id, handle); it also counts the read as a transport failure.
        handle_failed(req_id, None)
    else:
        # 0.32: the failed set the worker tracks, and no transport-failure count (turnkv counts its own).
        handle_failed(req_id, None, worker._recv_failures, record_failed_transfer=False)  # type: ignore[attr-defined]


def uses_v2_model_runner(vllm_config: Any) -> bool:
    """Whether the engine runs vLLM's Model Runner V2 (0.32: the default on CUDA wherever Triton is present;
    ``VLLM_USE_V2_MODEL_RUNNER=0`` pins V1). Releases without the switch run V1. Asked of the engine's own config,
    so it answers for the runner this engine will build."""
    try:
        return bool(getattr(vllm_config, "use_v2_model_runner", False))
    except Exception:  # a feature that requires V2 and a setting that refuses it: the engine will not start anyway
        return True


def reads_inline() -> bool:
    """0.32's NIXL worker keeps what an inline read waits on (``_recv_failures``, notify-only receives that are never
    reported); 0.29's does not, so every pull there stays asynchronous (``connector.inline``)."""
    return release() >= (0, 32)


def reports_prefill_cached_tokens() -> bool:
    """0.32's scheduler adds ``remote_prefill_cached_tokens`` (local hits + pulled) to prefill's answer; 0.29's
    does not, so the connector adds it there (the router counts reused tokens from it)."""
    return release() >= (0, 32)


def prefill_cached_tokens(request: Any) -> int | None:
    """On 0.29, the prompt tokens prefill does not compute, as 0.32's scheduler would report them: the
    ``num_cached_tokens`` of the request's ``PrefillStats``, which 0.29's scheduler also keeps (reset at each
    admission, before the connector's ``update_state_after_alloc``) but never sends. Read, not recounted from
    ``get_num_new_matched_tokens``: after a failed READ the request is admitted again with nothing to load,
    and only the stats say so. None where the release reports them itself, or once the stats are taken."""
    if reports_prefill_cached_tokens():
        return None
    stats = getattr(request, "prefill_stats", None)
    return None if stats is None else int(stats.num_cached_tokens)


def start_read(worker: Any, req_id: str, meta: Any) -> None:
    """Post one READ of a remote engine's blocks the way the running release's pull worker does."""
    if release() < (0, 32):
        # 0.29: metadata always kept (failure recovery); an unknown engine is handshaken first, in the background.
        worker._recving_metadata[req_id] = meta
        engine_id = meta.remote.engine_id
        if engine_id not in worker._remote_agents:
            with worker._handshake_lock:
                if engine_id not in worker._remote_agents:
                    worker._background_nixl_handshake(req_id, engine_id, meta)
                    return
        worker._read_blocks_for_req(req_id, meta)
        return
    # 0.32: a full local hit only notifies the remote (nothing awaited); _read_blocks_for_req handshakes itself.
    if meta.awaiting_kvs or any(meta.local_block_ids):
        worker._recving_metadata[req_id] = meta
    worker._read_blocks_for_req(req_id, meta)


def current_platform_name() -> str:
    """The running vLLM platform in ``turnkv.platforms`` terms ("neuron" on vllm-neuron, whose native platform
    declares device type "neuron": ``turnkv.neuron.DEVICE_TYPE``; "cpu" only in the plugin's CPU mode)."""
    from vllm.platforms import current_platform

    return platforms.platform_name(current_platform, sys.modules)


def check_platform(device_type: str | None = None, env: Mapping[str, str] | None = None) -> None:
    """Refuse to build the connector where it is unverified (``turnkv.platforms``), e.g. on Neuron."""
    if device_type is None:
        device_type = current_platform_name()
    platforms.check(device_type, os.environ if env is None else env)
