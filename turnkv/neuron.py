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
REFERENCE_CONFIG = ("Neuron SDK docs, vllm-neuron/docs/guides/reference-configuration.md (aws-neuron/aws-neuron-sdk "
                    "81ce03a), neuron_config compilation options")
LLAMA70B_TUTORIAL = ("Neuron SDK docs, vllm-neuron/docs/tutorials/tutorial-llama3-70b.md (aws-neuron/aws-neuron-sdk "
                     "81ce03a, updated 2026-08-17)")
PREFIX_CACHING_DESIGN = ("Neuron SDK docs, vllm-neuron/docs/design/vllm/prefix-caching.md (aws-neuron/aws-neuron-sdk "
                         "81ce03a), kv_segment_size_buckets Configuration")
SETUP_ENV = ("Neuron SDK docs, vllm-neuron/docs/getting-started/setup-guide.md, 'Configure environment variables' "
             "(updated 2026-07-23)")
LNC_DOC = ("Neuron SDK docs, about-neuron/arch/neuron-features/logical-neuroncore-config.rst (Trn2: 8 physical "
           "NeuronCores a chip, 4 logical at LNC=2, the default)")
NIXL_NEURON_RAILS = ("NIXL sources (ai-dynamo/nixl 8770b65): src/plugins/libfabric/libfabric_backend.cpp registerMem "
                     "queries the EFA PCI bus id from the registered address (nrtQueryAddr) on Neuron; "
                     "src/utils/libfabric/libfabric_topology.cpp maps it to that EFA device (all rails if not found); "
                     "src/utils/libfabric/libfabric_rail.cpp sets device.neuron = -1 (the EFA provider ignores the id)")
KV_MEMORY_DESIGN = ("Neuron SDK docs, vllm-neuron/docs/design/vllm/determine_available_memory_design.md "
                    "(aws-neuron/aws-neuron-sdk 81ce03a): VLLM_NEURON_KV_GMU_BUDGET_CAP_FRACTION = 0.30")
CPU_COMPILE_DESIGN = ("Neuron SDK docs, vllm-neuron/docs/design/compilation/cpu_compilation.md and "
                      "guides/reference-configuration.md (VLLM_NEURON_CPU_COMPILE, NEURON_PLATFORM_TARGET_OVERRIDE)")
DLAMI_SSM_PATHS = ("Neuron SDK docs, deploy/environments/dlami.rst (aws-neuron/aws-neuron-sdk 81ce03a), 'SSM Parameter "
                   "Prefix': /aws/service/neuron/dlami/<framework>-<framework-version>/<os>, e.g. "
                   "pytorch-inference-vllm-0.24.0.1.1.0/ubuntu-24.04")
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
#: vllm-neuron's D->P switch for multi-turn (bi-directional KV transfer): its DI design doc's environment table.
BIDIRECTIONAL_ENV = "VLLM_NEURON_BIDIRECTIONAL_KV"
#: Segment sizes the segmented-prefill kernel compiles (``kv_segment_size_buckets``): one size, from this set,
#: divisible by the block size; ``num_batched_tokens_buckets`` must equal it and its last entry must equal
#: ``--max-num-batched-tokens``. Prefix caching starts only with segmented prefill (the Llama-3.3-70B tutorial).
SEGMENT_SIZES = (512, 1024, 2048, 4096, 8192)
#: The decode batch bucket the Llama-3.3-70B tutorial starts at (``--max-num-seqs`` 8, ``num_seqs_buckets`` [8]).
DEFAULT_MAX_NUM_SEQS = 8
#: Compilation and start-up budgets, as the DI tutorial sets them for a large model (seconds): vLLM's defaults are
#: shorter than a first compile. The engine's systemd unit and the group's grace period must outlast the sum.
TIMEOUTS = {"VLLM_NEURON_COMPILATION_TIMEOUT": "2400", "VLLM_ENGINE_READY_TIMEOUT_S": "1800",
            "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "1200"}
#: Where compiled NEFFs are cached and reused on restart (setup guide's VLLM_CACHE_ROOT). On a node: on the root
#: volume, so a cache compiled into the image would ship with the AMI (no bake step fills it yet: docs/trainium.md).
CACHE_ROOT_ENV = "VLLM_CACHE_ROOT"
CACHE_ROOT = "/opt/turnkv/neuron-cache"
#: Logical NeuronCores a Trainium2 chip has at LNC=2 (each chip is one device with its own EFA interface).
CORES_PER_CHIP = {"trn2": 4}
#: vllm-neuron's cap on the KV cache's share of device memory (its memory design doc), default and variable.
KV_CAP_ENV = "VLLM_NEURON_KV_GMU_BUDGET_CAP_FRACTION"
KV_CAP_FRACTION = 0.30
#: The version-specific DLAMI the pinned plugin ships in (SSM path structure of the DLAMI guide).
DLAMI_SSM_PREFIX = "/aws/service/neuron/dlami/pytorch-inference-vllm-"


def dlami_parent_parameter(plugin_version: str, os: str = "ubuntu-24.04") -> str:
    """The SSM parameter of the single-framework vLLM DLAMI for one plugin release: the image id moves only within
    that release (patches), never to another Neuron SDK, unlike the multi-framework DLAMI's ``latest``."""
    return f"{DLAMI_SSM_PREFIX}{plugin_version}/{os}/latest/image_id"


def segment_size(max_model_len: int, block_size: int) -> int:
    """The one segment (and prefill bucket) size: the largest of :data:`SEGMENT_SIZES` not above ``max_model_len`` and
    divisible by ``block_size``; the smallest allowed one when the model length is shorter."""
    fits = [s for s in SEGMENT_SIZES if s % block_size == 0]
    if not fits:
        raise ValueError(f"block size {block_size} divides none of the segment sizes {SEGMENT_SIZES}; use 32, 64 or "
                         "128")
    below = [s for s in fits if s <= max_model_len]
    return max(below) if below else min(fits)


def neuron_config(max_model_len: int, block_size: int, max_num_seqs: int) -> dict[str, list[int]]:
    """``--additional-config``'s ``neuron_config`` for prefix caching and pulled KV: segmented prefill of one segment
    size, the prefill bucket equal to it, one decode batch bucket equal to ``max_num_seqs``."""
    size = segment_size(max_model_len, block_size)
    return {"kv_segment_size_buckets": [size], "num_batched_tokens_buckets": [size], "num_seqs_buckets": [max_num_seqs]}


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
TRN1_REFUSAL = ("the vllm-neuron plugin's disaggregated inference runs on Trn2 and Trn3 only (its DI tutorial's "
                "prerequisites); use trn2.48xlarge")

#: Where a fact was checked: on this project's machines against the real artifact, against a stand-in of it, or
#: nowhere yet (read from the source only).
HERE = "here"
STAND_IN = "stand-in"
NOWHERE = "nowhere"


@dataclass(frozen=True)
class Fact:
    what: str
    value: str
    source: str
    #: :data:`HERE`, :data:`STAND_IN` or :data:`NOWHERE`, with what checks it.
    checked: str = NOWHERE


_SUITE = "tests/unit/test_neuron_nixl.py"
FACTS: tuple[Fact, ...] = (
    Fact("platform plugin entry point", PLATFORM_PLUGIN, PLUGIN_PYPROJECT, f"{STAND_IN} (tests/unit/test_neuron.py)"),
    Fact("VLLM_PLUGINS must name it", f"turnkv,turnkv-leases,{PLATFORM_PLUGIN}", VLLM_PLUGINS_LOADER,
         f"{HERE} (vLLM 0.29 and 0.32 loaders, tests/unit/test_neuron.py)"),
    Fact("platform device type", DEVICE_TYPE, PLUGIN_PLATFORM, f"{STAND_IN} (tests/unit/neuron_standin.py)"),
    Fact("device control variable", f"{VISIBLE_DEVICES} (a-b or a,b,c)", f"{PLUGIN_PLATFORM}; {DI_TUTORIAL}",
         f"{HERE} (argv/env: tests/infra/test_trainium.py)"),
    Fact("NIXL kv_buffer_device", f"{KV_BUFFER_DEVICE} (device memory, registered as VRAM)",
         f"{PLUGIN_PLATFORM} get_nixl_supported_devices; {DI_DESIGN}, Configuration Reference",
         f"{STAND_IN} ({_SUITE})"),
    Fact("NIXL backend", ",".join(NIXL_BACKENDS), f"{DI_DESIGN}; {DI_TUTORIAL}", f"{STAND_IN} ({_SUITE})"),
    Fact("NIXL registration", f"{NIXL_MEMORY_TYPE}, device id {NIXL_DEVICE_ID} on every rank (a worker sees one "
                              "device), one region per KV allocation", f"{VLLM029_NIXL_WORKER}; {PLUGIN_PLATFORM} "
                                                                        "set_device_count", f"{STAND_IN} ({_SUITE})"),
    Fact("per-rank EFA interface", "chosen by NIXL from the registered address (the EFA attached to the chip whose "
                                   "HBM it is), not from the device id, which the EFA provider ignores: device id 0 "
                                   "on every rank is harmless; an engine's ranks use its own chips' interfaces as "
                                   "long as engines do not share a chip (whole chips per engine, below)",
         NIXL_NEURON_RAILS, NOWHERE),
    Fact("engines on whole chips", f"{CORES_PER_CHIP['trn2']} logical NeuronCores a trn2 chip: at a "
                                   "tensor_parallel_size that is a multiple of 4 every engine's NEURON_VISIBLE_DEVICES "
                                   "range starts on a chip boundary, so it reads through its own chips' interfaces "
                                   "(a smaller TP shares a chip's interface between engines)", LNC_DOC,
         f"{HERE} (slot ranges: tests/unit/test_neuron.py)"),
    Fact("LIBFABRIC and device memory", "VRAM offered only where NIXL's topology finds a Neuron (or CUDA) runtime; "
                                        "else registration fails (NIXL_ERR_BACKEND)", NIXL_LIBFABRIC,
         f"{STAND_IN} ({_SUITE})"),
    Fact("KV layout", f"attention backend {ATTENTION_BACKEND}; HND pages = {KV_LAYOUT} in vLLM 0.29: block b of layer "
                      "l at base_l + b * block_len", f"{PLUGIN_ATTENTION}; {VLLM029_LAYOUT}", f"{STAND_IN} ({_SUITE})"),
    Fact("connector", "upstream NixlConnector (NeuronNixlConnector for DCP and sliding-window models)", DI_DESIGN,
         f"{STAND_IN} ({_SUITE}: turnkv's subclass of vLLM 0.29's)"),
    Fact("modes", "read (decode pulls) by default; bi-directional D->P for multi-turn; write described for "
                  "upstream only", DI_DESIGN, NOWHERE),
    Fact("D->P switch", f"{BIDIRECTIONAL_ENV}=1 on both roles when connector.bidirectional (default 0)",
         f"{DI_DESIGN}, Bi-directional KV Transfer and Environment Variables",
         f"{HERE} (argv/env: tests/unit/test_neuron.py); what the plugin does with it: {NOWHERE}"),
    Fact("turnkv on Neuron", "pull + bi-directional behind connector.allow_unverified: [neuron]; push refused",
         "turnkv (this table's rows above)", f"{HERE} (tests/infra/test_config.py)"),
    Fact("asymmetric TP", "supported (head_ratio at the handshake)", DI_DESIGN, NOWHERE),
    Fact("segmented prefill", "prefix caching starts only with it; one kv_segment_size_buckets size from "
                              f"{SEGMENT_SIZES}, divisible by --block-size, equal to num_batched_tokens_buckets and "
                              "--max-num-batched-tokens (turnkv: the largest not above max_model_len, 8192 at 32k)",
         f"{LLAMA70B_TUTORIAL}; {REFERENCE_CONFIG}; {PREFIX_CACHING_DESIGN}",
         f"{HERE} (argv: tests/unit/test_neuron.py); the kernel attending to pulled KV: {NOWHERE}"),
    Fact("decode batch bucket", f"num_seqs_buckets [max_num_seqs], --max-num-seqs equal (default "
                                f"{DEFAULT_MAX_NUM_SEQS}, the tutorial's start)", LLAMA70B_TUTORIAL,
         f"{HERE} (argv: tests/unit/test_neuron.py)"),
    Fact("default KV block size", f"{DEFAULT_BLOCK_SIZE} tokens; --block-size honoured (turnkv passes 128, the "
                                  "tutorial's validated size)", f"{PLUGIN_PLATFORM}; {LLAMA70B_TUTORIAL}",
         f"{STAND_IN} ({_SUITE})"),
    Fact("pinned host memory", "is_pin_memory_available() is False", PLUGIN_PLATFORM, f"{STAND_IN} ({_SUITE})"),
    Fact("engines sharing a node", "FI_EFA_ENABLE_SHM_TRANSFER=0, else inaccurate output", DI_TUTORIAL,
         f"{HERE} (env: tests/unit/test_neuron.py)"),
    Fact("role warmup", "VLLM_NEURON_SKIP_DECODE_WARMUP=1 on prefill; decode does not skip prefill's (turnkv: "
                        "kv_load_failure_policy recompute prefills a failed READ on decode)", DI_DESIGN,
         f"{HERE} (env: tests/unit/test_neuron.py)"),
    Fact("compile and start budgets", ", ".join(f"{k}={v}" for k, v in TIMEOUTS.items()) +
         " (vLLM's defaults are shorter than a first compile: 15-20 min for a 70B model)",
         f"{DI_TUTORIAL}, Prepare your environment; {LLAMA70B_TUTORIAL}", f"{HERE} (env: tests/unit/test_neuron.py)"),
    Fact("compile cache", f"{CACHE_ROOT_ENV}={CACHE_ROOT}: NEFFs reused on restart; compiled off-device with "
                          "VLLM_NEURON_CPU_COMPILE=1 and NEURON_PLATFORM_TARGET_OVERRIDE=trn2",
         f"{SETUP_ENV}; {CPU_COMPILE_DESIGN}", f"{HERE} (env); a compile: {NOWHERE}"),
    Fact("compile once, serve from the cache", "compile on a CPU instance with VLLM_NEURON_CPU_COMPILE=1, "
                                               "NEURON_PLATFORM_TARGET_OVERRIDE=trn2 and NEURON_LIBTORCH_REMOTE_CACHE "
                                               "on a shared filesystem; sync it to the nodes' cache; "
                                               "NEURON_LIBTORCH_DISABLE_GRAPH_CAPTURE_BACKEND=1 and "
                                               "VLLM_NEURON_DISABLE_WARMUP_COMPILE=1 make a cache miss fatal at start "
                                               "(turnkv does none of this yet)",
         "Neuron SDK docs, vllm-neuron/docs/design/compilation/cpu_compilation.md (aws-neuron/aws-neuron-sdk "
         "81ce03a), Using Remote Cache for Production Deployments", NOWHERE),
    Fact("KV memory cap", f"{KV_CAP_ENV} (default {KV_CAP_FRACTION}) of the device budget after weights goes to KV",
         KV_MEMORY_DESIGN, f"{HERE} (planner: tests/unit/test_plan_neuron.py)"),
    Fact("side-channel ports", "VLLM_NIXL_SIDE_CHANNEL_PORT per server; open API, side-channel and all-traffic "
                               "self-referencing EFA rules", DI_TUTORIAL,
         f"{HERE} (synth: tests/infra/test_trainium.py)"),
    Fact("libraries LIBFABRIC needs", f"{CUDA_STUB} (a stub is enough) and libfabric.so.1; libcudart.so.13 is used "
                                      "by the GPUDirect path only", SETUP_GUIDE,
         f"{HERE} (bake into a fake root: tests/ami/test_bake.py); on a DLAMI: {NOWHERE}"),
    Fact("instance types", "Trn2 and Trn3 (trn2.48xlarge: 64 logical NeuronCores at LNC=2, 16 EFA)",
         f"{DI_TUTORIAL}, Prerequisites; {EC2_SPECS}; {LNC_DOC}", f"{HERE} (infra/instances.py)"),
    Fact("trn1", TRN1_REFUSAL, f"{DI_TUTORIAL}, Prerequisites", f"{HERE} (tests/infra/test_config.py)"),
    Fact("DLAMI parent", f"SSM {dlami_parent_parameter('<plugin version>')}: the single-framework vLLM DLAMI of the "
                         f"pinned plugin, whose venv ({DLAMI_VLLM_VENV_PREFIX}<plugin version>) carries the compiler, "
                         "torch-neuronx, nki and the plugin; the bake extends it",
         f"{DLAMI_SSM_PATHS}; {SETUP_GUIDE}, Options A and B", f"{HERE} (synth, fake-root bake); on AWS: {NOWHERE}"),
    Fact("host tier on the Neuron image", HOST_TIER_NOTE, "turnkv connector/worker.py", f"{STAND_IN} ({_SUITE})"),
)


def setting_sources() -> dict[str, str]:
    """Each setting a Neuron engine gets from turnkv (flag or variable) -> the upstream source it follows: what
    ``turnkv engine run --dry-run`` prints beside the argv and environment."""
    sources = {
        "--additional-config (kv_segment_size_buckets, num_batched_tokens_buckets, num_seqs_buckets)":
            f"{LLAMA70B_TUTORIAL}; {REFERENCE_CONFIG}",
        "--max-num-batched-tokens, --max-num-seqs": LLAMA70B_TUTORIAL,
        "--kv-transfer-config kv_buffer_device cuda, backends LIBFABRIC": f"{DI_DESIGN}, Configuration Reference",
        "VLLM_PLUGINS ...,neuron": VLLM_PLUGINS_LOADER,
        VISIBLE_DEVICES: DI_TUTORIAL,
        "FI_EFA_ENABLE_SHM_TRANSFER": DI_TUTORIAL,
        BIDIRECTIONAL_ENV: f"{DI_DESIGN}, Bi-directional KV Transfer",
        SKIP_WARMUP["prefill"]: f"{DI_DESIGN}, Role-Specific Warmup (decode keeps prefill's graphs: turnkv)",
        ", ".join(TIMEOUTS): f"{DI_TUTORIAL}, Prepare your environment",
        CACHE_ROOT_ENV: SETUP_ENV,
    }
    return sources


def markdown_table() -> str:
    """docs/trainium.md's fact table (a test compares it with the page)."""
    rows = ["| fact | value | source | checked |", "|---|---|---|---|"]
    rows += [f"| {f.what} | {f.value} | {f.source} | {f.checked} |" for f in FACTS]
    return "\n".join(rows) + "\n"
