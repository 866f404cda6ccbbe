"""KV seals on the worker side: decode's digests of retained turns (published on its evictions feed), prefill's check
of every READ against them, and a fault injector that misaddresses READs on purpose (tests and ``bench.fault_load``).

The digest itself is ``connector.fingerprint``; the seal's MAC and wire form are ``turnkv.wire`` (``SEALED``,
``SEALS``, ``seal_mac``). Decode's scheduler marks an offer ``SEALED`` (signed) when every rank can digest its
blocks; its workers digest the turn at the next step and list ``[request id, rank, digests, mac, expiry]`` on the
feed; a router attaches the entries to the replay; prefill's scheduler checks the MACs and hands each READ its
rank's digests (``connector.admission.ReadPlan.seal``); prefill's workers compare after the READ, before any
forward uses the blocks.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from connector import fingerprint

logger = logging.getLogger("vllm.turnkv.connector")

#: ``0`` turns sealing off on this engine (decode then makes unsealed offers, which prefill reads unchecked).
ENABLED_ENV = "TURNKV_KV_FINGERPRINTS"
#: Test hook: break every READ of a retained turn this prefill posts. ``block``: each remote block id (device
#: block or host slot) is replaced by its neighbour; ``layer``: two layers of the first received block are swapped
#: after the READ; ``fail``: the READ fails before it is posted (a failed transfer); ``invalidate``: the decode engine
#: is marked invalid first (as after a transport error: upstream fails its reads and handshakes again).
#: ``FAULT_FILE_ENV`` names a file holding the mode instead, read at every READ (a running engine's fault changed by
#: a test or ``bench.gpu_smoke``; empty or absent: none).
FAULT_ENV = "TURNKV_INJECT_READ_FAULT"
FAULT_FILE_ENV = "TURNKV_INJECT_READ_FAULT_FILE"
FAULTS = ("block", "layer", "fail", "invalidate")


def enabled(env: Any = None) -> bool:
    env = os.environ if env is None else env
    return str(env.get(ENABLED_ENV, "1")).lower() not in ("0", "false", "no")


def fault(env: Any = None) -> str | None:
    """The READ fault to inject now, if any (checked at every READ: nothing set costs a dict lookup)."""
    env = os.environ if env is None else env
    value, name = env.get(FAULT_ENV) or None, FAULT_ENV
    if value is None and env.get(FAULT_FILE_ENV):
        name = env[FAULT_FILE_ENV]
        try:
            with open(name) as f:
                value = f.read().strip() or None
        except OSError:
            return None
    if value is not None and value not in FAULTS:
        raise ValueError(f"{name}: {value!r}: expected one of {', '.join(FAULTS)}")
    return value


def sampler_for(worker: Any) -> fingerprint.Sampler | None:
    """The digest sampler of this worker's KV cache (its layers in name order, every engine alike), or None when
    sealing is off or no layer is laid out block-major (then this engine neither seals nor checks)."""
    if not enabled():
        return None
    caches = getattr(worker, "device_kv_caches", None) or {}
    num_blocks = int(getattr(worker, "num_blocks", 0) or 0)
    views = [v for name in sorted(caches) for v in fingerprint.block_major_views(caches[name], num_blocks)]
    if not views:
        logger.warning("turnkv: no KV cache layer is laid out block-major here: KV seals off on this engine")
        return None
    logger.info("turnkv: KV seals on: %d samples per block in each of %d layer views", fingerprint.SAMPLES, len(views))
    return fingerprint.Sampler(views)


@dataclass(frozen=True)
class Seal:
    seq: int
    digests: str
    mac: str
    until: float


class SealBook:
    """Decode: the seals of the turns this rank retains, numbered on the feed's cursor with the evictions (pure)."""

    def __init__(self) -> None:
        self._by_id: dict[str, Seal] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def add(self, request_id: str, seal: Seal) -> None:
        self._by_id[request_id] = seal

    def since(self, seq: int) -> list[tuple[int, str, Seal]]:
        return [(s.seq, rid, s) for rid, s in self._by_id.items() if s.seq > seq]

    def renew(self, request_id: str, seq: int, until: float) -> bool:
        """A lease renewed to ``until``: the seal is listed again (``seq``) with it, so routers keep it as long."""
        seal = self._by_id.get(request_id)
        if seal is None or until <= seal.until:
            return False
        self._by_id[request_id] = Seal(seq, seal.digests, seal.mac, until)
        return True

    def forget(self, wall: float, request_ids: Any = ()) -> None:
        """Seals past their (renewed) expiry, and those of the turns named (freed or evicted: nobody reads them)."""
        for request_id in [r for r, s in self._by_id.items() if s.until < wall]:
            del self._by_id[request_id]
        for request_id in request_ids:
            self._by_id.pop(request_id, None)


def unverifiable(worker: Any, plan: Any, meta: Any, sampler: Any) -> str | None:
    """Why this rank cannot compare a READ's blocks with decode's digests, or None. The bytes compare only where a
    block of this rank is laid out as the decode rank's block it was read from."""
    if sampler is None:
        return "this engine does not digest its KV blocks"
    ranks = max(1, int(getattr(worker, "world_size", 1) or 1))
    if len(plan.seal) != ranks:
        return f"decode runs {len(plan.seal)} tensor-parallel ranks, this engine {ranks}"
    if int(getattr(worker, "_physical_blocks_per_logical_kv_block", 1) or 1) != 1:
        return "kernel blocks smaller than vLLM's blocks"
    if getattr(worker, "use_host_buffer", False) or getattr(worker, "enable_permute_local_kv", False):
        return "blocks are converted after the READ"
    remote = getattr(worker, "_turnkv_remote_meta", {}).get((meta.remote.engine_id, int(getattr(worker, "tp_rank", 0))))
    if remote is not None and int(getattr(remote, "block_size", 0) or 0) != int(getattr(worker, "block_size", 0) or 0):
        return "decode's block size differs"
    return None


def inject_before_read(worker: Any, request_id: str, meta: Any, plan: Any) -> bool:
    """Break the READ ``worker`` is about to post as :func:`fault` says; True when it must not be posted (failed)."""
    from connector import compat

    mode, engine_id = fault(), meta.remote.engine_id
    logger.warning("turnkv: request %s: READ fault %r injected on purpose (%s)", request_id, mode, FAULT_ENV)
    if mode == "fail":
        compat.fail_read(worker, request_id)
        return True
    if mode == "invalidate" and engine_id in getattr(worker, "_remote_agents", {}):
        worker._mark_remote_engine_invalid(engine_id, time.perf_counter())
    if mode == "block":
        remote_blocks = plan.host[1] if plan.host is not None else int(
            (getattr(worker, "dst_num_blocks", None) or {}).get(engine_id, 0) or 0)
        meta.remote.block_ids = misaddress(meta.remote.block_ids, remote_blocks)
    return False


def misaddress(remote_block_ids: Any, remote_blocks: int) -> list[list[int]]:
    """The ``block`` fault: every remote block id replaced by its neighbour (the one after, or before at the end)."""
    out = []
    for group in remote_block_ids or ():
        out.append([b + 1 if b + 1 < remote_blocks else max(0, b - 1) for b in group])
    return out


def swap_layers(caches: dict[str, Any], num_blocks: int, block: int) -> bool:
    """The ``layer`` fault: the first two layers' contents of ``block`` exchanged (as a READ that wrote each layer's
    bytes into the other's place). False when there are not two layers alike to swap."""
    views = [v for name in sorted(caches) for v in fingerprint.block_major_views(caches[name], num_blocks)]
    if len(views) < 2 or views[0].shape != views[1].shape:
        return False
    first = views[0][block].clone()
    views[0][block].copy_(views[1][block])
    views[1][block].copy_(first)
    return True
