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

import dataclasses
from typing import Any

from turnkv import wire

MIB = 1024 * 1024


def pool_blocks(budget_mib: int, tp_size: int, bytes_per_block: int) -> int:
    """Slots of one rank's pool: its share of the engine's budget over the bytes a block takes on that rank."""
    if budget_mib <= 0 or bytes_per_block <= 0:
        return 0
    return (budget_mib * MIB // max(1, tp_size)) // bytes_per_block


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


class HostPool:
    """One rank's pool: allocated, registered with the worker's NIXL agent, and filled from device blocks."""

    def __init__(self, worker: Any, blocks: int) -> None:
        import torch

        self.blocks = blocks
        self.block_lens = list(worker.block_len_per_layer)
        strides = list(worker.block_stride_per_layer)
        bases = list(worker.kv_caches_base_addr[worker.engine_id][worker.tp_rank])
        caches = [t for t in worker.device_kv_caches.values() if isinstance(t, torch.Tensor)]
        pin = caches[0].device.type == "cuda"
        self.tensor = torch.zeros(blocks * sum(self.block_lens), dtype=torch.uint8, pin_memory=pin)
        self.base = int(self.tensor.data_ptr())
        # Per region: the device cache's blocks and the pool's slots as (rows, block bytes) byte views.
        self._device = [self._view(caches, base, worker.region_num_blocks[i], strides[i], self.block_lens[i])
                        for i, base in enumerate(bases)]
        self._host = [self.tensor.as_strided((blocks, length), (length, 1), offset)
                      for offset, length in zip(region_bases(0, blocks, self.block_lens), self.block_lens,
                                                strict=True)]
        descs = worker.nixl_wrapper.get_reg_descs([(self.base, self.tensor.nbytes, 0, "")], "DRAM")
        worker.nixl_wrapper.register_memory(descs, backends=worker.nixl_backends)
        worker._registered_descs.append(descs)

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

    def copy_in(self, device_blocks: list[int], slots: list[int]) -> None:
        """Device blocks -> pool slots, every region (synchronous: the blocks are freed right after)."""
        import torch

        if len(device_blocks) != len(slots):
            raise ValueError(f"{len(device_blocks)} device blocks for {len(slots)} host slots")
        for device, host in zip(self._device, self._host, strict=True):
            src = torch.tensor(device_blocks, dtype=torch.long, device=device.device)
            host[torch.tensor(slots, dtype=torch.long)] = device.index_select(0, src).to("cpu")
        if self._device and self._device[0].device.type == "cuda":
            torch.cuda.synchronize(self._device[0].device)
