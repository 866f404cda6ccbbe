"""The one table of hardware constants, each with its public source.

Peak FLOPs are dense (no sparsity). "Achieved" factors say what fraction of a peak real serving
software reaches. ``INSTANCES`` holds priors, each from the published figure named next to it; ``load``
replaces the GPU ones the published TTFT measurements determine (dense and MoE factors, the per-hop and
per-pull fixed costs) with the fit of turnkv/plan/data/gpu_measurements.json (turnkv.plan.gpu_calibration).
``local-cpu`` starts from the CPU's nominal peak; ``turnkv plan calibrate`` replaces its achieved factors
with ones measured on the local engines (stored in the state folder, read by ``load``).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from turnkv import neuron

GB = 1e9
GIB = 1024**3

#: EFA message-size efficiency: fi_rdm_tagged_bw on EFA (100 Gbps, c5n.18xlarge), MB/s by message
#: size, from ofiwg/libfabric issue #5694 (2020), over the 12,500 MB/s line rate. KV blocks move as one
#: RDMA message per block, layer and K/V region, so small blocks reach only a fraction of the line rate.
EFA_MESSAGE_EFFICIENCY: tuple[tuple[int, float], ...] = (
    (64, 42.74 / 12500), (256, 161.42 / 12500), (1024, 596.41 / 12500), (4096, 2305.92 / 12500),
    (65536, 6189.06 / 12500), (1048576, 6892.86 / 12500),
)


@dataclass(frozen=True)
class PullComponent:
    """One named part of a pull's fixed cost, its value on this stack and where the value comes from."""

    name: str
    seconds: float
    source: str
    #: False for a part the planner states but does not add per turn (counted elsewhere, or paid once).
    per_turn: bool = True


#: GPU (H100/H200 + EFA, vLLM + NIXL): each part from a published measurement, none fitted to turnkv's seeds.
GPU_PULL = (
    PullComponent("router_lookup", 0.001, "the router's store read of the stored reuse params and its clearance "
                  "MAC: one in-VPC Redis round trip, 'sub-millisecond' (Amazon ElastiCache docs); 1 ms"),
    PullComponent("step_alignment", 0.110, "engine-step boundaries around a NIXL KV handover: vLLM PR #51919 "
                  "(RFC #50913) measures a P/D handover at ~197 ms p50 on GPUs (block size 64), of which the KV "
                  "transfer is ~29 ms and the first-token recompute ~58 ms; the other ~110 ms is waiting for "
                  "engine-step boundaries and serial dispatch. A pulled turn waits the same way on prefill "
                  "(WAITING_FOR_REMOTE_KVS: the READ starts after a scheduler step, its end is seen at a later one)"),
    PullComponent("nixl_post", 0.0067, "the READ's post: 'avg post duration 6.7 ms' (vLLM RFC #50913); counted in "
                  "the transfer's set-up (transfer_setup_s), not again here", per_turn=False),
    PullComponent("handshake", 2.0, "NIXL agent handshake, once per engine pair ('the nixl handshake takes ~2s', "
                  "neuralmagic/vllm#63): paid once, not per turn", per_turn=False),
)
#: The local stack (2 CPU cores, UCX over loopback): measured by `python -m bench.pull_cost` (issue #36,
#: docs/connector.md "Fixed cost of a pull"), its quieter run: medians of 6 later pulls against the same turns
#: recomputed, each part from the router's and engines' /metrics around one request at a time.
_PULL_COST = "measured: bench.pull_cost (issue #36, docs/connector.md 'Fixed cost of a pull', the 'before' run)"
LOCAL_PULL = (
    PullComponent("router_lookup", 0.0020, f"{_PULL_COST}: router +2.0 ms over a recompute turn (store take, offer "
                  "clearance HMAC, evictions-feed check)"),
    PullComponent("prefill_http", 0.0022, f"{_PULL_COST}: prefill's HTTP/template/tokenization +2.2 ms"),
    PullComponent("step_alignment", 0.0038, f"{_PULL_COST}: admission and polling 3.8 ms (the steps prefill polls "
                  "the READ with, 1 ms apart, and the step that picks the request up)"),
    PullComponent("nixl_post", 0.002, "the transfer set-up `turnkv plan calibrate` fits (transfer_setup_s): "
                  "counted in the transfer", per_turn=False),
    PullComponent("handshake", 0.0092, f"{_PULL_COST}: the first pull from a decode engine, once per engine pair",
                  per_turn=False),
)


def pull_fixed_s(components: tuple[PullComponent, ...]) -> float:
    """Seconds a pull adds per turn beyond its transfer: the per-turn components' sum."""
    return sum(c.seconds for c in components if c.per_turn)


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of peak for one software stack on one accelerator family."""

    #: Dense transformer prefill (GEMMs + flash attention) at tensor parallelism: FlashAttention-3
    #: reaches 75% of H100 BF16 peak in the forward pass and cuBLAS GEMMs about 70% (Shah et al. 2024,
    #: arXiv:2407.08608, fig. 5 and sec. 4.1); sharded GEMMs at TP 8 lose some more: 0.60.
    dense: float = 0.60
    #: MoE prefill: vLLM's wide-EP DeepSeek-R1 reaches 26.2k prefill tokens per GPU-second on GB200,
    #: "a 3-5x improvement over H200" (blog.vllm.ai 2026-02-03): about 6.5k tok/s/GPU on H200 at 2k
    #: input, 2 x 37e9 FLOPs per token over 1,979 TFLOPS FP8 = 0.26.
    moe: float = 0.26
    #: DeepSeek sparse attention (indexer + sparse MLA kernels) on top of MoE: DeepSeek-V3.2 prefills at
    #: 7,360 tok/s/GPU against DeepSeek-R1's 22,476 on the same GB300 with vLLM 0.14.1
    #: (blog.vllm.ai 2026-02-13): 0.33 of the MoE figure.
    sparse_attention: float = 7360 / 22476
    #: Attention's own achieved fraction of peak when it differs from the GEMMs' (None: the same factor);
    #: calibration fits it separately on CPUs, where attention kernels run far from GEMM speed.
    attention: float | None = None
    #: Attention of a chunk's queries over keys already in the KV cache (a pulled or prefix-cached history,
    #: or the earlier chunks of a long prompt) when its kernel's efficiency differs (None: as ``attention``).
    #: On GPUs one FlashAttention varlen kernel does both; vLLM's CPU backend runs plain prefills through
    #: SDPA and context through its paged kernel, so calibration fits it apart.
    context_attention: float | None = None
    #: Cost of each prefill chunk after the first (a scheduler step and its batch set-up); the first is in
    #: ``request_overhead_s``. Calibrated on CPUs; on GPUs a few hundred microseconds, left at 0.
    step_overhead_s: float = 0.0
    #: Intra-node all-reduce bus bandwidth over NVLink 4 (bytes/s per GPU): about 380 GB/s of 450 GB/s
    #: unidirectional measured on HGX H100 (NVIDIA/nccl issue #1264): 360e9 for all-reduce.
    allreduce_bus_bytes_s: float = 360e9
    #: Fixed cost of one engine hop (HTTP, tokenization, scheduling): vLLM's multi-turn benchmark README
    #: reports TTFT p50 62 ms for Llama-3.1-8B on one GPU with 1.5-6k token prompts, of which about 45 ms
    #: is prefill compute at the dense factor above: about 15 ms per hop. A prior: GPU instances get the value fitted
    #: to the published TTFT measurements (turnkv.plan.gpu_calibration), as for ``moe`` (and ``dense`` when the
    #: measurements determine it).
    request_overhead_s: float = 0.015
    #: Decode steps reach this fraction of HBM bandwidth: Llama-3.3-70B at TP 8 on p5en decodes at 21.9 ms
    #: per token in vLLM's bi-directional PR benchmark (vllm-project/vllm#32553) where reading the BF16
    #: weights once takes 141 GB / 8 / 4.8 TB/s = 3.7 ms: 0.17 (launches, all-reduces, sampling).
    decode_bandwidth: float = 0.17
    #: Fixed cost of a reuse-on turn's pull on the critical path beyond the transfer's set-up and bytes: the sum of
    #: the named components in ``pull_components`` (turnkv.plan.hardware.PullComponent), never fitted to TTFTs.
    pull_components: tuple[PullComponent, ...] = GPU_PULL
    #: Engine-step alignment around the P->D handover every P/D turn pays (both arms): the same ~110 ms of
    #: step-boundary waits and dispatch that vLLM PR #51919 measures around a GPU handover (GPU_PULL's
    #: ``step_alignment``). 0 on the local stack, where `turnkv plan calibrate`'s hop includes it.
    pd_handover_s: float = 0.110
    #: Per-transfer set-up: "avg post duration 6.7 ms" of NIXL transfers in vLLM's P/D RFC #50913.
    transfer_setup_s: float = 0.0067
    #: KV bytes moved per second per rank as a fraction of the rank's link rate, by message size (a
    #: table as EFA_MESSAGE_EFFICIENCY); None uses the EFA table.
    transfer_efficiency: tuple[tuple[int, float], ...] | None = None
    #: Relative uncertainty (±) stated on every TTFT the planner prints for this stack, from its calibration's
    #: errors; None where nothing was calibrated. ``ttft_band_source`` says how it was derived.
    ttft_band: float | None = None
    ttft_band_source: str = "none: uncalibrated priors (`turnkv plan calibrate` measures local-cpu's and its band)"
    #: Where these values came from (shown by ``turnkv plan --json``).
    source: str = "published measurements (see turnkv/plan/hardware.py)"

    @property
    def pull_overhead_s(self) -> float:
        return pull_fixed_s(self.pull_components)


@dataclass(frozen=True)
class Instance:
    name: str
    accelerator: str
    devices: int
    #: Dense peak FLOP/s per device by GEMM precision.
    peak_flops: dict[str, float]
    hbm_bytes: float  # per device
    hbm_bytes_s: float  # per device
    #: Network between nodes (EFA), bits/s for the whole instance.
    network_bits_s: float
    price_per_hour: float  # on-demand, USD, us-east-1 Linux
    sources: dict[str, str] = field(default_factory=dict)
    efficiency: Efficiency = field(default_factory=Efficiency)
    #: Fraction of HBM the engine gives its KV cache (vLLM --gpu-memory-utilization 0.9, minus weights).
    memory_utilization: float = 0.9
    #: Tokens one engine step prefills (vLLM's ``max_num_batched_tokens``): a longer prompt is prefilled
    #: in chunks, each attending over the ones before. vLLM's API-server default (engine/arg_utils.py,
    #: get_batch_defaults): 8,192 on GPUs of 70-160 GB (H100, H200), 2,048 on CPUs.
    prefill_chunk_tokens: int = 8192
    #: Whether turnkv's stack deploys it today (infra/config.py refuses Neuron instance types: no NIXL and no
    #: vLLM the connector supports there yet); the plan still runs for it, flagged. ``deployable_note`` says why.
    deployable: bool = True
    deployable_note: str = ""
    #: Host memory of one instance (GiB): what decode's host tier and a prefill offload tier draw on.
    host_memory_gib: float = 2048.0
    #: Host memory <-> device, bytes/s per device: what a prefill offload tier loads at (PCIe Gen5 x16: 64 GB/s
    #: per direction, PCI-SIG; about 80% of it achieved) and what a NIC reading decode's host tier is capped by.
    host_link_bytes_s: float = 0.8 * 64e9
    #: KV block sizes the attention backend takes are multiples of this (vLLM 0.29: FlashAttention
    #: ``MultipleOf(16)``, the CPU backend ``MultipleOf(32)``; get_supported_kernel_block_sizes).
    kv_block_multiple: int = 16
    #: Share of an engine's memory budget its KV cache may take beyond "what the weights leave": vllm-neuron caps it
    #: at VLLM_NEURON_KV_GMU_BUDGET_CAP_FRACTION (0.30) of the budget (turnkv.neuron.KV_CAP_FRACTION). None: no cap.
    kv_cap_fraction: float | None = None
    #: Tensor-parallel ranks per device in the deployment's unit: trn2 counts TP in logical NeuronCores (4 a chip at
    #: LNC=2, as deploy configs and vLLM's --tensor-parallel-size do) while ``devices`` counts chips. 1 on GPUs.
    ranks_per_device: int = 1
    #: Whether the node image runs decode's host tier and vLLM's prefill offload tier (the Neuron image's vLLM 0.29
    #: runs neither: turnkv.neuron.HOST_TIER_NOTE, engine_args.OFFLOAD_PLATFORMS).
    host_tiers: bool = True

    def peak(self, dtype: str) -> float:
        key = {"bfloat16": "bf16", "float16": "bf16", "float32": "fp32", "fp8": "fp8"}.get(dtype, dtype)
        return self.peak_flops.get(key) or self.peak_flops["bf16"]

    def rank_link_bytes_s(self) -> float:
        """Line rate one rank's transfers get: its device's share of the instance's interfaces."""
        return self.network_bits_s / 8 / self.devices

    def host_read_bytes_s(self) -> float:
        """Rate one rank reads a peer's host-tier KV at: its link share, capped by the host link."""
        return min(self.rank_link_bytes_s(), self.host_link_bytes_s)

    def kv_cache_bytes(self, tp: int, weight_bytes: float) -> float:
        """KV cache capacity of one engine of ``tp`` devices after the weights (at most the KV cap's share of the
        budget, where the platform caps it)."""
        budget = tp * self.hbm_bytes * self.memory_utilization
        left = max(0.0, budget - weight_bytes)
        return left if self.kv_cap_fraction is None else min(left, self.kv_cap_fraction * budget)


H100_SRC = "NVIDIA H100 Tensor Core GPU datasheet (SXM: 989 TFLOPS BF16, 1,979 TFLOPS FP8 dense, 80 GB, 3.35 TB/s)"
H200_SRC = "NVIDIA H200 Tensor Core GPU datasheet (SXM: 989 TFLOPS BF16, 1,979 TFLOPS FP8 dense, 141 GB, 4.8 TB/s)"
TRN2_SRC_URL = "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/about-neuron/arch/neuron-hardware/trainium2.html"
TRN2_SRC = (f"AWS Neuron docs, Trainium2 Architecture ({TRN2_SRC_URL}): per chip 667 BF16 / 1,299 FP8 / 181 FP32 "
            "dense TFLOPS, 96 GiB HBM at 2.9 TB/s; 16 chips per trn2.48xlarge")
PRICE_SRC = ("aws.amazon.com/ec2/pricing/on-demand (us-east-1, Linux; P5 prices after AWS's June 2025 cut); "
             "prices change: pass --price to override")

TRN2_UNVERIFIED = ("unverified: deployable only behind connector.allow_unverified: [neuron]: turnkv's connector "
                   "has not read KV on a Trn2 node yet (docs/trainium.md); its compute is priced from published "
                   "Neuron TTFT (NxD Inference behind vLLM, colocated), not from a P/D run")
TRN1_NOT_DEPLOYABLE = f"not deployable: {neuron.TRN1_REFUSAL}"

INSTANCES: dict[str, Instance] = {
    "p5en.48xlarge": Instance(
        "p5en.48xlarge", "8 x NVIDIA H200", 8, {"bf16": 989e12, "fp8": 1979e12, "fp32": 67e12}, 141 * GB, 4.8e12,
        3200e9, 63.296,
        {"accelerator": H200_SRC, "network": "aws.amazon.com/ec2/instance-types/p5: p5en 3,200 Gbps EFAv3, "
         "16 EFA interfaces (2 per GPU)", "price": PRICE_SRC}),
    "p5e.48xlarge": Instance(
        "p5e.48xlarge", "8 x NVIDIA H200", 8, {"bf16": 989e12, "fp8": 1979e12, "fp32": 67e12}, 141 * GB, 4.8e12,
        3200e9, 63.296,
        {"accelerator": H200_SRC, "network": "aws.amazon.com/ec2/instance-types/p5: p5e 3,200 Gbps EFA, "
         "32 EFA interfaces (infra/instances.py)", "price": "no on-demand price listed for p5e (capacity blocks): "
         "p5en's as a stand-in; pass --price"}),
    "p5.48xlarge": Instance(
        "p5.48xlarge", "8 x NVIDIA H100", 8, {"bf16": 989e12, "fp8": 1979e12, "fp32": 67e12}, 80 * GB, 3.35e12,
        3200e9, 55.04,
        {"accelerator": H100_SRC, "network": "aws.amazon.com/ec2/instance-types/p5: 3,200 Gbps EFAv2, "
         "32 EFA interfaces (4 per GPU)", "price": PRICE_SRC}),
    "trn2.48xlarge": Instance(
        "trn2.48xlarge", "16 x AWS Trainium2", 16, {"bf16": 667e12, "fp8": 1299e12, "fp32": 181e12},
        96 * GIB, 2.9e12, 3200e9, 44.70,
        {"accelerator": TRN2_SRC, "network": "3.2 Tbps EFAv3, 16 interfaces", "price": PRICE_SRC,
         "interconnect": f"NeuronLink-v3 1.28 TB/s per chip ({TRN2_SRC_URL}); all-reduces at 0.8 of it, the "
                         "fraction NCCL reaches of NVLink (the GPU prior's 360 of 450 GB/s)",
         "efficiency": "prefill factor and decode bandwidth fitted to published Neuron TTFT/TPOT "
                       "(turnkv/plan/data/neuron_measurements.json, turnkv.plan.neuron_calibration)"},
        Efficiency(allreduce_bus_bytes_s=0.8 * 1.28e12),
        deployable=True, deployable_note=TRN2_UNVERIFIED, kv_cap_fraction=neuron.KV_CAP_FRACTION,
        ranks_per_device=neuron.CORES_PER_CHIP["trn2"], host_tiers=False),
    "trn1.32xlarge": Instance(
        "trn1.32xlarge", "16 x AWS Trainium", 16, {"bf16": 190e12, "fp8": 190e12, "fp32": 47.5e12}, 32 * GIB,
        0.82e12, 800e9, 21.50,
        {"accelerator": "awsdocs-neuron trn1-arch: 16 chips, 3.04 PFLOPS BF16, 512 GiB HBM, 13.1 TB/s",
         "network": "800 Gbps EFA, 8 interfaces", "price": PRICE_SRC,
         "efficiency": "no public vLLM-neuron prefill MFU: the GPU factors are used; calibrate on the cluster"},
        deployable=False, deployable_note=TRN1_NOT_DEPLOYABLE, host_memory_gib=512.0),
    # This machine: AVX2 EPYC, 2 cores at ~2.45 GHz, 2 FMA units x 8 fp32 lanes x 2 = 32 FLOP/cycle/core.
    # The achieved factors below are placeholders until `turnkv plan calibrate` measures them.
    "local-cpu": Instance(
        "local-cpu", "2 x86 cores (vLLM CPU build)", 1, {"bf16": 156e9, "fp32": 156e9, "fp8": 156e9}, 2 * GIB,
        20e9, 8 * 5.5e9, 0.0,
        {"accelerator": "lscpu on this machine: 2 AVX2 cores at 2.45 GHz", "network": "loopback (UCX tcp/shm): "
         "15.5 MiB in ~2.4 ms measured (shared/notes/local-engines.md)", "price": "none (local)"},
        Efficiency(dense=0.3, moe=0.3, allreduce_bus_bytes_s=1e12, decode_bandwidth=0.5, request_overhead_s=0.02,
                   transfer_setup_s=0.002, pull_components=LOCAL_PULL, pd_handover_s=0.0,
                   transfer_efficiency=((1, 1.0),), source="placeholder: run `turnkv plan calibrate`"),
        memory_utilization=1.0, prefill_chunk_tokens=2048, host_memory_gib=4.0, host_link_bytes_s=20e9,
        kv_block_multiple=32),
}

CALIBRATION_FILE = "plan-calibration.json"


def transfer_efficiency(eff: Efficiency, message_bytes: float) -> float:
    """Fraction of the link rate a transfer of ``message_bytes`` messages reaches (log interpolation)."""
    import math

    table = eff.transfer_efficiency or EFA_MESSAGE_EFFICIENCY
    if len(table) == 1 or message_bytes <= table[0][0]:
        return table[0][1]
    for (s0, e0), (s1, e1) in itertools.pairwise(table):
        if message_bytes <= s1:
            t = (math.log(message_bytes) - math.log(s0)) / (math.log(s1) - math.log(s0))
            return e0 + t * (e1 - e0)
    return table[-1][1]


def load(name: str, state_dir: Path | None = None) -> Instance:
    """An instance by name: GPU factors fitted to the published measurements (turnkv.plan.gpu_calibration), trn2's
    to the published Neuron ones (turnkv.plan.neuron_calibration), local-cpu's from a calibration file when
    present. ``INSTANCES`` holds the priors."""
    from turnkv.plan import gpu_calibration

    name = {n.lower(): n for n in INSTANCES}.get(name.strip().lower(), name)
    if name not in INSTANCES:
        raise ValueError(f"unknown instance {name!r}: use one of {', '.join(INSTANCES)}")
    from turnkv.plan import neuron_calibration

    inst = neuron_calibration.calibrated(gpu_calibration.calibrated(INSTANCES[name]))
    if state_dir is not None and (state_dir / CALIBRATION_FILE).is_file():
        data = json.loads((state_dir / CALIBRATION_FILE).read_text())
        if data.get("instance") == name:
            inst = apply_calibration(inst, data)
    return inst


def apply_calibration(inst: Instance, data: dict[str, Any]) -> Instance:
    e = data["efficiency"]
    eff = replace(inst.efficiency, dense=e["dense"], moe=e.get("moe", e["dense"]), attention=e.get("attention"),
                  context_attention=e.get("context_attention"), step_overhead_s=e.get("step_overhead_s", 0.0),
                  request_overhead_s=e["request_overhead_s"], transfer_setup_s=e["transfer_setup_s"],
                  transfer_efficiency=((1, e["transfer_efficiency"]),),
                  source=f"calibrated {data.get('measured_at', '')} on {data.get('host', 'this machine')}")
    from turnkv.plan import calibrate

    band = calibrate.prefill_band(data)
    if band is not None:
        when = data.get("measured_at", "")
        eff = replace(eff, ttft_band=band, ttft_band_source=f"±{band:.0%}: RMS relative residual of the {when} "
                      "prefill fit (turnkv plan calibrate), over points minus fitted terms")
    return replace(inst, efficiency=eff, network_bits_s=data.get("network_bits_s", inst.network_bits_s))
