"""The host tier's allocation and registration plan (pure, no I/O): how many slots each rank's pool holds, on which
NUMA node, and the regions it is registered as, each inside the fabric's limits (``turnkv.fabric_limits``).

- **Sizing.** A rank's share is the engine's ``host_kv_budget_mib`` over its tensor-parallel size, in whole slots (a
  slot is one KV block of every layer region), capped by its NUMA node's memory (``NODE_SHARE`` of it, split over
  the node's GPUs: every GPU of a decode node runs a rank of some engine), by what the host can back when the pool
  is allocated (:func:`host_room`: ``NODE_SHARE`` of MemAvailable past a headroom, less the other pools' claims in
  the host's ledger, ``connector.host_ledger``; a budget the host cannot back is not refused by the allocation but
  ends in the OOM killer, so it is shrunk here, loudly) and by the page entries the
  node's NICs hold (every pool on a NUMA node is registered on that node's rails, NIXL's NUMA rail selection). On
  4 KiB pages the entries cap a p5en rank at ~21 GiB; on 2 MiB hugepages the budget is the limit.
- **Regions.** The pool is laid out as the device cache (layer region after layer region, each ``blocks`` slots). It
  is registered as consecutive regions cut at slot boundaries, so that every descriptor a peer reads (one block of
  one layer region) lies in one registered region, and each region spans no more than the fabric's pages and bytes
  (EFA: 1M pages, so 4 GiB on regular pages; 192 GB on p5en).
- **Exact size.** The pinned bytes are the slots' bytes, allocated as such (rounded up to the page size only), not
  PyTorch's power-of-two rounding.
- **Fitting** (:func:`fit`): the node may register less than cited; the engine tries the plan and, refused, halves
  the pool and tries again, down to ``MIN_POOL_BYTES``, below which it runs without the tier (a smaller configured
  pool is tried as configured, once).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from turnkv.fabric_limits import GIB, MIB, PAGE_2M, PAGE_4K, FabricLimits

#: Share of a NUMA node's memory the pools on it may take together (the rest: vLLM, the OS, NIXL's buffers).
NODE_SHARE = 0.75
#: Below this a pool is not worth its registration: the engine runs without the tier (loudly).
MIN_POOL_BYTES = 256 * MIB
#: Host memory left out of what the pools may take from MemAvailable: this share of the host's memory, and at least
#: MIN_HEADROOM_BYTES (the OS, the page cache the engines' weights stream through, other engines' growth).
HEADROOM_SHARE = 0.10
MIN_HEADROOM_BYTES = 4 * GIB


@dataclass(frozen=True)
class NumaLayout:
    """A node's NUMA nodes: memory of each, and the NUMA node of each GPU (by CUDA device index)."""

    node_bytes: tuple[int, ...]
    gpu_node: tuple[int, ...]
    #: What this pool may take of the host's available memory (``host_room``; None: not known, no cap from it).
    room_bytes: int | None = None

    def gpus_on(self, node: int) -> int:
        return max(1, sum(1 for n in self.gpu_node if n == node))

    def node_of(self, device: int) -> int:
        return self.gpu_node[device] if 0 <= device < len(self.gpu_node) else 0

    @classmethod
    def single(cls, total_bytes: int, gpus: int = 1, room_bytes: int | None = None) -> NumaLayout:
        return cls((total_bytes,), (0,) * max(1, gpus), room_bytes)


#: p5en.48xlarge: 2 NUMA nodes of 1 TiB, GPUs 0-3 on node 0 and 4-7 on node 1 (turnkv.fabric_limits).
P5EN = NumaLayout((1024 * GIB, 1024 * GIB), (0, 0, 0, 0, 1, 1, 1, 1))


@dataclass(frozen=True)
class Claim:
    """Another pool of this host (``connector.host_ledger``): its bytes, and whether they are allocated yet (so
    already out of MemAvailable) or only planned."""

    nbytes: int
    allocated: bool


def host_room(available: int, total: int, pools: int, claims: Sequence[Claim], node_share: float = NODE_SHARE) -> int:
    """What one more pool may take of a host with ``available`` bytes (MemAvailable) of ``total``, beside the pools
    ``claims`` holds, when ``pools`` pools (every GPU of the host; a CPU engine's ranks) will be allocated in all:
    ``node_share`` of the memory the pools may have past the headroom (the memory not theirs: available plus what
    allocated pools took), less every claim, split evenly over the pools still to come, this one included. Engines
    that start together each get their share; one that starts late gets what the others left, never what the host
    cannot back."""
    headroom = max(MIN_HEADROOM_BYTES, int(total * HEADROOM_SHARE))
    without_pools = available + sum(c.nbytes for c in claims if c.allocated)
    room = int(max(0, without_pools - headroom) * node_share) - sum(c.nbytes for c in claims)
    return max(0, room) // max(1, pools - len(claims))


@dataclass(frozen=True)
class Region:
    """One registration: ``nbytes`` from ``offset`` of the pool, spanning ``pages`` pages."""

    offset: int
    nbytes: int
    pages: int


@dataclass(frozen=True)
class PoolPlan:
    rank: int
    device: int
    numa_node: int
    page_size: int
    block_lens: tuple[int, ...]
    #: Slots per layer region.
    blocks: int
    #: The rank's share of the configured budget.
    configured_bytes: int
    #: What bounded the pool: "budget", "numa-memory", "host-available", "nic-page-entries" or "shrunk" (refused
    #: by the node).
    limited_by: str
    regions: tuple[Region, ...] = field(default=())

    @property
    def slot_bytes(self) -> int:
        return sum(self.block_lens)

    @property
    def pool_bytes(self) -> int:
        """The pinned (and registered) bytes: the slots' bytes, exactly."""
        return self.blocks * self.slot_bytes

    @property
    def allocated_bytes(self) -> int:
        """The allocation: the pool rounded up to whole pages (hugepages are mapped whole)."""
        return -(-self.pool_bytes // self.page_size) * self.page_size

    @property
    def pages(self) -> int:
        return sum(r.pages for r in self.regions)

    def violations(self, limits: FabricLimits) -> list[str]:
        """What in this plan ``limits`` refuses (none for a plan of :func:`plan_rank`)."""
        out = [f"region at {r.offset:#x}: {r.nbytes} bytes / {r.pages} pages over {limits.name}'s "
               f"{limits.max_region_bytes} bytes / {limits.max_pages_per_region} pages"
               for r in self.regions
               if r.nbytes > limits.max_region_bytes or r.pages > limits.max_pages_per_region]
        covered = sum(r.nbytes for r in self.regions)
        if covered != self.pool_bytes:
            out.append(f"regions cover {covered} of the pool's {self.pool_bytes} bytes")
        return out


def region_bases(blocks: int, block_lens: Sequence[int]) -> list[int]:
    """Each layer region's offset in a pool of ``blocks`` slots."""
    out, offset = [], 0
    for length in block_lens:
        out.append(offset)
        offset += blocks * length
    return out


def pages_spanned(offset: int, nbytes: int, page_size: int) -> int:
    return 0 if nbytes <= 0 else (offset + nbytes - 1) // page_size - offset // page_size + 1


def cut_regions(blocks: int, block_lens: Sequence[int], page_size: int, limits: FabricLimits) -> tuple[Region, ...]:
    """The pool's registrations: consecutive, cut at slot boundaries, each within ``limits`` (greedy: as few as fit).

    Raises ValueError when one slot of a layer region alone is larger than a region may be."""
    max_bytes, max_pages = limits.max_region_bytes, limits.max_pages_per_region
    regions: list[Region] = []
    start = pos = 0

    def close() -> None:
        nonlocal start
        regions.append(Region(start, pos - start, pages_spanned(start, pos - start, page_size)))
        start = pos

    for length in block_lens:
        remaining = blocks
        while remaining:
            end = min(start + max_bytes, (start // page_size + max_pages) * page_size)
            fit = min(remaining, max(0, end - pos) // length)
            if fit == 0:
                if pos == start:
                    raise ValueError(f"a {length}-byte KV block is larger than a region {limits.name} registers "
                                     f"on {page_size}-byte pages")
                close()
                continue
            pos += fit * length
            remaining -= fit
    if pos > start:
        close()
    return tuple(regions)


def rank_share_bytes(budget_mib: int, tp_size: int) -> int:
    return max(0, int(budget_mib)) * MIB // max(1, int(tp_size))


def plan_rank(share_bytes: int, block_lens: Sequence[int], page_size: int, layout: NumaLayout, limits: FabricLimits,
              rank: int = 0, device: int | None = None, node_share: float = NODE_SHARE) -> PoolPlan:
    """One rank's pool: ``share_bytes`` in whole slots, capped by its NUMA node's memory and NICs' page entries."""
    lens = tuple(int(x) for x in block_lens)
    slot = sum(lens)
    device = rank if device is None else device
    node = layout.node_of(device)
    if slot <= 0 or share_bytes <= 0:
        return PoolPlan(rank, device, node, page_size, lens, 0, max(0, share_bytes), "budget")
    pools = layout.gpus_on(node)
    caps = {"budget": share_bytes,
            "numa-memory": int(layout.node_bytes[node] * node_share) // pools if node < len(layout.node_bytes)
            else share_bytes}
    if layout.room_bytes is not None:
        caps["host-available"] = layout.room_bytes
    limited_by = min(caps, key=lambda k: caps[k])
    blocks = caps[limited_by] // slot
    entries = limits.page_entries_per_nic // pools  # this pool's part of each of its NICs' entries
    while blocks > 0:
        regions = cut_regions(blocks, lens, page_size, limits)
        pages = sum(r.pages for r in regions)
        if pages <= entries:
            return PoolPlan(rank, device, node, page_size, lens, blocks, share_bytes, limited_by, regions)
        limited_by = "nic-page-entries"
        blocks = min(blocks - 1, blocks * entries // pages)
    return PoolPlan(rank, device, node, page_size, lens, 0, share_bytes, limited_by)


def shrunk(plan: PoolPlan, pool_bytes: int, limits: FabricLimits) -> PoolPlan:
    """``plan`` cut to at most ``pool_bytes`` (whole slots), after the node refused the larger one."""
    blocks = min(plan.blocks, max(0, pool_bytes) // max(1, plan.slot_bytes))
    regions = cut_regions(blocks, plan.block_lens, plan.page_size, limits) if blocks else ()
    return PoolPlan(plan.rank, plan.device, plan.numa_node, plan.page_size, plan.block_lens, blocks,
                    plan.configured_bytes, "shrunk", regions)


@dataclass
class Fitted:
    """What :func:`fit` found: the plan the node took (None: no tier) and each refused try with its error."""

    plan: PoolPlan | None
    refused: list[tuple[PoolPlan, str]] = field(default_factory=list)

    @property
    def granted_bytes(self) -> int:
        return self.plan.pool_bytes if self.plan is not None else 0


def fit(plan: PoolPlan, attempt: Callable[[PoolPlan], None], limits: FabricLimits,
        min_bytes: int = MIN_POOL_BYTES) -> Fitted:
    """Try ``plan`` (``attempt`` allocates, pins and registers it, raising when refused and leaving nothing
    behind); refused, halve the pool and try again, not below ``min_bytes`` (a smaller configured pool is tried as
    it is, once); none left: no tier."""
    fitted = Fitted(None)
    while plan.blocks > 0 and (not fitted.refused or plan.pool_bytes >= min_bytes):
        try:
            attempt(plan)
        except Exception as error:  # whatever the node refused with: reported, then halved
            fitted.refused.append((plan, f"{type(error).__name__}: {error}"))
            plan = shrunk(plan, plan.pool_bytes // 2, limits)
            continue
        fitted.plan = plan
        return fitted
    return fitted


def page_size_for(hugepages_free: int, pool_bytes: int) -> int:
    """2 MiB pages when the node has enough reserved hugepages for the pool, else regular pages."""
    return PAGE_2M if hugepages_free * PAGE_2M >= pool_bytes > 0 else PAGE_4K


def size(nbytes: int) -> str:
    """Bytes in GiB from 1 GiB up, else MiB."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / MIB:.2f} MiB"


def describe(plan: PoolPlan, held: str = "pinned") -> str:
    """One line for logs and reports (``held``: "pinned" on CUDA, "allocated" on CPU engines)."""
    largest = max((r.nbytes for r in plan.regions), default=0)
    return (f"rank {plan.rank} (GPU {plan.device}, NUMA {plan.numa_node}): {plan.blocks} slots x {plan.slot_bytes} B "
            f"= {size(plan.pool_bytes)} {held} of {size(plan.configured_bytes)} configured ({plan.limited_by}); "
            f"{len(plan.regions)} regions, largest {size(largest)}, {plan.pages} pages of {plan.page_size // 1024} KiB")
