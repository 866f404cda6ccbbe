"""Paths a GPU or Neuron engine takes that the CPU suites never reach, checked without a device.

Each test runs the connector as on a non-CPU platform (or with tensor parallelism above 1) and checks the
setting the engine would get: the NIXL progress-thread delay, the thread-sync mode of push + bi-directional
agents, and the decode-boot check on every tensor-parallel rank.
"""

from __future__ import annotations

import os
import types

import pytest

pytest.importorskip("vllm")

import msgspec
from nixl._api import nixl_thread_sync_t
from vllm.distributed import nixl_utils
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker

from connector import cpu, plugin, scheduler
from connector.admission import ReadPlan
from connector.push_worker import PushBidiWorker
from connector.worker import TurnkvWorkerMixin
from turnkv import platforms


class FakeBindings(types.ModuleType):
    """nixl's C++ bindings, recording the progress-thread settings each agent is created with."""

    def __init__(self) -> None:
        super().__init__("nixl_bindings")
        self.agents: list[tuple[bool, int]] = []

    def nixlAgent(self, name: str, config: types.SimpleNamespace) -> str:
        self.agents.append((config.useProgThread, config.pthrDelay))
        return name


def recording_config(calls: list[dict]):
    def nixl_agent_config(*args, **kwargs):
        calls.append(kwargs)
        return kwargs

    return nixl_agent_config


@pytest.fixture
def gpu_platform(monkeypatch):
    """The plugin as it runs on a GPU engine: not the CPU platform, registered afresh, only NIXL patches."""
    import nixl._api as nixl_api

    monkeypatch.setattr(cpu, "_is_cpu_platform", lambda: False)
    monkeypatch.setattr(plugin, "_registered", False)
    # An earlier test may have loaded vLLM's plugins on this CPU machine (CPU patches in place): start from upstream's.
    monkeypatch.setattr(base_worker, "os", os)
    monkeypatch.setenv("TURNKV_PATCHES", "nixl,cpu")
    calls: list[dict] = []
    config = recording_config(calls)
    monkeypatch.setattr(nixl_utils, "nixl_agent_config", config)
    monkeypatch.setattr(base_worker, "nixl_agent_config", config)
    bindings = FakeBindings()
    monkeypatch.setattr(nixl_api, "nixlBind", bindings)
    monkeypatch.setattr(nixl_api.nixl_agent, "__init__", nixl_api.nixl_agent.__init__)  # the plugin wraps it
    return types.SimpleNamespace(calls=calls, bindings=bindings, nixl_api=nixl_api)


def test_progress_thread_delay_is_set_on_a_gpu_platform(gpu_platform, monkeypatch):
    monkeypatch.setenv("TURNKV_NIXL_PROGRESS_US", "1000")
    plugin.register()
    base_worker.nixl_agent_config(num_threads=4, capture_telemetry=True)
    assert gpu_platform.calls[-1]["enable_prog_thread"] is True
    gpu_platform.nixl_api.nixlBind.nixlAgent("a", types.SimpleNamespace(useProgThread=True, pthrDelay=0))
    assert gpu_platform.bindings.agents == [(True, 1000)]  # not NIXL's zero-delay busy loop


def test_no_core_pinning_change_off_the_cpu_platform(gpu_platform):
    plugin.register()
    assert not isinstance(base_worker.os, cpu._NoPinOs)


def build_push_worker(monkeypatch, connector: str, bidirectional: bool) -> list[dict]:
    """PushBidiWorker's construction with upstream's constructor reduced to the agent-config call it makes."""
    calls: list[dict] = []
    monkeypatch.setattr(base_worker, "nixl_agent_config", recording_config(calls))

    def upstream_init(self, vllm_config, engine_id, kv_cache_config):
        base_worker.nixl_agent_config(num_threads=4, capture_telemetry=True)

    monkeypatch.setattr(NixlPushConnectorWorker, "__init__", upstream_init)
    transfer = types.SimpleNamespace(kv_connector=connector,
                                     kv_connector_extra_config={"bidirectional_kv_xfer": bidirectional})
    PushBidiWorker(types.SimpleNamespace(kv_transfer_config=transfer), "engine-0", None)
    return calls


@pytest.mark.parametrize("cpu_platform", [False, True])
def test_push_bidirectional_agents_use_strict_thread_sync_on_any_platform(monkeypatch, cpu_platform):
    monkeypatch.setattr(cpu, "_is_cpu_platform", lambda: cpu_platform)
    calls = build_push_worker(monkeypatch, "TurnkvPushConnector", bidirectional=True)
    assert calls and calls[-1].get("sync_mode") == nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT


def test_push_without_bidirectional_keeps_nixls_default_sync(monkeypatch):
    calls = build_push_worker(monkeypatch, "TurnkvPushConnector", bidirectional=False)
    assert calls and "sync_mode" not in calls[-1]
    # and the module's config function is restored after construction
    assert base_worker.nixl_agent_config.__name__ == "nixl_agent_config"


# --- decode-boot check on every tensor-parallel rank ------------------------------------------------------


def handshake_payloads(agents: list[bytes]) -> dict[tuple[int, int], types.SimpleNamespace]:
    """What a decode engine's scheduler serves in the NIXL handshake: one payload per (pp, tp) rank."""
    def payload(rank: int, agent: bytes) -> types.SimpleNamespace:
        meta = NixlAgentMetadata(engine_id="decode-0", agent_metadata=agent, kv_caches_base_addr=[0], device_id=rank,
                                 num_blocks=8, block_lens=[1], block_strides=[1], kv_cache_layout="HND",
                                 block_size=128, ssm_sizes=(0, 0), attn_backend_name="CPU_ATTN",
                                 physical_blocks_per_logical_kv_block=1)
        return types.SimpleNamespace(agent_metadata_bytes=msgspec.msgpack.encode(meta))

    return {(0, rank): payload(rank, agent) for rank, agent in enumerate(agents)}


class FakeUpstreamWorker:
    def __init__(self) -> None:
        self.read: list[str] = []
        self.failed: list[str] = []
        self.xfer_stats = types.SimpleNamespace(data={})
        self._remote_agents: dict = {}
        self._recv_failures: set[str] = set()

    def add_remote_agent(self, meta, remote_tp_rank=0, *args, **kwargs):
        self._remote_agents.setdefault(meta.engine_id, {})[(0, remote_tp_rank)] = f"agent-{remote_tp_rank}"
        return f"agent-{remote_tp_rank}"

    def start_load_kv(self, metadata):
        pass

    def _read_blocks_for_req(self, req_id, meta):
        self.read.append(req_id)

    def _handle_failed_transfer(self, req_id, handle, failed=None, record_failed_transfer=True):
        self.failed.append(req_id)
        return True

    def _mark_remote_engine_invalid(self, engine_id, now):
        self.invalidated = [*getattr(self, "invalidated", []), engine_id]


class Worker(TurnkvWorkerMixin, FakeUpstreamWorker):
    pass


@pytest.mark.parametrize("remote_rank", [0, 1])
def test_every_tensor_parallel_rank_refuses_a_restarted_decode(remote_rank):
    """TP=2 on both sides: prefill rank i reads decode rank i, so rank 1 must check decode's rank 1 too."""
    offered = scheduler._boot_of(handshake_payloads([b"rank0-boot1", b"rank1-boot1"]))  # decode's stamp
    restarted = [b"rank0-boot2", b"rank1-boot2"]
    meta = types.SimpleNamespace(remote=types.SimpleNamespace(engine_id="decode-0"))

    stale = Worker()
    stale.add_remote_agent(types.SimpleNamespace(engine_id="decode-0", agent_metadata=restarted[remote_rank]),
                           remote_rank)
    stale.start_load_kv(types.SimpleNamespace(turnkv_reads={"turn-2": ReadPlan(boot=offered)}))
    stale._read_blocks_for_req("turn-2", meta)
    assert stale.failed == ["turn-2"] and stale.read == []

    same = Worker()
    same.add_remote_agent(types.SimpleNamespace(engine_id="decode-0",
                                                agent_metadata=[b"rank0-boot1", b"rank1-boot1"][remote_rank]),
                          remote_rank)
    same.start_load_kv(types.SimpleNamespace(turnkv_reads={"turn-2": ReadPlan(boot=offered)}))
    same._read_blocks_for_req("turn-2", meta)
    assert same.read == ["turn-2"] and same.failed == []


def test_cpu_engines_keep_strict_sync_for_every_mode(gpu_platform, monkeypatch):
    """As the engine suites have always run them: CPU agents get the strict mode and the delayed progress thread."""
    monkeypatch.setattr(cpu, "_is_cpu_platform", lambda: True)
    monkeypatch.setattr(base_worker, "os", base_worker.os)  # restored after the test
    plugin.register()
    base_worker.nixl_agent_config(num_threads=4)
    assert gpu_platform.calls[-1]["sync_mode"] == nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    assert gpu_platform.calls[-1]["enable_prog_thread"] is True


def test_a_handshake_with_a_restarted_decode_is_dropped_once_so_its_new_offers_are_read():
    """Decode restarted after prefill handshook: upstream kept the dead process's agent and every offer of the
    new process failed the boot check (298 recomputes in a 210 s fault run). The stale handshake is released
    (re-handshake on the next read), once per handshake; offers of the old process do not drop the new one."""
    old, new = [b"rank0-boot1"], [b"rank0-boot2"]
    new_offer = scheduler._boot_of(handshake_payloads(new))
    old_offer = scheduler._boot_of(handshake_payloads(old))
    meta = types.SimpleNamespace(remote=types.SimpleNamespace(engine_id="decode-0"))
    w = Worker()
    w.add_remote_agent(types.SimpleNamespace(engine_id="decode-0", agent_metadata=old[0]), 0)
    w.start_load_kv(types.SimpleNamespace(turnkv_reads={"t1": ReadPlan(boot=new_offer),
                                                        "t2": ReadPlan(boot=new_offer)}))
    w._read_blocks_for_req("t1", meta)
    w._read_blocks_for_req("t2", meta)
    assert w.failed == ["t1", "t2"] and w.invalidated == ["decode-0"]  # released once, not per read
    # upstream released it; the next read handshook with the new process: its offers are read
    w._remote_agents.clear()
    w.add_remote_agent(types.SimpleNamespace(engine_id="decode-0", agent_metadata=new[0]), 0)
    w.start_load_kv(types.SimpleNamespace(turnkv_reads={"t3": ReadPlan(boot=new_offer), "t4": ReadPlan(boot=old_offer),
                                                        "t5": ReadPlan(boot=old_offer)}))
    w._read_blocks_for_req("t3", meta)
    assert w.read == ["t3"]
    w._read_blocks_for_req("t4", meta)  # offers of the dead process: refused, the new handshake kept
    w._read_blocks_for_req("t5", meta)
    assert w.failed[-2:] == ["t4", "t5"] and w.invalidated == ["decode-0"]


def test_an_engine_a_read_failed_from_is_handshaken_again():
    """Prefill restarted under the same engine id and address: upstream kept the dead agent (its local metadata
    still exists), so decode's every READ from it failed (307 in a 210 s fault run). turnkv drops it."""

    class Upstream(FakeUpstreamWorker):
        _TRANSFER_MODE = "pull"

        def __init__(self):
            super().__init__()
            self._failed_remote_engines: set[str] = set()
            self._invalid_remote_engines: set[str] = set()
            self.cleanups = 0

        def _mark_remote_engine_invalid(self, engine_id, now):
            super()._mark_remote_engine_invalid(engine_id, now)
            self._invalid_remote_engines.add(engine_id)

        def _cleanup_remote_engines(self):
            self.cleanups += 1
            self._failed_remote_engines.clear()

    class W(TurnkvWorkerMixin, Upstream):
        pass

    w = W()
    w.add_remote_agent(types.SimpleNamespace(engine_id="prefill-1", agent_metadata=b"boot1"), 0)
    w._cleanup_remote_engines()
    assert not hasattr(w, "invalidated") and w.cleanups == 1  # nothing failed: nothing dropped
    w._failed_remote_engines.update({"prefill-1", "gone"})  # "gone": no handshake left to drop
    w._cleanup_remote_engines()
    assert w.invalidated == ["prefill-1"] and w.cleanups == 2
    w._failed_remote_engines.add("prefill-1")  # already invalid: upstream's backoff decides
    w._cleanup_remote_engines()
    assert w.invalidated == ["prefill-1"]


def _push_worker_without_engines() -> PushBidiWorker:
    """A PushBidiWorker with just the state the restarted-peer path touches (no agents, no threads)."""
    import threading

    w = object.__new__(PushBidiWorker)
    w._turnkv_peer_lock = threading.RLock()
    w._turnkv_stale_peers, w._turnkv_sending_to = set(), None
    w._handshake_lock = threading.Lock()
    w._remote_agents = {"decode-0": {(0, 0): "old-agent"}, "decode-1": {(0, 0): "agent"}}
    w._handshake_futures, w._invalid_remote_engines = {}, set()
    w._recving_metadata, w._recving_transfers = {}, {}
    w._sending_transfers_lock, w._sending_transfers, w._turnkv_writing_to = threading.Lock(), {}, {}
    w.engine_id = "prefill-0"
    w.released = []
    w._cleanup_remote_engine = lambda eid, log_eviction=True: (w.released.append(eid), w._remote_agents.pop(eid))
    return w


def test_a_push_peer_that_restarted_is_handshaken_again(monkeypatch):
    """Push + bi-directional, decode-0 restarted under the same id and address: upstream kept the dead
    process's handshake (a TODO upstream), so every WRITE to it failed and each decode leg paired with it
    waited 30 s for KV (13 legs in a 150 s fault run). A failed WRITE marks it stale; the engine thread
    releases the handshake once nothing reads from it, so the next WRITE handshakes with the new process."""
    monkeypatch.setattr(NixlPushConnectorWorker, "_cleanup_remote_engines", lambda self: None)
    w = _push_worker_without_engines()
    w._cleanup_remote_engines()
    assert w.released == []  # nothing failed: nothing released, and no lock taken on the engine's step
    w._log_failure("transfer_setup_failed", "req-1", msg="Push WRITE submission failed", dst_engine_id="decode-0")
    # a READ of decode-0's retained blocks is still in flight: wait for it
    w._recving_metadata["r"] = types.SimpleNamespace(remote=types.SimpleNamespace(engine_id="decode-0"))
    w._recving_transfers["r"] = [1]
    w._cleanup_remote_engines()
    assert w.released == [] and w._turnkv_stale_peers == {"decode-0"}
    w._recving_transfers.clear()
    w._cleanup_remote_engines()
    assert w.released == ["decode-0"] and "decode-1" in w._remote_agents and not w._turnkv_stale_peers
    w._cleanup_remote_engines()
    assert w.released == ["decode-0"]  # once


def test_a_failed_registration_marks_the_prefill_it_was_for():
    """Decode's side: a PUSH_REG to a restarted prefill fails inside upstream's send; the peer is the one
    the registration was for."""
    w = _push_worker_without_engines()

    def upstream_send(self, req_id, reg_data):
        self._log_failure("push_reg_notif_failed", req_id, error=RuntimeError("NIXL_ERR_REMOTE_DISCONNECT"))

    with pytest.MonkeyPatch.context() as m:
        m.setattr(NixlPushConnectorWorker, "_do_send_reg_notif", upstream_send)
        w._do_send_reg_notif("req-2", {"remote_engine_id": "prefill-1"})
    assert w._turnkv_stale_peers == {"prefill-1"} and w._turnkv_sending_to is None
    w._log_failure("push_handshake_failed", "req-3", error=RuntimeError("timeout"))  # not a stale handshake
    assert w._turnkv_stale_peers == {"prefill-1"}


def test_a_peer_of_another_block_size_is_refused_at_the_handshake(monkeypatch):
    """Prefill 32 against decode 128 changed answers on the CPU build (bench.shapes): the handshake fails with a
    message naming both sizes and the fix, before upstream records the peer; equal sizes, unknown sizes and the
    explicit opt-in pass."""
    monkeypatch.delenv(platforms.ALLOW_ENV, raising=False)
    worker = Worker()
    worker.block_size = 128
    with pytest.raises(RuntimeError, match=r"prefill-0 has KV block size 32, this engine 128.*--block-size"):
        worker.add_remote_agent(types.SimpleNamespace(engine_id="prefill-0", agent_metadata=b"p", block_size=32), 0)
    assert ("prefill-0", 0) not in worker._turnkv_remote_meta
    worker.add_remote_agent(types.SimpleNamespace(engine_id="prefill-1", agent_metadata=b"q", block_size=128), 0)
    worker.add_remote_agent(types.SimpleNamespace(engine_id="prefill-2", agent_metadata=b"r"), 0)  # an older peer
    monkeypatch.setenv(platforms.ALLOW_ENV, "neuron, block-size")
    worker.add_remote_agent(types.SimpleNamespace(engine_id="prefill-0", agent_metadata=b"p", block_size=32), 0)
    assert {k[0] for k in worker._turnkv_remote_meta} == {"prefill-0", "prefill-1", "prefill-2"}


def test_the_host_tier_is_declined_on_a_nixl_worker_without_per_region_layout():
    """vLLM 0.29's worker (the Neuron image's) has no ``region_num_blocks``: the host pool used to crash the engine
    at start (AttributeError in register_kv_caches, caught by `make test`'s vLLM 0.29 run); now the budget is
    declined with a reason, and the engine starts without a host tier."""
    old = Worker()
    assert not hasattr(old, "region_num_blocks")
    assert "vLLM 0.29" in old._turnkv_host_tier_unsupported()
    new = Worker()
    new.region_num_blocks = [1024, 1024]
    assert new._turnkv_host_tier_unsupported() is None
    new.region_num_blocks = [1024, 512]
    assert "different block counts" in new._turnkv_host_tier_unsupported()
