"""Where the simulation meets the connector: the mixed classes, and every touch of connector state that is not an
upstream-facing hook.

The schedules drive the mixins only through the hooks vLLM calls (scheduler: ``get_num_new_matched_tokens``,
``update_state_after_alloc``, ``build_connector_meta``, ``update_connector_output``, ``request_finished``; worker:
``start_load_kv``, ``get_transfer_results``, ``get_block_ids_with_load_errors``, ``build_turnkv_meta``,
``turnkv_evictions``, the lease route's ``renew_on_worker``), public attributes (``cost``) and the tunables the
engine is started with (``kv_connector_extra_config``) or reloads (the tunables file). The functions below are the
exceptions; when the connector's private state changes, these are the ones to update:

- :func:`install_host_pool`: a decode rank's host pool, which ``register_kv_caches`` would allocate and register
  (``_turnkv_pool``, ``_turnkv_host_tier``).
- :func:`reload_tunables`: a hot reload, applied as the tunables file applies it (``_apply_tunables``).
- :func:`admission_note`: what the trace shows of prefill's per-request admission state (diagnostics only: a
  missing attribute shows as "?", never fails a schedule).
"""

from __future__ import annotations

import contextlib
import random
import sys
import types
from collections.abc import Iterator
from typing import Any

from connector.policy import CostModel, Decision, Load
from connector.scheduler import TurnkvSchedulerMixin
from connector.worker import TurnkvWorkerMixin
from tests.sim.fabric import Memory
from tests.sim.upstream import UpstreamScheduler, UpstreamWorker


class SimScheduler(TurnkvSchedulerMixin, UpstreamScheduler):
    """turnkv's scheduler over vLLM's pull scheduler (as ``connector.pull.TurnkvPullScheduler``)."""


class SimWorker(TurnkvWorkerMixin, UpstreamWorker):
    """turnkv's worker over the upstream pull worker's model (as ``connector.pull.TurnkvPullWorker``)."""

    turnkv_reads_inline = True


class ScriptedCost(CostModel):
    """The cost model with its pull-or-recompute answer drawn from the schedule's generator: with probability
    ``recompute`` a decision that would pull says "slower" (recompute) instead (0: the learned model's answers, only
    logged). ``CostModel.decide`` is what the scheduler asks; everything else (predictions for inline plans, learning)
    stays the real model's."""

    def __init__(self, rng: random.Random, recompute: float, log: Any) -> None:
        super().__init__()
        self._rng, self._recompute, self._log = rng, recompute, log

    def decide(self, tokens: int, floor: int, load: Load | None = None, new_engine: bool = False,
               tier: str = "device") -> Decision:
        load = load if load is not None else Load()
        real = super().decide(tokens, floor, load, new_engine, tier)
        if real.pull and self._recompute and self._rng.random() < self._recompute:
            self._log(f"cost model (scripted): recompute {tokens} {tier}-tier tokens")
            return Decision(False, "slower", tokens, load=load)
        if not real.pull:
            self._log(f"cost model ({real.reason}): recompute {tokens} {tier}-tier tokens")
        return real


class SimHostPool:
    """``connector.host_tier.HostPool`` as the worker uses it: base, slots, block lengths, and copies of device
    blocks into slots that complete (and read their source) when the fake clock reaches their end."""

    def __init__(self, device: Memory, pool: Memory, block_lens: list[int], copy_seconds: Any, clock: Any) -> None:
        self.device, self.memory = device, pool
        self.base, self.blocks, self.block_lens = pool.base, pool.blocks, list(block_lens)
        self._copy_seconds, self._clock = copy_seconds, clock

    def copy_in(self, device_blocks: list[int], slots: list[int]) -> Any:
        return _Copy(self, list(device_blocks), list(slots), self._clock() + self._copy_seconds())


class _Copy:
    def __init__(self, pool: SimHostPool, blocks: list[int], slots: list[int], done_at: float) -> None:
        self._pool, self._blocks, self._slots, self._done_at = pool, blocks, slots, done_at
        self._copied = False

    def done(self) -> bool:
        if not self._copied and self._pool._clock() >= self._done_at:
            self._copied = True  # the side stream copied what the device blocks held when it ran
            for block, slot in zip(self._blocks, self._slots, strict=True):
                self._pool.memory.write(slot, self._pool.device.at(block, self._done_at))
        return self._copied


def install_host_pool(worker: SimWorker, pool: SimHostPool, rank: int) -> None:
    """What ``TurnkvWorkerMixin.register_kv_caches`` leaves behind once a pool is allocated and registered (private
    state: update here when the worker's host-tier fields change)."""
    worker._turnkv_pool = pool
    size = pool.blocks * sum(pool.block_lens)
    worker._turnkv_host_tier = (rank, size, size, "")


def admission_note(scheduler: SimScheduler, request_id: str) -> str:
    """Prefill's admission record of the request (``connector.admission``), for the trace: its verdict and, for a
    pull, its read plan's tier, inline flag, deadline and seal (private state, diagnostics only)."""
    ledger = getattr(scheduler, "_admissions", None)
    admission = ledger.get(request_id) if ledger is not None else None
    if admission is None:
        return "-"
    parts = [str(admission.verdict.value)]
    if admission.pulls:
        plan = admission.plan
        parts += [str(plan.tier)] + (["inline"] if plan.inline else []) + \
            (["read-by"] if plan.deadline is not None else []) + (["sealed"] if plan.seal is not None else [])
    return ",".join(parts)


@contextlib.contextmanager
def kv_transfer_group(worker: Any) -> Iterator[None]:
    """``vllm.distributed.kv_transfer.get_kv_transfer_group()`` answering with ``worker`` (the lease route's worker
    function looks its worker up there)."""
    module = sys.modules.get("vllm.distributed.kv_transfer")
    if module is None:
        import vllm.distributed.kv_transfer as module
    saved = module.get_kv_transfer_group
    module.get_kv_transfer_group = lambda: types.SimpleNamespace(connector_worker=worker)
    try:
        yield
    finally:
        module.get_kv_transfer_group = saved


def renew(worker: SimWorker, request_ids: list[str], ttl: float, boots: dict[str, str | None]) -> dict[str, float]:
    """The lease route on one worker rank (``connector.leases.renew_on_worker``, as ``collective_rpc`` runs it)."""
    from connector.leases import renew_on_worker

    with kv_transfer_group(worker):
        return renew_on_worker(None, request_ids, ttl, boots)


def reload_tunables(scheduler: SimScheduler, values: dict[str, int | float]) -> None:
    """What the tunables file's hot reload applies (``TunablesFile`` calls this method; its poll is paced by the
    real monotonic clock, so the schedule applies the values directly)."""
    scheduler._apply_tunables(values)
