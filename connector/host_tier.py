"""The host tier: decode's retained turns that do not fit in its device KV cache, in a host-memory pool.

Why a pool of our own and not vLLM 0.32's offloading: its ``OffloadingConnector`` (CPU backend) stores blocks
by prefix hash for the *same* engine to load back on a prefix hit, and the ``MultiConnector`` runs it beside
NIXL without a path from one to the other: an offloaded block is never readable by a *peer*. Here prefill must
READ the turn from decode's host memory with the same one-sided NIXL READ it uses for device blocks, under the
same token proof, signature, expiry and clearance. So the pool is laid out exactly like the device cache's NIXL
regions (region by region, one block-sized slot after another) and registered with decode's own NIXL agent
before the handshake metadata is published: a prefill worker builds the pool's descriptors from what it already
knows of decode's regions (block lengths) plus the pool's base address and size, which the offer carries
(``turnkv.wire.HOST_TIER``), and reads slots where it would read device blocks.

- Decode, when a finished turn is placed on the host tier (``connector.retention``): the scheduler keeps its
  device blocks for one more step, the worker copies them into the pool's slots at the start of that step and
  reports them as sent, so vLLM frees the device blocks. The turn stays in upstream's lease table (expiry, lease
  renewal, eviction grace and the read notification work unchanged); when upstream reports it done again (read
  or expired) the worker hands the slots back to the scheduler instead of vLLM.
- A host-tier offer must not be read before the copy is done: the worker lists finished copies on the evictions
  feed (``hosted``), routers clear a host-tier offer only once listed there, and prefill reads a host-tier offer
  only when cleared.
- On CUDA nodes the pool is pinned host memory (DRAM registration, as NIXL's LIBFABRIC and UCX backends read it);
  on CPU engines it is ordinary memory beside the KV cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from connector import host_pool_plan
from turnkv import fabric_limits, wire


def region_bases(base: int, blocks: int, block_lens: list[int]) -> list[int]:
    """Each region's start in a pool of ``blocks`` slots: the regions one after another, each a run of slots."""
    out, offset = [], base
    for length in block_lens:
        out.append(offset)
        offset += blocks * length
    return out


def offer_field(bases: list[int], blocks: int) -> dict[str, Any]:
    """What an offer names of the pool (signed with it): every rank's base and the slots per pool."""
    return {"tier": "host", "bases": [int(b) for b in bases], "blocks": int(blocks)}


def parse_offer_field(value: Any) -> tuple[list[int], int] | None:
    """(bases, blocks) from an offer's ``wire.HOST_TIER``; None when absent or malformed."""
    if not isinstance(value, dict) or value.get("tier") != "host":
        return None
    bases, blocks = value.get("bases"), value.get("blocks")
    if (not isinstance(bases, list) or not bases or not all(isinstance(b, int) and b > 0 for b in bases)
            or not isinstance(blocks, int) or blocks <= 0):
        return None
    return bases, blocks


def is_host_offer(params: Any) -> bool:
    return isinstance(params, dict) and params.get(wire.HOST_TIER) is not None


def remote_pool_meta(meta: Any, base: int, blocks: int) -> Any:
    """Decode's handshake metadata (``NixlAgentMetadata``) re-pointed at its host pool: the same regions and block
    lengths, the pool's addresses, ``blocks`` per region, compact strides, DRAM. Upstream's own descriptor builder
    then lays out the pool exactly as the device cache, so block ids become slot ids."""
    lens = list(meta.block_lens)
    count = len(meta.kv_caches_base_addr)
    return dataclasses.replace(
        meta, kv_caches_base_addr=region_bases(base, blocks, lens[:count]), num_blocks=blocks,
        region_num_blocks=[blocks] * count, block_strides=lens[:count], device_id=0,
        region_mem_types=["DRAM"] * count)


def register_regions(agent: Any, base: int, plan: host_pool_plan.PoolPlan, backends: Any = None) -> list[Any]:
    """Register the pool at ``base`` with NIXL as ``plan``'s regions, one registration each (a refused one leaves
    nothing registered: the ones before it are deregistered, then the refusal is raised)."""
    done: list[Any] = []
    try:
        for region in plan.regions:
            descs = agent.get_reg_descs([(base + region.offset, region.nbytes, 0, "")], "DRAM")
            if backends is None:
                agent.register_memory(descs)
            else:
                agent.register_memory(descs, backends=backends)
            done.append(descs)
    except Exception:
        for descs in done:
            with contextlib.suppress(Exception):
                agent.deregister_memory(descs)
        raise
    return done


class HostBuffer:
    """Host memory of exactly ``nbytes`` (whole pages), not through PyTorch's caching host allocator (which rounds a
    pinned allocation up to a power of two: ``turnkv.fabric_limits``): an anonymous mapping, on 2 MiB hugepages when
    asked, bound to ``numa_node`` before its pages are touched (the rank's GPU's node: NIXL registers DRAM on that
    node's rails), pinned with ``cudaHostRegister`` when ``pin``."""

    def __init__(self, nbytes: int, page_size: int = fabric_limits.PAGE_4K, numa_node: int | None = None,
                 pin: bool = False) -> None:
        import mmap

        import torch

        self.nbytes, self.page_size, self.pinned = nbytes, page_size, False
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        if page_size == fabric_limits.PAGE_2M:
            flags |= getattr(mmap, "MAP_HUGETLB", MAP_HUGETLB)
        length = -(-max(1, nbytes) // page_size) * page_size
        self._map = mmap.mmap(-1, length, flags=flags)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes)
        self.base = int(self.tensor.data_ptr())
        self.numa_bound = numa_node is not None and bind_numa(self.base, length, numa_node)
        if pin:
            code = int(getattr(status := _cudart().cudaHostRegister(self.base, length, 0), "value", status))
            if code != 0:
                self.close()
                raise MemoryError(f"cudaHostRegister of {length} bytes failed (CUDA error {code})")
            self.pinned = True

    def close(self) -> None:
        if self.pinned:
            with contextlib.suppress(Exception):
                _cudart().cudaHostUnregister(self.base)
            self.pinned = False
        self.tensor = None
        with contextlib.suppress(BufferError, ValueError):
            self._map.close()


#: Linux's MAP_HUGETLB (Python's mmap module names it from 3.13 on only).
MAP_HUGETLB = 0x40000
#: mbind(2)'s syscall number by machine, and its MPOL_BIND mode.
_MBIND = {"x86_64": 237, "aarch64": 235}
MPOL_BIND = 2


def bind_numa(address: int, length: int, node: int) -> bool:
    """Bind ``length`` bytes at ``address`` (not touched yet) to NUMA node ``node`` (mbind); False where it cannot."""
    import ctypes
    import platform

    number = _MBIND.get(platform.machine())
    if number is None or node < 0:
        return False
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    mask = (ctypes.c_ulong * (node // bits + 1))()
    mask[node // bits] = 1 << (node % bits)
    libc = ctypes.CDLL(None, use_errno=True)
    result = libc.syscall(ctypes.c_long(number), ctypes.c_void_p(address), ctypes.c_ulong(length),
                          ctypes.c_int(MPOL_BIND), mask, ctypes.c_ulong(len(mask) * bits + 1), ctypes.c_uint(0))
    return result == 0


def _cudart() -> Any:
    import torch

    return torch.cuda.cudart()


@dataclasses.dataclass
class Copy:
    """One turn's device-to-pool copy in flight: done once ``event`` (CUDA) has completed; None: already done."""

    event: Any = None

    def done(self) -> bool:
        return self.event is None or bool(self.event.query())


class HostPool:
    """One rank's pool: allocated, registered with the worker's NIXL agent, and filled from device blocks.

    ``plan`` (``connector.host_pool_plan``) gives its slots, page size, NUMA node and registered regions. On CUDA the
    pool is an exact-size :class:`HostBuffer`, pinned, and copies run on a side stream: :meth:`copy_in` returns a
    :class:`Copy` whose event tells when the turn is hosted. On CPU engines it is a ``torch.empty`` tensor (committed
    as it is used) and copies are done when :meth:`copy_in` returns."""

    def __init__(self, worker: Any, plan: host_pool_plan.PoolPlan, agent: Any = None, backends: Any = None) -> None:
        import torch

        self.plan = plan
        self.blocks = plan.blocks
        self.block_lens = list(worker.block_len_per_layer)
        if tuple(self.block_lens) != plan.block_lens:
            raise ValueError(f"the plan's block lengths {plan.block_lens} are not the worker's {self.block_lens}")
        strides = list(worker.block_stride_per_layer)
        bases = list(worker.kv_caches_base_addr[worker.engine_id][worker.tp_rank])
        caches = [t for t in worker.device_kv_caches.values() if isinstance(t, torch.Tensor)]
        self.cuda = caches[0].device.type == "cuda"
        self._buffer: HostBuffer | None = None
        if self.cuda:
            self._buffer = HostBuffer(plan.pool_bytes, plan.page_size, plan.numa_node, pin=True)
            self.tensor = self._buffer.tensor
            self._stream = torch.cuda.Stream(device=caches[0].device)
        else:
            # Committed as slots are written (a slot is always written before an offer names it; seals check what
            # is read): a CPU engine's pool, capped by the host's room (host_pool_plan.host_room), costs nothing
            # until the tier fills, where zeroing it took ~1 s a GiB at start.
            self.tensor = torch.empty(plan.pool_bytes, dtype=torch.uint8)
            self._stream = None
        self.base = int(self.tensor.data_ptr())
        # Per region: the device cache's blocks and the pool's slots as (rows, block bytes) byte views.
        self._device = [self._view(caches, base, worker.region_num_blocks[i], strides[i], self.block_lens[i])
                        for i, base in enumerate(bases)]
        self._host = [self.tensor.as_strided((self.blocks, length), (length, 1), offset)
                      for offset, length in zip(region_bases(0, self.blocks, self.block_lens), self.block_lens,
                                                strict=True)]
        agent = worker.nixl_wrapper if agent is None else agent
        backends = getattr(worker, "nixl_backends", None) if backends is None else backends
        try:
            self.registered = register_regions(agent, self.base, plan, backends)
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        """Free the memory (after its registrations were dropped, or none were made)."""
        self._device, self._host = [], []
        self.tensor = None
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None

    @staticmethod
    def _view(caches: list[Any], base: int, num_blocks: int, stride: int, length: int) -> Any:
        import torch

        for cache in caches:
            storage = cache.untyped_storage()
            start = storage.data_ptr()
            if start <= base < start + storage.nbytes():
                raw = torch.empty(0, dtype=torch.uint8, device=cache.device).set_(storage)
                return raw.as_strided((num_blocks, length), (stride, 1), base - start)
        raise ValueError(f"no KV cache tensor holds region base {base:#x}")

    def copy_in(self, device_blocks: list[int], slots: list[int]) -> Copy:
        """Device blocks -> pool slots, every region. CUDA: asynchronous on the pool's side stream, after the work
        queued so far on the engine's stream (the turn's last KV writes), each run of consecutive blocks into
        consecutive slots one copy into pinned memory; the returned :class:`Copy` completes with the last one. CPU:
        done on return."""
        import torch

        if len(device_blocks) != len(slots):
            raise ValueError(f"{len(device_blocks)} device blocks for {len(slots)} host slots")
        if not self.cuda:
            for device, host in zip(self._device, self._host, strict=True):
                src = torch.tensor(device_blocks, dtype=torch.long, device=device.device)
                host[torch.tensor(slots, dtype=torch.long)] = device.index_select(0, src).to("cpu")
            return Copy()
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):
            for device, host in zip(self._device, self._host, strict=True):
                for block, slot, count in runs(device_blocks, slots):
                    host[slot:slot + count].copy_(device[block:block + count], non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return Copy(event)


def runs(blocks: list[int], slots: list[int]) -> list[tuple[int, int, int]]:
    """(first block, first slot, count) of each run where both blocks and slots go up by one (pure)."""
    out: list[tuple[int, int, int]] = []
    for block, slot in zip(blocks, slots, strict=True):
        if out and out[-1][0] + out[-1][2] == block and out[-1][1] + out[-1][2] == slot:
            first, first_slot, count = out[-1]
            out[-1] = (first, first_slot, count + 1)
        else:
            out.append((block, slot, 1))
    return out


# the node, read at engine start ------------------------------------------------------------------------------------


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _node_ids(sys_root: str) -> list[int]:
    import os

    try:
        names = os.listdir(f"{sys_root}/devices/system/node")
    except OSError:
        return []
    return sorted(int(n[4:]) for n in names if n.startswith("node") and n[4:].isdigit())


def node_memory_bytes(node: int, sys_root: str = "/sys") -> int | None:
    """MemTotal of NUMA node ``node`` (``/sys/devices/system/node/nodeN/meminfo``)."""
    text = _read(f"{sys_root}/devices/system/node/node{node}/meminfo") or ""
    for line in text.splitlines():
        if "MemTotal:" in line:
            return int(line.split("MemTotal:")[1].split()[0]) * 1024
    return None


def host_memory_bytes(proc_root: str = "/proc", field: str = "MemTotal") -> int:
    for line in (_read(f"{proc_root}/meminfo") or "").splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return 0


def host_available_bytes(proc_root: str = "/proc") -> int | None:
    """The host's MemAvailable now (None where /proc says nothing: no cap from it)."""
    return host_memory_bytes(proc_root, "MemAvailable") or None


def cpu_layout(tp_size: int = 1) -> host_pool_plan.NumaLayout:
    """A CPU engine's host: one node of the host's memory, a pool for each of its ``tp_size`` ranks."""
    return host_pool_plan.NumaLayout.single(host_memory_bytes(), tp_size)


def free_hugepages(node: int, sys_root: str = "/sys") -> int:
    """Free 2 MiB hugepages reserved on NUMA node ``node`` (0 without any)."""
    text = _read(f"{sys_root}/devices/system/node/node{node}/hugepages/hugepages-2048kB/free_hugepages")
    return int(text.strip()) if text and text.strip().isdigit() else 0


def gpu_numa_nodes(pci_ids: list[str], sys_root: str = "/sys") -> tuple[int, ...]:
    """Each GPU's NUMA node from its PCI device (``/sys/bus/pci/devices/<id>/numa_node``; -1 or unknown: 0)."""
    out = []
    for pci in pci_ids:
        text = (_read(f"{sys_root}/bus/pci/devices/{pci.lower()}/numa_node") or "").strip()
        out.append(max(0, int(text)) if text.lstrip("-").isdigit() else 0)
    return tuple(out)


#: PCI vendor id of NVIDIA, and its GPUs' class prefixes (0x0302: 3D controller, as H100/H200 report; 0x0300: VGA).
NVIDIA_VENDOR = "0x10de"
GPU_CLASSES = ("0x0302", "0x0300")


def host_gpu_count(sys_root: str = "/sys") -> int:
    """Every NVIDIA GPU on the host's PCI bus, whatever CUDA_VISIBLE_DEVICES shows this engine: each runs a rank of
    some engine of the node, so each may hold a pool (0 where /sys says nothing)."""
    import os

    root = f"{sys_root}/bus/pci/devices"
    try:
        names = os.listdir(root)
    except OSError:
        return 0
    return sum(1 for n in names if (_read(f"{root}/{n}/vendor") or "").strip() == NVIDIA_VENDOR
               and (_read(f"{root}/{n}/class") or "").strip().startswith(GPU_CLASSES))


def cuda_pci_ids() -> list[str]:
    """The PCI address of each visible CUDA device, as sysfs names it (``0000:53:00.0``)."""
    import torch

    ids = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        ids.append(f"{getattr(props, 'pci_domain_id', 0):04x}:{getattr(props, 'pci_bus_id', 0):02x}:"
                   f"{getattr(props, 'pci_device_id', 0):02x}.0")
    return ids


def numa_layout(pci_ids: list[str] | None = None, sys_root: str = "/sys",
                proc_root: str = "/proc") -> host_pool_plan.NumaLayout:
    """This node's NUMA layout: memory per node and the node of each CUDA device (one node when /sys says none)."""
    nodes = _node_ids(sys_root)
    sizes = tuple(node_memory_bytes(n, sys_root) or 0 for n in range(max(nodes) + 1)) if nodes else ()
    if not sizes or not any(sizes):
        sizes = (host_memory_bytes(proc_root),)
    gpus = gpu_numa_nodes(cuda_pci_ids() if pci_ids is None else pci_ids, sys_root)
    return host_pool_plan.NumaLayout(sizes, tuple(min(n, len(sizes) - 1) for n in gpus) or (0,))


def agree_blocks(blocks: int, tp_size: int) -> int:
    """The smallest pool of the tensor-parallel ranks (every rank calls this once, at the same point): an offer
    names one slot count for every rank's pool. One rank: its own."""
    if tp_size <= 1:
        return blocks
    import torch
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    value = torch.tensor([int(blocks)], dtype=torch.int64)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=get_tp_group().cpu_group)
    return int(value.item())
