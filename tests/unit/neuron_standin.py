"""A stand-in for the native vllm-neuron platform, built from the cited facts in ``turnkv.neuron`` (no Neuron here).

What vLLM and NIXL read of the plugin and nothing else: its device type and name, the NIXL device table, no
``get_nixl_memory_type`` override (so ``kv_buffer_device: cuda`` registers as VRAM), no pinned host memory,
``set_device`` a no-op (each worker sees one device), and the attention backend's name and KV layout.
"""

from __future__ import annotations

from turnkv import neuron


class NativeNeuronPlatform:
    """What the native plugin's ``NeuronPlatform`` declares (``turnkv.neuron.PLUGIN_PLATFORM``)."""

    device_type = neuron.DEVICE_TYPE
    device_name = neuron.DEVICE_TYPE
    device_control_env_var = neuron.VISIBLE_DEVICES

    @classmethod
    def get_nixl_supported_devices(cls) -> dict[str, set[str]]:
        return {neuron.DEVICE_TYPE: {neuron.KV_BUFFER_DEVICE}}

    @classmethod
    def get_nixl_memory_type(cls) -> None:
        return None  # not overridden by the plugin: vLLM maps kv_buffer_device "cuda" to VRAM

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def is_rocm(cls) -> bool:
        return False

    @classmethod
    def set_device(cls, device: object) -> None:
        """The plugin's is a no-op: a worker sees one Neuron device (``NEURON_VISIBLE_DEVICES`` per engine)."""


NativeNeuronPlatform.__module__ = "vllm_neuron.vllm.platform"


def attention_backend() -> type:
    """vllm-neuron's ``NeuronAttentionBackend`` as vLLM sees it: name ``CUSTOM``, KV pages in HND order
    (``turnkv.neuron.KV_LAYOUT``). Built on first use: vLLM's ``AttentionBackend`` is imported lazily."""
    from vllm.v1.attention.backend import AttentionBackend

    class NeuronAttentionBackend(AttentionBackend):
        @staticmethod
        def get_name() -> str:
            return neuron.ATTENTION_BACKEND

        @staticmethod
        def get_impl_cls() -> type:
            raise NotImplementedError("the attention runs in vllm-neuron's model code")

        @staticmethod
        def get_builder_cls() -> type:
            raise NotImplementedError("the attention runs in vllm-neuron's model code")

    NeuronAttentionBackend.__module__ = "vllm_neuron.vllm.attention.attn"
    return NeuronAttentionBackend
