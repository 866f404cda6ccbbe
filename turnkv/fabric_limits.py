"""What the fabric and the pinned-memory stack refuse, from hardware and sources turnkv cannot run here: one place.

Every figure below is cited; none was measured by turnkv (no suite reaches an EFA device). The host tier's
registration plan (``connector.host_pool_plan``) keeps each registered region inside them, and an engine measures at
start what its node really registers (``connector.host_tier``): a node that refuses less than cited shrinks the pool
loudly instead of restart-looping.

- **Pages per registered region (EFA).** libfabric PR #10402 (ofiwg/libfabric, fabtests/pytest/efa, 2024-09): "The
  EFA limit for single MR that enables remote write is 1M pages aka 4GB for regular pages".
- **Page entries per device.** libfabric issue #9739 (ofiwg/libfabric, "prov/efa: unable to register more than 95GB
  of memory", c7i.48xlarge, one EFA NIC, 4 KiB pages): 95 GB registers, 96 GB fails with ENOMEM; the maintainers
  answer that the EFA device limits the number of host pages registered. 95 GB / 4 KiB is ~23M entries.
- **Bytes per region and page entries per NIC on p5en.** Mooncake PR #1912 (kvcache-ai/Mooncake, "PTE-aware
  auto-split large MR registration for EFA transport", merged 2026-04): ``max_mr_size`` is 192 GB per MR on P5EN, the
  PTE limit is ~24M entries per NIC, and Mooncake's default budget (``MC_EFA_MAX_PTE_ENTRIES``) is 22M; with 2 MiB
  hugepages a large pool fits every NIC's budget, with 4 KiB pages it does not.
- **Rails by NUMA node.** NIXL's LIBFABRIC plugin (ai-dynamo/nixl ``src/utils/libfabric/libfabric_rail_manager.cpp``,
  ``nixlLibfabricNumaRailSelectionPolicy``; present in the pinned NIXL 1.5.1 wheel's ``libplugin_LIBFABRIC.so``)
  registers DRAM on the rails of the buffer's NUMA node (``getMemNumaNode``) and caps bandwidth per NUMA node. So a
  rank's pool must sit on its GPU's NUMA node, and the pages of every pool on a node count against that node's NICs.
- **PyTorch rounds pinned allocations up to a power of two.** torch 2.13 (the pinned build),
  ``include/ATen/core/CachingHostAllocator.h`` lines 300-309 (``c10::llvm::PowerOf2Ceil(size)`` unless the size is
  above ``pinned_max_round_threshold``) and ``c10/core/AllocatorConfig.h`` line 361 (that threshold defaults to
  ``SIZE_MAX``): ``torch.zeros(n, pin_memory=True)`` of 75 GiB pins 128 GiB. The host tier pins exact sizes itself.
- **p5en's layout.** 8 H200 GPUs, 16 EFA interfaces, 2 NUMA nodes, 2,048 GiB host memory (EC2 accelerated computing
  instance specifications; ``infra.instances``): 4 GPUs and 8 NICs per NUMA node.
"""

from __future__ import annotations

from dataclasses import dataclass

KIB, MIB, GIB = 1024, 1024 * 1024, 1024 * 1024 * 1024
GB = 1000 * 1000 * 1000

#: Page sizes a pool may be backed by: regular pages and 2 MiB hugepages.
PAGE_4K, PAGE_2M = 4 * KIB, 2 * MIB


@dataclass(frozen=True)
class FabricLimits:
    """What one node's fabric registers (per registered region, per NIC)."""

    name: str
    #: Pages one registered region may span (libfabric PR #10402: 1M).
    max_pages_per_region: int
    #: Bytes one registered region may span (Mooncake PR #1912: 192 GB on p5en).
    max_region_bytes: int
    #: Page entries one NIC holds over every region registered on it (Mooncake PR #1912: ~24M, 22M budgeted;
    #: libfabric issue #9739: failures from ~23M entries).
    page_entries_per_nic: int
    #: NICs a DRAM region is registered on: the rails of its NUMA node (NIXL's NUMA rail selection).
    nics_per_numa_node: int

    def region_bytes(self, page_size: int) -> int:
        """The largest region registrable on ``page_size`` pages."""
        return min(self.max_region_bytes, self.max_pages_per_region * page_size)


#: EFA on p5en.48xlarge (16 EFA interfaces over 2 NUMA nodes).
EFA_P5EN = FabricLimits("efa-p5en", max_pages_per_region=1 << 20, max_region_bytes=192 * GB,
                        page_entries_per_nic=22_000_000, nics_per_numa_node=8)

#: No fabric limit known (CPU engines, UCX over TCP/shared memory): only the page sizes matter.
UNLIMITED = FabricLimits("none", max_pages_per_region=1 << 62, max_region_bytes=1 << 62,
                         page_entries_per_nic=1 << 62, nics_per_numa_node=1)

#: The cited facts by name, for logs and ``turnkv doctor``.
CITATIONS: dict[str, str] = {
    "pages-per-region": "libfabric PR #10402: EFA MR limit 1M pages (4 GB on 4 KiB pages)",
    "entries-per-device": "libfabric issue #9739: 95 GB registers, 96 GB fails (4 KiB pages, one EFA NIC)",
    "p5en-region-and-entries": "Mooncake PR #1912: max_mr_size 192 GB on P5EN, ~24M page entries per NIC",
    "numa-rails": "NIXL libfabric_rail_manager.cpp: DRAM registered on the buffer's NUMA node's rails",
    "pinned-rounding": "torch 2.13 ATen/core/CachingHostAllocator.h:300-309: PowerOf2Ceil on pinned allocations",
}
