"""``python -m connector.pool_probe``: what ``turnkv doctor`` asks a node about its host tier, printed as one JSON line.

It plans the per-rank pools an engine of ``--tp`` ranks with ``--budget-mib`` would pin (``connector.host_pool_plan``:
the node's NUMA layout and free hugepages from /sys), allocates, pins and registers the pools of the ranks on one
NUMA node (their pages share that node's NICs) with a NIXL agent exactly as the engine does (``host_pool_plan.fit``:
halving on refusal), then READs the first and last slot of every registered region from a second NIXL agent and
compares the bytes. Two agents, not one: within one agent libfabric serves a READ as a local copy. Same-node peers
would take libfabric's shm path, so the EFA provider's shm transfer is turned off (``FI_EFA_ENABLE_SHM_TRANSFER=0``)
and the READ crosses the EFA device.

Without CUDA (CPU engines, or a check run here) the pools are allocated unpinned; with ``--backend UCX`` it runs on
any host (the suite's check of the probe itself).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import uuid
from typing import Any

from connector import host_pool_plan as hp
from connector import host_tier
from turnkv import fabric_limits as fl


def _read_pair(agents: tuple[Any, Any], backend: str, pool: host_tier.HostBuffer, plan: hp.PoolPlan,
               slot: int) -> tuple[int, float]:
    """READ the first and last ``slot`` bytes of each registered region of ``pool`` from the second agent; returns
    (descriptors read, seconds). Raises when a READ fails or returns other bytes."""
    import torch

    owner, reader = agents
    spans = [(r.offset, slot) for r in plan.regions] + [(r.offset + r.nbytes - slot, slot) for r in plan.regions]
    for offset, length in spans:  # distinct bytes at each span, so a READ of the wrong place shows
        pool.tensor[offset:offset + length] = torch.arange(length, dtype=torch.int64).add_(offset).to(torch.uint8)
    local = torch.zeros(len(spans) * slot, dtype=torch.uint8)
    local_reg = reader.register_memory([(local.data_ptr(), local.numel(), 0, "")], "DRAM", backends=[backend])
    name = reader.add_remote_agent(owner.get_agent_metadata())
    try:
        remote = reader.get_xfer_descs([(pool.base + o, n, 0) for o, n in spans], "DRAM")
        mine = reader.get_xfer_descs([(local.data_ptr() + i * slot, slot, 0) for i in range(len(spans))], "DRAM")
        started = time.monotonic()
        handle = reader.initialize_xfer("READ", mine, remote, name, b"turnkv-doctor", backends=[backend])
        state = reader.transfer(handle)
        while state not in ("DONE", "ERR"):
            if time.monotonic() - started > 60:
                raise TimeoutError("the READ did not finish in 60 s")
            state = reader.check_xfer_state(handle)
        seconds = time.monotonic() - started
        reader.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"the READ ended in state {state}")
        for i, (offset, length) in enumerate(spans):
            if not torch.equal(local[i * slot:(i + 1) * slot], pool.tensor[offset:offset + length]):
                raise RuntimeError(f"the READ of pool bytes {offset}..{offset + length} returned other bytes")
        return len(spans), seconds
    finally:
        reader.remove_remote_agent(name)
        reader.deregister_memory(local_reg, backends=[backend])


def probe(budget_mib: int, tp: int, slot_bytes: int, backend: str, node: int | None = None) -> dict[str, Any]:
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    cuda = torch.cuda.is_available()
    layout = host_tier.numa_layout() if cuda else host_tier.cpu_layout(tp)
    limits = fl.EFA_P5EN if backend == "LIBFABRIC" else fl.UNLIMITED
    node = layout.node_of(0) if node is None else node
    share = hp.rank_share_bytes(budget_mib, tp)
    page = hp.page_size_for(host_tier.free_hugepages(node), share) if cuda else fl.PAGE_4K
    ranks = [r for r in range(tp) if layout.node_of(r) == node]
    lens = [slot_bytes]
    config = nixl_agent_config(enable_prog_thread=True, backends=[backend])
    owner = nixl_agent(f"turnkv-doctor-pool-{uuid.uuid4().hex[:8]}", config)
    reader = nixl_agent(f"turnkv-doctor-reader-{uuid.uuid4().hex[:8]}", config)
    out: dict[str, Any] = {"cuda": cuda, "backend": backend, "numa_node": node, "page_size": page, "ranks": [],
                           "configured_bytes": share * len(ranks), "granted_bytes": 0}
    pools: list[tuple[host_tier.HostBuffer, list[Any]]] = []
    try:
        for rank in ranks:
            plan = hp.plan_rank(share, lens, page, layout, limits, rank=rank, device=rank)
            held: dict[str, Any] = {}

            def attempt(p: hp.PoolPlan, held: dict[str, Any] = held) -> None:
                buffer = host_tier.HostBuffer(p.pool_bytes, p.page_size, p.numa_node, pin=cuda)
                try:
                    held["regs"] = host_tier.register_regions(owner, buffer.base, p, [backend])
                except Exception:
                    buffer.close()
                    raise
                held["buffer"], held["plan"] = buffer, p

            started = time.monotonic()
            fitted = hp.fit(plan, attempt, limits)
            entry: dict[str, Any] = {"rank": rank, "planned": hp.describe(plan),
                                     "refused": [f"{hp.describe(p)}: {e}" for p, e in fitted.refused],
                                     "granted_bytes": fitted.granted_bytes,
                                     "register_seconds": round(time.monotonic() - started, 3)}
            if fitted.plan is not None:
                pools.append((held["buffer"], held["regs"]))
                count, seconds = _read_pair((owner, reader), backend, held["buffer"], fitted.plan,
                                            min(slot_bytes, 1 << 20))
                entry.update(read_descriptors=count, read_seconds=round(seconds, 4))
            out["ranks"].append(entry)
            out["granted_bytes"] += fitted.granted_bytes
    except Exception as error:
        out["error"] = f"{type(error).__name__}: {error}"
    finally:
        for buffer, regs in pools:
            for descs in regs:
                with contextlib.suppress(Exception):  # freed with the process anyway
                    owner.deregister_memory(descs, backends=[backend])
            buffer.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m connector.pool_probe", description=__doc__.split("\n")[0])
    parser.add_argument("--budget-mib", type=int, required=True, help="host_kv_budget_mib of one engine")
    parser.add_argument("--tp", type=int, default=1, help="the engine's tensor-parallel size")
    parser.add_argument("--slot-bytes", type=int, default=4 * fl.MIB,
                        help="bytes of one slot (a KV block of every layer on one rank; default 4 MiB)")
    parser.add_argument("--backend", default="LIBFABRIC", choices=("LIBFABRIC", "UCX"))
    parser.add_argument("--numa-node", type=int, default=None, help="default: GPU 0's")
    args = parser.parse_args(argv)
    if args.backend == "LIBFABRIC":
        os.environ.setdefault("FI_EFA_ENABLE_SHM_TRANSFER", "0")  # a same-node READ over the EFA device
    print(json.dumps(probe(args.budget_mib, args.tp, args.slot_bytes, args.backend, args.numa_node)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
