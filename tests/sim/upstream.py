"""The upstream slices the connector's mixins run over in the simulation.

- Scheduler: vLLM 0.32's own ``NixlPullConnectorScheduler`` (its ``get_num_new_matched_tokens``,
  ``update_state_after_alloc``, ``request_finished``, ``build_connector_meta`` run as shipped); only its constructor
  (config parsing, platform probes) and the ZMQ handshake listener are replaced.
- Worker: a model of upstream's pull worker (``base_worker.py`` / ``pull_worker.py``), following its structure where
  the mixin hooks in: background handshakes, ``_read_blocks_for_req`` -> ``_read_blocks`` (per-engine block counts
  read through the per-thread views, descriptor ids per region), completion polling, failures reported with their
  blocks, read notifications counted per consumer, leases reaped on the perf clock, invalid peers dropped. Its NIXL
  agent is :class:`tests.sim.fabric.AgentView`, which moves labelled blocks.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import types
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata, NixlHandshakePayload
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import ReadSpec

from tests.sim.fabric import BLOCK_LEN, REGIONS, AgentView, Memory, NixlError

#: upstream's pull_worker._KV_BLOCKS_EXPIRY_SAFETY_MARGIN
EXPIRY_SAFETY_MARGIN = 5.0


def vllm_config(tp: int, block_size: int, extra: dict[str, Any]) -> Any:
    """The slice of a ``VllmConfig`` the connector reads (tunables come in ``kv_connector_extra_config``)."""
    return types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(tensor_parallel_size=tp, decode_context_parallel_size=1,
                                              data_parallel_index=0, pipeline_parallel_size=1),
        cache_config=types.SimpleNamespace(block_size=block_size, cache_dtype="auto"),
        kv_transfer_config=types.SimpleNamespace(kv_connector_extra_config=dict(extra)),
        model_config=types.SimpleNamespace(model="sim-model", revision=None, tokenizer="sim", dtype="bf16",
                                           tokenizer_revision=None, quantization=None, hf_config=None),
        num_prefill_lookahead_tokens=1)


def kv_cache_config(num_blocks: int) -> Any:
    group = types.SimpleNamespace(kv_cache_spec=None)
    return types.SimpleNamespace(num_blocks=num_blocks, kv_cache_groups=[group], transfer_groups=[group],
                                 kv_cache_tensors=[types.SimpleNamespace(size=num_blocks * BLOCK_LEN * REGIONS)],
                                 select_transfer_block_ids=lambda ids: tuple(ids), has_mamba_layers=False)


class SimBlocks:
    """``KVCacheBlocks`` of one request (one KV cache group): its blocks, the first ``hashed`` of them cached."""

    def __init__(self, ids: list[int], hashed: int) -> None:
        self.ids, self.hashed = list(ids), hashed
        self.blocks = ([types.SimpleNamespace(block_hash=(1 if i < hashed else None), is_null=False)
                        for i in range(len(ids))],)

    def get_unhashed_block_ids_all_groups(self) -> tuple[list[int], ...]:
        return (self.ids[self.hashed:],)

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (list(self.ids),)


class UpstreamScheduler(NixlPullConnectorScheduler):
    """vLLM's pull scheduler with the constructor's state set directly (no config parsing, no ZMQ listener)."""

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.vllm_config = vllm_config
        self.transfer_tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.block_size = vllm_config.cache_config.block_size
        self.engine_id = engine_id
        self.kv_cache_config = kv_cache_config
        self.side_channel_host, self.side_channel_port = f"host-{engine_id}", 5600
        self._kv_lease_duration = int(extra.get("kv_lease_duration", 30))
        self._heartbeat_interval = self._kv_lease_duration // 6
        self.use_host_buffer = False
        self._is_hma_required = self._has_mamba = self._bounded_replay = False
        self._nixl_handshake_listener_t = None
        self._stop_event = threading.Event()
        self._reqs_need_recv: dict[str, Any] = {}
        self._reqs_need_save: dict[str, Any] = {}
        self._reqs_need_send: dict[str, float] = {}
        self._reqs_in_batch: set[str] = set()
        self._reqs_not_processed: set[str] = set()
        self._heartbeat_by_engine: dict[str, Any] = {}
        self._heartbeat_req_engine: dict[str, Any] = {}
        self._last_heartbeat_time = 0.0
        self.blocks_per_sw, self._ssm_spec_blocks = [0], [None]
        self.kv_recompute_threshold = int(extra.get("kv_recompute_threshold", 64))
        self.is_bidirectional_kv_xfer_enabled = True
        self.decoder_kv_blocks_ttl = extra.get("decoder_kv_blocks_ttl", 480)
        self.handshake_metadata: dict[tuple[int, int], Any] = {}

    def set_xfer_handshake_metadata(self, metadata: dict[tuple[int, int], Any]) -> None:
        self.handshake_metadata = dict(metadata)  # served by the simulated directory, not a ZMQ listener


def agent_metadata(engine_id: str, agent: str, memory: Memory, block_size: int) -> NixlAgentMetadata:
    """What a rank's handshake publishes: its agent and its device cache's regions."""
    return NixlAgentMetadata(
        engine_id=engine_id, agent_metadata=agent.encode(), kv_caches_base_addr=memory.region_bases(), device_id=0,
        num_blocks=memory.blocks, block_lens=[BLOCK_LEN] * REGIONS, block_strides=[BLOCK_LEN] * REGIONS,
        kv_cache_layout="NHD", block_size=block_size, ssm_sizes=(0, 0), attn_backend_name="sim",
        physical_blocks_per_logical_kv_block=1, region_num_blocks=[memory.blocks] * REGIONS,
        region_mem_types=["VRAM"] * REGIONS)


def handshake_payload(meta: NixlAgentMetadata) -> NixlHandshakePayload:
    return NixlHandshakePayload(compatibility_hash="sim", agent_metadata_bytes=msgspec.msgpack.encode(meta))


class Directory:
    """Who serves each engine id now (the handshake's answer): every rank's agent metadata, or None (down)."""

    def __init__(self) -> None:
        self.engines: dict[str, list[NixlAgentMetadata] | None] = {}
        self.handshake_seconds: Callable[[], float] = lambda: 0.05


class HandshakeQueue:
    """Upstream's ``_ready_requests`` queue, filled by background handshakes: here a handshake finishes when the fake
    clock reaches its end, checked whenever the queue is looked at (as a thread would have put it there by then)."""

    def __init__(self, worker: UpstreamWorker) -> None:
        self._worker = worker
        self._items: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def put(self, item: Any) -> None:
        self._items.put(item)

    def empty(self) -> bool:
        self._worker._poll_handshakes()
        return self._items.empty()

    def get_nowait(self) -> Any:
        self._worker._poll_handshakes()
        return self._items.get_nowait()


class UpstreamWorker:
    """Upstream's NIXL pull worker, as far as the mixin and a READ's path go (see the module's docstring)."""

    _TRANSFER_MODE = "pull"

    def __init__(self, engine_id: str, rank: int, tp: int, nixl: AgentView, directory: Directory,
                 block_size: int, on_read: Callable[[str, int, str, list[int]], None]) -> None:
        self.engine_id, self.tp_rank, self.world_size = engine_id, rank, tp
        self.nixl_wrapper = nixl
        self.directory = directory
        self.block_size = block_size
        self.kv_cache_layout = "NHD"
        self._physical_blocks_per_logical_kv_block = 1
        self.vllm_config = None
        self._on_read = on_read  # (request, rank, memory kind read, remote block ids) for the tier oracle
        self._remote_agents: dict[str, dict[tuple[int, int], str]] = {}
        self._recving_metadata: dict[str, Any] = {}
        self._recving_transfers: dict[str, list[int]] = defaultdict(list)
        self._recv_failures: set[str] = set()
        self._failed_recv_reqs: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._invalid_block_ids: queue.SimpleQueue[set[int]] = queue.SimpleQueue()
        self._ready_requests = HandshakeQueue(self)
        self._handshaking: dict[str, tuple[float, list[tuple[str, Any]]]] = {}
        self._reqs_to_send: dict[str, float] = {}
        self._reqs_to_process: set[str] = set()
        self._consumer_counts: dict[str, int] = defaultdict(int)
        self._failed_remote_engines: set[str] = set()
        self._invalid_remote_engines: set[str] = set()
        local = nixl.local_memory
        self.dst_num_blocks: dict[str, int] = {engine_id: local.blocks}
        self.dst_region_num_blocks: dict[str, list[int]] = {engine_id: [local.blocks] * REGIONS}
        self.dst_xfer_side_handles: dict[str, dict[int, int]] = {}
        self.tp_mappings: dict[str, Any] = {}
        self.transfer_topo = types.SimpleNamespace(block_size_ratio=lambda size: 1)
        self._local_handle = nixl.fabric.local_list(local)
        self.xfer_handshake_metadata: Any = None

    # scheduler -> worker -------------------------------------------------------------------------

    def start_load_kv(self, metadata: Any) -> None:
        for req_id, meta in metadata.reqs_to_recv.items():
            meta.local_physical_block_ids = meta.local_block_ids
            if meta.awaiting_kvs or any(meta.local_block_ids):
                self._recving_metadata[req_id] = meta
            self._read_blocks_for_req(req_id, meta)
        while not self._ready_requests.empty():
            self._read_blocks_for_req(*self._ready_requests.get_nowait())
        for req_id in getattr(metadata, "reqs_in_batch", ()):
            self._reqs_to_process.add(req_id)
        for req_id in getattr(metadata, "reqs_not_processed", ()):
            self._reqs_to_process.discard(req_id)
        for req_id, expiry in (getattr(metadata, "reqs_to_send", None) or {}).items():
            if req_id in self._reqs_to_process:
                self._reqs_to_send[req_id] = expiry  # one fake perf clock: no rebase needed

    # reads ---------------------------------------------------------------------------------------

    def _read_blocks_for_req(self, req_id: str, meta: Any) -> None:
        engine_id = meta.remote.engine_id
        if engine_id in self._invalid_remote_engines:
            self._handle_failed_transfer(req_id, None, self._recv_failures, record_failed_transfer=False)
            return
        if engine_id not in self._remote_agents:
            self._background_nixl_handshake(req_id, engine_id, meta)
            return
        expiry = meta.remote.blocks_expiry_time
        if expiry is not None and meta.local_block_ids and any(meta.local_block_ids) \
                and time.perf_counter() + EXPIRY_SAFETY_MARGIN >= expiry:
            self._handle_failed_transfer(req_id, None, self._recv_failures, record_failed_transfer=False)
            return
        if any(len(group) > 0 for group in meta.local_block_ids):
            self._recving_transfers.setdefault(req_id, [])
        rank = self.tp_rank
        spec = ReadSpec(remote_rank=rank, local_block_ids=[list(g) for g in meta.local_block_ids],
                        remote_block_ids=[list(g) for g in meta.remote.block_ids])
        self._read_blocks(read_spec=spec, dst_engine_id=engine_id, request_id=req_id,
                          remote_request_id=meta.remote.request_id, local_xfer_side_handle=self._local_handle,
                          local_dram_handle=None, remote_xfer_side_handle=self.dst_xfer_side_handles[engine_id][rank],
                          expected_consumers=1, awaiting_kvs=meta.awaiting_kvs)

    def _read_blocks(self, read_spec: Any, dst_engine_id: str, request_id: str, remote_request_id: str,
                     local_xfer_side_handle: int, local_dram_handle: Any, remote_xfer_side_handle: int,
                     expected_consumers: int, awaiting_kvs: bool) -> bool:
        notif = f"{remote_request_id}:{expected_consumers}".encode()
        local, remote = read_spec.local_block_ids, read_spec.remote_block_ids
        if not any(len(group) > 0 for group in local):
            agent = self._remote_agents[dst_engine_id][(0, read_spec.remote_rank)]
            with contextlib.suppress(NixlError):  # upstream logs a failed notification and goes on
                self.nixl_wrapper.send_notif(agent, notif_msg=notif)
            if awaiting_kvs:
                self._recving_transfers.setdefault(request_id, [])
            return True
        remote = [list(g) for g in remote]
        for i, group in enumerate(remote):  # upstream's _apply_prefix_caching: end-trim the remote ids
            assert len(local[i]) <= len(group), "upstream: more local blocks than remote ones"
            if len(local[i]) < len(group):
                remote[i] = group[-len(local[i]):]
        remote_ids = self._desc_ids(remote[0], self.dst_num_blocks[dst_engine_id],
                                    self.dst_region_num_blocks.get(dst_engine_id))
        local_ids = self._desc_ids(local[0], self.dst_num_blocks[self.engine_id],
                                   self.dst_region_num_blocks.get(self.engine_id))
        assert len(local_ids) == len(remote_ids)
        dlist = self.nixl_wrapper.fabric.lists.get(remote_xfer_side_handle)
        self._on_read(request_id, self.tp_rank, dlist.memory.kind if dlist else "?", list(remote[0]))
        try:
            handle = self.nixl_wrapper.make_prepped_xfer("READ", local_xfer_side_handle, local_ids,
                                                         remote_xfer_side_handle, remote_ids, notif_msg=notif,
                                                         tag=request_id)
            self.nixl_wrapper.transfer(handle)
            self._recving_transfers[request_id].append(handle)
            return True
        except NixlError:  # upstream catches every exception here; the fake agent raises only NIXL's errors
            self._handle_failed_transfer(request_id, None, self._recv_failures)
            return False

    @staticmethod
    def _desc_ids(blocks: list[int], num_blocks: int, regions: list[int] | None) -> list[int]:
        counts = list(regions) if regions else [num_blocks] * REGIONS
        offsets = [sum(counts[:r]) for r in range(len(counts))]
        return [offsets[r] + b for r in range(len(counts)) for b in blocks]

    # completions ---------------------------------------------------------------------------------

    def _pop_done_transfers(self, transfers: dict[str, list[int]]) -> tuple[set[str], set[str]]:
        done, failed = set(), set()
        for req_id, handles in list(transfers.items()):
            in_progress = []
            for handle in handles:
                try:
                    state = self.nixl_wrapper.check_xfer_state(handle)
                    if state == "DONE":
                        self.xfer_stats.record_transfer(self.nixl_wrapper.get_xfer_telemetry(handle))
                    elif state == "PROC":
                        in_progress.append(handle)
                    else:
                        self._handle_failed_transfer(req_id, handle, failed)
                except NixlError:
                    self._handle_failed_transfer(req_id, handle, failed)
            if not in_progress:
                done.add(req_id)
                del transfers[req_id]
            else:
                transfers[req_id] = in_progress
        return done, failed

    def _try_release_xfer_handle(self, req_id: str, handle: int) -> bool:
        """vLLM 0.32's: release a handle (an in-flight READ is aborted), False when the caller must keep it."""
        try:
            self.nixl_wrapper.release_xfer_handle(handle)
        except NixlError:
            return False
        return True

    def _handle_failed_transfer(self, req_id: str, handle: int | None, failed_req_ids: set[str] | None = None,
                                record_failed_transfer: bool = True) -> bool:
        if record_failed_transfer:
            self.xfer_stats.record_failed_transfer()
            meta = self._recving_metadata.get(req_id)
            if meta is not None and meta.remote is not None:
                self._failed_remote_engines.add(meta.remote.engine_id)
        if failed_req_ids is not None:
            failed_req_ids.add(req_id)
        return True

    def get_transfer_results(self) -> Any:
        done_sending = self._get_new_notifs()
        done_recving, newly_failed = self._pop_done_transfers(self._recving_transfers)
        self._recv_failures.update(newly_failed)
        while not self._failed_recv_reqs.empty():
            self._handle_failed_transfer(self._failed_recv_reqs.get_nowait(), None, self._recv_failures,
                                         record_failed_transfer=False)
        failed_recv: set[str] = set()
        for req_id in tuple(self._recv_failures):
            if req_id not in self._recving_metadata:
                self._recv_failures.remove(req_id)
            elif req_id not in self._recving_transfers:
                self._recv_failures.remove(req_id)
                failed_recv.add(req_id)
        done_recving.update(failed_recv)
        for req_id in done_recving:
            meta = self._recving_metadata.pop(req_id, None)
            assert meta is not None, f"{req_id} not found in recving_metadata list"
            if req_id in failed_recv:
                self._invalid_block_ids.put(set(meta.local_block_ids[0]))
        self._reap_expired_send_leases(done_sending)
        self._cleanup_remote_engines()
        return KVConnectorTransferResults(finished_sending=done_sending, finished_recving=done_recving,
                                          failed_recving=failed_recv)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out: set[int] = set()
        while not self._invalid_block_ids.empty():
            out |= self._invalid_block_ids.get_nowait()
        return out

    def _get_new_notifs(self) -> set[str]:
        notified: set[str] = set()
        for notifs in self.nixl_wrapper.get_new_notifs().values():
            for notif in notifs:
                msg = notif.decode()
                if msg.startswith("HB:"):
                    continue
                req_id, consumers = msg.rsplit(":", 1)
                if req_id not in self._reqs_to_send and req_id not in self._reqs_to_process:
                    continue  # upstream: "notification after expiry"
                self._consumer_counts[req_id] += 1
                if self._consumer_counts[req_id] == int(consumers):
                    notified.add(req_id)
                    del self._consumer_counts[req_id]
                    self._reqs_to_process.discard(req_id)
                    self._reqs_to_send.pop(req_id, None)
        return notified

    def _reap_expired_send_leases(self, done_sending: set[str]) -> None:
        now = time.perf_counter()
        for req_id, expiry in list(self._reqs_to_send.items()):
            if now >= expiry:
                del self._reqs_to_send[req_id]
                self._reqs_to_process.discard(req_id)
                done_sending.add(req_id)

    # peers ---------------------------------------------------------------------------------------

    def _background_nixl_handshake(self, req_id: str, engine_id: str, meta: Any) -> None:
        if engine_id in self._handshaking:
            self._handshaking[engine_id][1].append((req_id, meta))
            return
        self._handshaking[engine_id] = (time.perf_counter() + self.directory.handshake_seconds(), [(req_id, meta)])

    def _poll_handshakes(self) -> None:
        now = time.perf_counter()
        for engine_id, (done_at, waiting) in list(self._handshaking.items()):
            if now < done_at:
                continue
            del self._handshaking[engine_id]
            served = self.directory.engines.get(engine_id)
            if not served or self.tp_rank >= len(served):
                for req_id, _ in waiting:
                    self._failed_recv_reqs.put(req_id)
                continue
            self._nixl_handshake(engine_id, 5600, len(served), expected_engine_id=engine_id)
            for item in waiting:
                self._ready_requests.put(item)

    def _nixl_handshake(self, host: str, port: int, remote_tp_size: int, expected_engine_id: str) -> dict[int, str]:
        served = self.directory.engines[expected_engine_id] or []
        rank = self.tp_rank  # homogeneous TP: rank i reads decode's rank i
        return {rank: self.add_remote_agent(served[rank], rank)}

    def add_remote_agent(self, nixl_agent_meta: Any, remote_tp_rank: int = 0, *args: Any, **kwargs: Any) -> str:
        engine_id = nixl_agent_meta.engine_id
        name = self.nixl_wrapper.add_remote_agent(nixl_agent_meta.agent_metadata.decode())
        self._remote_agents.setdefault(engine_id, {})[(0, remote_tp_rank)] = name
        self.dst_num_blocks[engine_id] = nixl_agent_meta.num_blocks
        self.dst_region_num_blocks[engine_id] = list(nixl_agent_meta.region_num_blocks)
        self.tp_mappings[engine_id] = types.SimpleNamespace(all_source_ranks=(remote_tp_rank,),
                                                            source_ranks_per_group=((remote_tp_rank,),),
                                                            local_consumers=1)
        descs = self.nixl_wrapper.get_xfer_descs((nixl_agent_meta.kv_caches_base_addr, nixl_agent_meta.num_blocks),
                                                 "VRAM")
        self.dst_xfer_side_handles.setdefault(engine_id, {})[remote_tp_rank] = \
            self.nixl_wrapper.prep_xfer_dlist(name, descs)
        return name

    def _build_fa_remote(self, plan: Any, meta: Any, ratio: int) -> Any:
        """The descriptors of a remote layout (here: its regions' bases and blocks per region)."""
        return (list(meta.kv_caches_base_addr), int(meta.num_blocks))

    def _mark_remote_engine_invalid(self, engine_id: str, now: float) -> None:
        self._invalid_remote_engines.add(engine_id)

    def _cleanup_remote_engines(self) -> None:
        for engine_id in self._failed_remote_engines - self._invalid_remote_engines:
            agents = self._remote_agents.get(engine_id, {}).values()
            if not all(map(self.nixl_wrapper.check_remote_metadata, agents)):
                self._mark_remote_engine_invalid(engine_id, time.perf_counter())
        self._failed_remote_engines.clear()
        busy = {m.remote.engine_id for m in self._recving_metadata.values() if m.remote is not None}
        for engine_id in sorted(self._invalid_remote_engines - busy):
            for handle in self.dst_xfer_side_handles.pop(engine_id, {}).values():
                self.nixl_wrapper.release_dlist_handle(handle)
            for agent in self._remote_agents.pop(engine_id, {}).values():
                self.nixl_wrapper.remove_remote_agent(agent)
            self.dst_num_blocks.pop(engine_id, None)
            self.dst_region_num_blocks.pop(engine_id, None)
            self.tp_mappings.pop(engine_id, None)
            self._invalid_remote_engines.discard(engine_id)
