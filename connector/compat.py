"""The vLLM versions this connector is written against; anything else is refused at start."""

from __future__ import annotations

from turnkv import versions


class UnsupportedVllmError(RuntimeError):
    pass


def check_vllm_version(version: str | None = None) -> str:
    """Return the running vLLM version, or raise naming the supported ones."""
    if version is None:
        import vllm

        version = vllm.__version__
    base = version.split("+", 1)[0]
    if base not in versions.SUPPORTED_VLLM:
        raise UnsupportedVllmError(
            f"turnkv's connector supports vLLM {' and '.join(versions.SUPPORTED_VLLM)} (it subclasses their NIXL "
            f"connector internals), but vLLM {version} is installed. Install a supported version "
            f"(see turnkv/versions.py) or use the upstream NixlConnector without turnkv's connector.")
    return version
