"""What turnkv relies on about AWS Neuron (Trainium) and the vllm-neuron plugin: one place, each fact cited.

No device here can check these, so every value carries where it was read. The pinned plugin is
``turnkv.versions.VLLM_NEURON`` (Neuron SDK ``NEURON_SDK``, the native plugin introduced in Neuron 2.31, whose docs
describe disaggregated inference). Its exact tag's source could not be read here: the plugin facts come from the
Neuron SDK documentation of the pinned release and from the nearest readable source of the native plugin (a fork
of vllm-project/vllm-neuron at 0.24.0.1.1.0, Neuron 2.32). docs/trainium.md renders :data:`FACTS` as its table, and
a test keeps the two equal. Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The sources, named once.
DI_DESIGN = ("Neuron SDK docs, vllm-neuron/docs/design/vllm/disaggregated-inference.md "
             "(aws-neuron/aws-neuron-sdk, updated 2026-08-12)")
DI_TUTORIAL = ("Neuron SDK docs, vllm-neuron/docs/tutorials/tutorial-di-1p1d-xpyd.md "
               "(aws-neuron/aws-neuron-sdk, updated 2026-08-12)")
SETUP_GUIDE = ("Neuron SDK docs, vllm-neuron/docs/getting-started/setup-guide.md, 'Install dependencies for "
               "disaggregated inference' (updated 2026-07-23)")
PLUGIN_PLATFORM = ("vllm_neuron/vllm/platform.py, NeuronPlatform (native plugin; read in a fork of "
                   "vllm-project/vllm-neuron at 0.24.0.1.1.0)")
PLUGIN_PYPROJECT = "vllm-neuron pyproject.toml, [project.entry-points.\"vllm.platform_plugins\"]"
VLLM_PLUGINS_LOADER = ("vllm/plugins/__init__.py load_plugins_by_group (vLLM 0.29 and 0.32): VLLM_PLUGINS "
                       "filters every group, platform plugins included")
DLAMI_GUIDE = "Neuron SDK docs, dlami/index.rst, 'SSM Parameter Prefix' (only .../latest/image_id is published)"
PLUGIN_ATTENTION = ("vllm_neuron/vllm/attention/attn.py, NeuronAttentionBackend (vllm-project/vllm-neuron main, "
                    "commit 3992707): get_name() \"CUSTOM\"; KV pages \"HND layout\"")
VLLM029_LAYOUT = ("vLLM 0.29 v1/attention/backends/utils.py resolve_kv_cache_layout (legacy HND is LBHNC) and "
                  "v1/worker/utils.py allocate_kv_cache (one backing allocation, [B, H, N, C] views per layer)")
VLLM029_NIXL_WORKER = ("vLLM 0.29 nixl/base_worker.py: get_nixl_memory_type() None and kv_buffer_device cuda -> "
                       "VRAM; one registration per allocation, device id max(cache.get_device(), 0)")
NIXL_LIBFABRIC = ("NIXL 1.5.1 wheel, libplugin_LIBFABRIC.so: \"Neuron runtime detected, adding VRAM support\" / \"No "
                  "accelerator runtime, skipping VRAM support\"; NIXL's sources from 0.10 to 1.0.1 offered DRAM "
                  "only on Neuron, fixed by \"libfabric: Fix Neuron mem type support regression\" (read in "
                  "yexiang-aws/nixl, a7283b8)")
EC2_SPECS = ("EC2 accelerated computing instance specifications (trn2.48xlarge: 16 Trainium2, 16 EFA; "
             "trn1.32xlarge: 16 Trainium, 8 EFA)")

#: vLLM's platform plugin entry point of vllm-neuron: VLLM_PLUGINS must name it or the Neuron platform never loads.
PLATFORM_PLUGIN = "neuron"
#: ``current_platform.device_type`` / ``device_name`` on a Neuron node (``cpu`` only in the plugin's CPU mode).
DEVICE_TYPE = "neuron"
#: The variable that confines an engine to its NeuronCores (``a-b`` range or comma list, host numbering).
VISIBLE_DEVICES = "NEURON_VISIBLE_DEVICES"
#: ``kv_buffer_device`` NIXL registers on Neuron: "cuda" there means device memory (get_nixl_supported_devices).
KV_BUFFER_DEVICE = "cuda"
#: NIXL memory type the KV cache is registered as on Neuron (device memory), and the device id on every rank.
NIXL_MEMORY_TYPE = "VRAM"
NIXL_DEVICE_ID = 0
#: vllm-neuron's attention backend name, and its KV page order (heads, tokens, K|V): vLLM 0.29 calls it LBHNC.
ATTENTION_BACKEND = "CUSTOM"
KV_LAYOUT = "LBHNC"
#: What a node needs for NIXL to register Neuron HBM, said when it refuses (connector/worker.py, turnkv doctor).
DEVICE_MEMORY_NEEDS = ("NIXL's LIBFABRIC plugin offers device memory (VRAM) only where its topology finds the Neuron "
                       "runtime next to the EFA devices: libnrt.so.1 loadable and the instance's Neuron devices "
                       "visible (the pinned NIXL's plugin does; NIXL's sources from 0.10 to 1.0.1 offered DRAM only "
                       "on Neuron)")
DEVICE_MEMORY_FIX = f"{DEVICE_MEMORY_NEEDS}. Run turnkv doctor --flavor neuron on the node (nixl-libfabric)"
#: NIXL backend for KV over EFA.
NIXL_BACKENDS = ("LIBFABRIC",)
#: Engines sharing a node must keep libfabric off its shared-memory transport, or answers can be wrong.
SHM_OFF = {"FI_EFA_ENABLE_SHM_TRANSFER": "0"}
#: A role-only server skips compiling the other phase's graphs (NEFFs): prefill skips decode's and vice versa.
SKIP_WARMUP = {"prefill": "VLLM_NEURON_SKIP_DECODE_WARMUP", "decode": "VLLM_NEURON_SKIP_PREFILL_WARMUP"}
#: The KV page the platform allocates when no --block-size is given; an operator's value is kept.
DEFAULT_BLOCK_SIZE = 32
#: Instance families whose Neuron devices the DI docs name.
DI_FAMILIES = ("trn2", "trn3")
#: The shared library NIXL's LIBFABRIC plugin dlopens although Neuron never calls it: a stub is enough.
CUDA_STUB = "libcuda.so.1"
#: The DLAMI's vLLM virtual environment is named after the plugin release it ships.
DLAMI_VLLM_VENV_PREFIX = "/opt/aws_neuronx_venv_pytorch_inference_vllm_"


def dlami_vllm_venv(plugin_version: str) -> str:
    """The DLAMI's venv for a vllm-neuron release (0.21.0.1.0.0 -> ..._vllm_0_21_0_1_0_0), per the setup guide."""
    return DLAMI_VLLM_VENV_PREFIX + plugin_version.replace(".", "_")


#: Transfer modes on Neuron as turnkv runs them: mode -> None (allowed) or why it is refused.
MODE_REFUSALS: dict[str, str | None] = {
    "pull": None,
    "push": ("the vllm-neuron DI docs run read mode only (write mode is described for upstream vLLM, never shown "
             "on Neuron device memory); use connector.mode: pull on Neuron"),
}
#: Why decode's host tier is off on the Neuron image: its vLLM (0.29) NIXL worker has no per-region KV layout.
HOST_TIER_NOTE = ("decode's host tier needs vLLM 0.32's NIXL worker; the Neuron image ships vLLM 0.29, so decode "
                  "retains on the device only (host_kv_budget_mib is ignored, logged at start)")
#: Why trn1 is refused (config and planner).
TRN1_REFUSAL = ("trn1.32xlarge has 16 Neuron devices but 8 EFA interfaces, while NIXL's Neuron path wants one "
                "interface per device, and the vllm-neuron DI docs name Trn2 and Trn3 only; use trn2.48xlarge")


@dataclass(frozen=True)
class Fact:
    what: str
    value: str
    source: str


FACTS: tuple[Fact, ...] = (
    Fact("platform plugin entry point", PLATFORM_PLUGIN, PLUGIN_PYPROJECT),
    Fact("VLLM_PLUGINS must name it", f"turnkv,turnkv-leases,{PLATFORM_PLUGIN}", VLLM_PLUGINS_LOADER),
    Fact("platform device type", DEVICE_TYPE, PLUGIN_PLATFORM),
    Fact("device control variable", f"{VISIBLE_DEVICES} (a-b or a,b,c)", f"{PLUGIN_PLATFORM}; {DI_TUTORIAL}"),
    Fact("NIXL kv_buffer_device", f"{KV_BUFFER_DEVICE} (device memory, registered as VRAM)",
         f"{PLUGIN_PLATFORM} get_nixl_supported_devices; {DI_DESIGN}, Configuration Reference"),
    Fact("NIXL backend", ",".join(NIXL_BACKENDS), f"{DI_DESIGN}; {DI_TUTORIAL}"),
    Fact("NIXL registration", f"{NIXL_MEMORY_TYPE}, device id {NIXL_DEVICE_ID} on every rank (a worker sees one "
                              "device), one region per KV allocation", f"{VLLM029_NIXL_WORKER}; {PLUGIN_PLATFORM} "
                                                                        "set_device_count"),
    Fact("LIBFABRIC and device memory", "VRAM offered only where NIXL's topology finds a Neuron (or CUDA) runtime; "
                                        "else registration fails (NIXL_ERR_BACKEND)", NIXL_LIBFABRIC),
    Fact("KV layout", f"attention backend {ATTENTION_BACKEND}; HND pages = {KV_LAYOUT} in vLLM 0.29: block b of layer "
                      "l at base_l + b * block_len", f"{PLUGIN_ATTENTION}; {VLLM029_LAYOUT}"),
    Fact("connector", "upstream NixlConnector (NeuronNixlConnector for DCP and sliding-window models)", DI_DESIGN),
    Fact("modes", "read (decode pulls) by default; bi-directional D->P for multi-turn; write described for "
                  "upstream only", DI_DESIGN),
    Fact("turnkv on Neuron", "pull + bi-directional behind connector.allow_unverified: [neuron]; push refused",
         "turnkv (this table's rows above)"),
    Fact("asymmetric TP", "supported (head_ratio at the handshake)", DI_DESIGN),
    Fact("default KV block size", f"{DEFAULT_BLOCK_SIZE} tokens; --block-size honoured", PLUGIN_PLATFORM),
    Fact("pinned host memory", "is_pin_memory_available() is False", PLUGIN_PLATFORM),
    Fact("engines sharing a node", "FI_EFA_ENABLE_SHM_TRANSFER=0, else inaccurate output", DI_TUTORIAL),
    Fact("role warmup", "VLLM_NEURON_SKIP_PREFILL_WARMUP=1 on decode, VLLM_NEURON_SKIP_DECODE_WARMUP=1 on prefill",
         DI_DESIGN),
    Fact("side-channel ports", "VLLM_NIXL_SIDE_CHANNEL_PORT per server; open API, side-channel and all-traffic "
                               "self-referencing EFA rules", DI_TUTORIAL),
    Fact("libraries LIBFABRIC needs", f"{CUDA_STUB} (a stub is enough) and libfabric.so.1", SETUP_GUIDE),
    Fact("instance types", "Trn2 and Trn3 (trn2.48xlarge: 64 logical NeuronCores at LNC=2, 16 EFA)",
         f"{DI_TUTORIAL}, Prerequisites; {EC2_SPECS}"),
    Fact("trn1", TRN1_REFUSAL, f"{DI_TUTORIAL}; {EC2_SPECS}"),
    Fact("DLAMI parent", "SSM .../multi-framework/ubuntu-24.04/latest/image_id floats; the bake checks the DLAMI's "
                         f"vLLM venv ({DLAMI_VLLM_VENV_PREFIX}<plugin version>) names the pinned plugin",
         f"{DLAMI_GUIDE}; {SETUP_GUIDE}, Option B"),
    Fact("host tier on the Neuron image", HOST_TIER_NOTE, "turnkv connector/worker.py"),
)


def markdown_table() -> str:
    """docs/trainium.md's fact table (a test compares it with the page)."""
    rows = ["| fact | value | source |", "|---|---|---|"]
    rows += [f"| {f.what} | {f.value} | {f.source} |" for f in FACTS]
    return "\n".join(rows) + "\n"
