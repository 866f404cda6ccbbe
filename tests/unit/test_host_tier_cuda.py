"""The host tier's pool, registration and copy (``connector.host_tier.HostPool``) as an engine runs them, in
``make gpu-check`` (against the CUDA wheel) and the unit suite: the CPU branch whole; the CUDA branch's pinning
(``cudaHostRegister`` of the exact size) through a CUDA runtime that answers as the real one does; the CUDA branch's
side-stream copy where a GPU is present, skipped with the reason elsewhere; and the doctor's pool probe between two
real NIXL agents (UCX here, LIBFABRIC on a node)."""

from __future__ import annotations

import json
import types

import pytest

torch = pytest.importorskip("torch")

from connector import host_pool_plan as hp  # noqa: E402
from connector import host_tier  # noqa: E402
from turnkv import fabric_limits as fl  # noqa: E402

NO_GPU = ("no CUDA device on this machine: the side-stream copy into pinned memory and its event run only on a GPU "
          "node (make gpu-smoke there; turnkv doctor's host-tier-registration pins and reads the pools)")


class RecordingAgent:
    """NIXL's registration calls: records each region registered."""

    def __init__(self) -> None:
        self.registered: list[tuple[int, int]] = []

    def get_reg_descs(self, regions, mem_type):
        assert mem_type == "DRAM"
        return [(int(a), int(n)) for a, n, _d, _s in regions]

    def register_memory(self, descs, backends=None):
        self.registered.extend(descs)

    def deregister_memory(self, descs):
        for d in descs:
            self.registered.remove(d)


def fake_worker(device: str, layers: int = 3, blocks: int = 10, block_len: int = 256) -> types.SimpleNamespace:
    """What HostPool reads of vLLM's NIXL worker: per-layer KV tensors and their registered regions."""
    caches = {f"layer.{i}": torch.arange(blocks * block_len, dtype=torch.int64, device=device).add_(1000 * i)
              .to(torch.uint8).view(blocks, block_len) for i in range(layers)}
    return types.SimpleNamespace(
        engine_id="decode-0", tp_rank=0, device_kv_caches=caches, block_len_per_layer=[block_len] * layers,
        block_stride_per_layer=[block_len] * layers, region_num_blocks=[blocks] * layers,
        kv_caches_base_addr={"decode-0": {0: [t.data_ptr() for t in caches.values()]}},
        nixl_wrapper=RecordingAgent(), nixl_backends=["UCX"])


def small_plan(worker, slots: int, max_region: int) -> hp.PoolPlan:
    limits = fl.FabricLimits("small", 1 << 20, max_region, 1 << 40, 1)
    plan = hp.plan_rank(slots * sum(worker.block_len_per_layer), worker.block_len_per_layer, fl.PAGE_4K,
                        hp.NumaLayout.single(1 << 40), limits)
    assert plan.blocks == slots
    return plan


def test_the_cpu_pool_registers_its_planned_regions_and_copies_blocks_into_slots():
    w = fake_worker("cpu")
    plan = small_plan(w, slots=6, max_region=700)  # 6 slots x 3 layers x 256 B, cut into regions of <= 700 B
    pool = host_tier.HostPool(w, plan)
    assert pool.tensor.numel() == plan.pool_bytes == 6 * 3 * 256
    assert w.nixl_wrapper.registered == [(pool.base + r.offset, r.nbytes) for r in plan.regions]
    assert len(plan.regions) > 3 and all(r.nbytes <= 700 for r in plan.regions)
    copy = pool.copy_in([7, 2, 3], [0, 4, 5])
    assert copy.done()
    for layer, (offset, cache) in enumerate(zip(hp.region_bases(6, plan.block_lens), w.device_kv_caches.values(),
                                                strict=True)):
        for block, slot in ((7, 0), (2, 4), (3, 5)):
            got = pool.tensor[offset + slot * 256: offset + (slot + 1) * 256]
            assert torch.equal(got, cache[block]), (layer, block, slot)


class FakeCudart:
    """``torch.cuda.cudart()``'s host-registration calls, answering as the CUDA runtime does (0: cudaSuccess; 2:
    cudaErrorMemoryAllocation when asked for more than it can lock)."""

    def __init__(self, lockable: int) -> None:
        self.lockable, self.calls = lockable, []

    def cudaHostRegister(self, ptr, size, flags):
        self.calls.append(("register", ptr, size, flags))
        return 0 if size <= self.lockable else 2

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return 0


def test_the_cuda_branch_pins_exactly_the_pool_and_a_refused_pin_leaves_nothing(monkeypatch):
    runtime = FakeCudart(lockable=64 * fl.MIB)
    monkeypatch.setattr(host_tier, "_cudart", lambda: runtime)
    size = 48 * fl.MIB + 3 * fl.PAGE_4K  # not a power of two: PyTorch's pinned allocator would lock 64 MiB
    buffer = host_tier.HostBuffer(size, fl.PAGE_4K, numa_node=0, pin=True)
    assert runtime.calls == [("register", buffer.base, size, 0)] and buffer.pinned
    buffer.close()
    assert runtime.calls[-1] == ("unregister", buffer.base)
    with pytest.raises(MemoryError, match="cudaHostRegister of 100663296 bytes failed \\(CUDA error 2\\)"):
        host_tier.HostBuffer(96 * fl.MIB, fl.PAGE_4K, pin=True)
    assert runtime.calls[-1][0] == "register"  # refused: nothing to unregister, the mapping released


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_the_cuda_pool_copies_on_a_side_stream_and_its_event_says_when_the_turn_is_hosted():
    w = fake_worker("cuda:0", layers=4, blocks=64, block_len=4096)
    plan = small_plan(w, slots=16, max_region=64 * 4096)
    pool = host_tier.HostPool(w, plan)
    assert pool.cuda and pool._buffer is not None and pool._buffer.pinned
    copy = pool.copy_in([5, 6, 7, 40], [0, 1, 2, 9])
    assert copy.event is not None
    copy.event.synchronize()
    assert copy.done()
    for offset, cache in zip(hp.region_bases(16, plan.block_lens), w.device_kv_caches.values(), strict=True):
        for block, slot in ((5, 0), (6, 1), (7, 2), (40, 9)):
            assert torch.equal(pool.tensor[offset + slot * 4096: offset + (slot + 1) * 4096], cache[block].cpu())
    pool.close()


def test_the_doctor_pool_probe_registers_and_reads_between_two_nixl_agents(capsys):
    pytest.importorskip("nixl")
    from connector import pool_probe

    try:
        assert pool_probe.main(["--budget-mib", "1024", "--tp", "2", "--backend", "UCX", "--slot-bytes",
                                "65536"]) == 0
    except Exception as exc:  # no UCX backend in this NIXL build
        pytest.skip(f"NIXL's UCX backend is not available here: {exc}")
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    if "error" in result and "UCX" in result["error"]:
        pytest.skip(f"NIXL's UCX backend is not available here: {result['error']}")
    assert "error" not in result, result
    assert result["granted_bytes"] == result["configured_bytes"] == 1024 * fl.MIB
    assert [r["read_descriptors"] for r in result["ranks"]] == [2, 2]


class RefusingAgent(RecordingAgent):
    """A NIXL agent whose fabric refuses a region over ``limit`` bytes (as EFA's fi_mr_reg does past its limits)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit, self.refused = limit, []

    def register_memory(self, descs, backends=None):
        for _address, nbytes in descs:
            if nbytes > self.limit:
                self.refused.append(nbytes)
                raise RuntimeError(f"NIXL_ERR_BACKEND: fi_mr_reg({nbytes}): Cannot allocate memory")
        super().register_memory(descs, backends)

    def get_agent_metadata(self):
        return b"agent-with-pool"


def engine_worker(agent, budget_mib: int = 1):
    """A decode rank's worker as vLLM 0.32's NIXL worker leaves it after registering its KV caches (CPU)."""
    import msgspec
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata, NixlHandshakePayload

    from connector.worker import TurnkvWorkerMixin

    caches = fake_worker("cpu", layers=3, blocks=10, block_len=256)

    class Upstream:
        def __init__(self) -> None:
            self.__dict__.update(vars(caches))
            self.nixl_wrapper = agent
            self.vllm_config = types.SimpleNamespace(
                kv_transfer_config=types.SimpleNamespace(kv_connector_extra_config={"host_kv_budget_mib": budget_mib}),
                parallel_config=types.SimpleNamespace(tensor_parallel_size=1))
            self._registered_descs, self.dst_num_blocks, self.dst_region_num_blocks = [], {}, {}
            meta = NixlAgentMetadata("decode-0", b"agent", [1], 0, 10, [256] * 3, [256] * 3, "NHD", 16, (0, 0), "x", 1)
            self.xfer_handshake_metadata = NixlHandshakePayload(
                compatibility_hash="h", agent_metadata_bytes=msgspec.msgpack.Encoder().encode(meta))

        def register_kv_caches(self, kv_caches):
            pass

    class Worker(TurnkvWorkerMixin, Upstream):
        pass

    return Worker()


class Records(list):
    """Records of the connector's logger (vLLM 0.29's logging config does not propagate to pytest's caplog)."""

    def __enter__(self):
        import logging

        self._handler = logging.Handler(logging.INFO)
        self._handler.emit = self.append
        self._logger = logging.getLogger("vllm.turnkv.connector")
        self._level = self._logger.level
        self._logger.setLevel(logging.INFO)
        self._logger.addHandler(self._handler)
        return self

    def __exit__(self, *exc):
        self._logger.removeHandler(self._handler)
        self._logger.setLevel(self._level)

    @property
    def records(self):
        for record in self:
            record.message = record.getMessage()
        return self


def test_a_refused_registration_shrinks_the_pool_loudly_and_the_engine_keeps_serving(monkeypatch):
    monkeypatch.setattr(hp, "MIN_POOL_BYTES", 64 * 1024)
    agent = RefusingAgent(limit=300 * 1024)
    w = engine_worker(agent)
    with Records() as caplog:
        w.register_kv_caches({})
    assert agent.refused == [1365 * 768, 682 * 768]  # 1 MiB in whole 768-byte slots, then halved
    assert w._turnkv_pool is not None and w._turnkv_pool.blocks == 341
    assert agent.registered == [(w._turnkv_pool.base, 341 * 768)]
    assert w._turnkv_host_tier == (0, fl.MIB, 341 * 768, "")
    assert sum("the node refused" in r.message for r in caplog.records) == 2
    assert any(r.levelname == "WARNING" and "SHRUNK: 0.25 MiB of the configured 1.00 MiB" in r.message
               for r in caplog.records)
    meta = w.build_turnkv_meta()
    assert meta.host_tier == [(0, fl.MIB, 341 * 768, "")] and meta.host_pools == [(0, w._turnkv_pool.base, 341)]


def test_a_node_that_registers_nothing_serves_without_the_tier_and_says_so(monkeypatch):
    monkeypatch.setattr(hp, "MIN_POOL_BYTES", 64 * 1024)
    agent = RefusingAgent(limit=1024)
    w = engine_worker(agent)
    with Records() as caplog:
        w.register_kv_caches({})  # no exception: the engine starts, no restart loop
    assert w._turnkv_pool is None and agent.registered == []
    rank, configured, granted, why = w._turnkv_host_tier
    assert (rank, configured, granted) == (0, fl.MIB, 0) and "down to 0.06 MiB a rank" in why and "refusals" in why
    assert any(r.levelname == "ERROR" and "HOST TIER OFF" in r.message for r in caplog.records)
    assert w.build_turnkv_meta().host_tier == [(0, fl.MIB, 0, why)]
