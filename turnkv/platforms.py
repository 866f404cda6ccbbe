"""What turnkv has verified per accelerator platform, and the refusal for what it has not (pure, no I/O).

The engine suites run the connector on vLLM's CPU build; the GPU image ships byte-identical connector code
(``turnkv.vllm_files``). On Neuron, two things have never run anywhere turnkv can test: NIXL registering
Neuron device memory as the KV buffer, and bi-directional transfer (decode's retained KV read back by
prefill) over it. An engine asked to do them stops at start with this message instead of serving wrong KV or
crash-looping; ``TURNKV_ALLOW_UNVERIFIED=neuron`` starts it anyway, for whoever verifies it on a Trn node.
"""

from __future__ import annotations

from collections.abc import Container, Mapping

ALLOW_ENV = "TURNKV_ALLOW_UNVERIFIED"

#: platform -> what turnkv's connector has not been verified to do there.
UNVERIFIED: dict[str, tuple[str, ...]] = {
    "neuron": (
        "NIXL with Neuron device memory as the KV buffer (LIBFABRIC reads of HBM)",
        "bi-directional KV transfer (prefill reading decode's retained KV back)",
    ),
}


#: The module vllm-neuron's platform plugin lives in (``vllm_neuron.platform.NeuronPlatform``).
NEURON_MODULE = "vllm_neuron"


def platform_name(platform: object, loaded_modules: Container[str] = ()) -> str:
    """The platform a vLLM ``current_platform`` runs on, in this module's terms.

    The native vllm-neuron plugin declares ``device_type = "neuron"`` (``turnkv.neuron.DEVICE_TYPE``); the
    NxD-Inference-based plugin before it, and the native one in its CPU mode, declare ``"cpu"``, so the device type
    alone would take such a node for a CPU one and no refusal would fire. Neuron is also told by the platform's
    class (module or name), its ``device_name``, or ``vllm_neuron`` being loaded (``loaded_modules``, e.g.
    ``sys.modules``).
    """
    cls = type(platform)
    names = f"{cls.__module__}.{cls.__qualname__} {getattr(platform, 'device_name', '')}".lower()
    if "neuron" in names or NEURON_MODULE in loaded_modules:
        return "neuron"
    return str(getattr(platform, "device_type", "") or "")


class UnverifiedPlatformError(RuntimeError):
    """The engine would run turnkv's connector where it has never been verified."""


def unverified(platform: str) -> tuple[str, ...]:
    return UNVERIFIED.get(platform, ())


def _allowed(env: Mapping[str, str]) -> set[str]:
    """What ``TURNKV_ALLOW_UNVERIFIED`` (a comma list) lets run although unverified."""
    return {p.strip().lower() for p in env.get(ALLOW_ENV, "").split(",") if p.strip()}


def refusal(platform: str, env: Mapping[str, str]) -> str | None:
    """The message an engine start on ``platform`` must stop with, or None when it may start."""
    gaps = unverified(platform)
    allowed = _allowed(env)
    if not gaps or platform in allowed:
        return None
    return (f"turnkv's connector is unverified on {platform}: " + "; ".join(gaps) + ". "
            f"No suite runs it there, so the engine does not start. To try it anyway on a test node, set "
            f"{ALLOW_ENV}={platform} in /etc/turnkv/engine.env (a deployment: connector.allow_unverified: "
            f"[{platform}] in its deploy config; then check KV moved: "
            f"vllm:nixl_bytes_transferred on /metrics, and answers equal to a recompute).")


def check(platform: str, env: Mapping[str, str]) -> None:
    message = refusal(platform, env)
    if message:
        raise UnverifiedPlatformError(message)


#: What TURNKV_ALLOW_UNVERIFIED names to let engines of unequal KV block sizes exchange KV.
BLOCK_SIZES = "block-size"


def block_size_refusal(local: int | None, remote: int | None, remote_engine: str, env: Mapping[str, str]) -> str | None:
    """Why this engine must not exchange KV with ``remote_engine`` (None: it may). Unequal block sizes take
    upstream's block-size-ratio path, which on vLLM's CPU build gave a different answer to the same prompt with no
    reuse at all (bench.shapes: prefill 32 against decode 128), and turnkv's proofs, offers and host tier are
    verified with equal sizes only. Unknown sizes (an older peer) are not refused."""
    if not local or not remote or int(local) == int(remote):
        return None
    allowed = _allowed(env)
    if BLOCK_SIZES in allowed:
        return None
    return (f"turnkv: engine {remote_engine} has KV block size {remote}, this engine {local}. Unequal block sizes "
            f"between prefill and decode are unverified (on vLLM's CPU build they changed answers), so no KV is "
            f"exchanged with it: give every engine the same --block-size (turnkv's default: 128), or set "
            f"{ALLOW_ENV}={BLOCK_SIZES} to try it on a test deployment.")
