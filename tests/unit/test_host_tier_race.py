"""Push + bi-directional + host tier (issue #37, item 2): a host-tier READ on the engine thread and upstream's push
writer thread, at once.

The READ addresses decode's host pool, whose regions hold ``blocks`` slots where decode's device cache holds its own
block count; the WRITE of the next turn addresses decode's device cache. Both go through upstream's
``_compute_desc_ids`` with the per-engine block counts. The old code swapped ``dst_num_blocks`` /
``dst_region_num_blocks`` to the pool's slot count for the READ's duration, on the engine thread: a WRITE computed
by the writer thread in that window landed in another layer of decode's cache. Here the real writer loop
(``_push_writer_loop``, its own thread) posts a WRITE while the READ is being posted: the fake NIXL agent holds
the READ's post until the WRITE's is made, which opens the window every time instead of once in a while."""

from __future__ import annotations

import queue
import threading
import types
from collections import defaultdict

import pytest

pytest.importorskip("vllm")

from importlib.metadata import version

from packaging.version import Version

if Version(version("vllm")).release < (0, 32):  # vLLM 0.29: no per-region layout, no host tier, older READ signature
    pytest.skip("the host tier needs vLLM 0.32's NIXL worker", allow_module_level=True)

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import ReadSpec

from connector import worker as worker_module
from connector.admission import ReadPlan
from connector.push_worker import PushBidiWorker

DECODE, PREFILL = "decode-A", "prefill-0"
DEVICE_BLOCKS, LOCAL_BLOCKS, POOL_SLOTS, REGIONS = 1000, 500, 40, 4
POOL_BASE = 0x7F0000000000


class FakeNixl:
    """The prepped-transfer calls of a NIXL agent: records each post's remote descriptor ids. A READ's post waits
    (up to ``hold`` seconds) for a WRITE to be posted meanwhile, as a slow ``make_prepped_xfer`` would let one."""

    def __init__(self, on_read: threading.Event, hold: float = 2.0) -> None:
        self.posts: list[tuple[str, list[int], str]] = []
        self.write_posted = threading.Event()
        self.on_read, self.hold = on_read, hold

    def make_prepped_xfer(self, op, local_handle, local_ids, remote_handle, remote_ids, notif_msg=b""):
        if op == "READ":
            self.on_read.set()
            self.write_posted.wait(self.hold)
        self.posts.append((op, [int(i) for i in remote_ids], threading.current_thread().name))
        if op == "WRITE":
            self.write_posted.set()
        return len(self.posts)

    def transfer(self, handle):
        return "PROC"

    def get_new_notifs(self):
        return {}


def prefill_worker(nixl: FakeNixl) -> PushBidiWorker:
    """A push + bi-directional prefill rank with the state upstream's READ (pull) and WRITE (push) paths read."""
    w = object.__new__(PushBidiWorker)
    w.engine_id, w.world_size, w.tp_rank, w.dcp_size = PREFILL, 1, 0, 1
    w.nixl_wrapper = nixl
    w.dst_num_blocks = {PREFILL: LOCAL_BLOCKS, DECODE: DEVICE_BLOCKS}
    w.dst_region_num_blocks = {PREFILL: [LOCAL_BLOCKS] * REGIONS, DECODE: [DEVICE_BLOCKS] * REGIONS}
    w.dst_region_group_ids = {DECODE: [0] * REGIONS}
    w.dst_uses_region_group_mapping = {DECODE: False}
    w.region_group_ids, w._uses_region_group_mapping, w.num_regions = [0] * REGIONS, False, REGIONS
    w.block_len_per_layer, w._has_mamba, w._transfer_layer_group_ids = [4096] * REGIONS, False, []
    w._physical_blocks_per_logical_kv_block, w._mixed_mem_types = 1, False
    w.use_mla, w._is_csa_linear, w._group_spec_types = False, False, []
    w.kv_cache_config = types.SimpleNamespace(transfer_groups=[0])
    info = types.SimpleNamespace(remote_block_size=16, remote_physical_blocks_per_logical=1, remote_dcp_size=1,
                                 remote_tp_size=1)
    w.transfer_topo = types.SimpleNamespace(get_engine_info=lambda engine, pp=0: info,
                                            block_size_ratio=lambda size: 1, tp_ratio=lambda size: 1)
    w.tp_mappings = {DECODE: types.SimpleNamespace(all_source_ranks=(0,), source_ranks_per_group=((0,),))}
    w.src_xfer_handles_by_block_size, w.dst_xfer_side_handles = {16: 7}, {DECODE: {0: 8}}
    w._remote_agents = {DECODE: {(0, 0): "agent-A"}}
    w._handshake_lock, w._handshake_futures, w._engine_ttl, w._engine_last_active = threading.Lock(), {}, 0, {}
    w._sending_transfers, w._sending_transfers_lock = defaultdict(list), threading.Lock()
    w._recving_transfers, w._send_failures = defaultdict(list), set()
    w._turnkv_peer_lock, w._turnkv_writing_to, w._turnkv_stale_peers = threading.RLock(), {}, set()
    w._turnkv_sending_to = None
    # the writer loop's inboxes (upstream push_worker.__init__)
    w._push_writer_stop, w._push_writer_wake = threading.Event(), threading.Event()
    w._reg_send_inbox, w._deferred_push_inbox = queue.Queue(), queue.Queue()
    w._finished_blocks_inbox, w._evict_finished_inbox = queue.Queue(), queue.Queue()
    w._push_finished_blocks, w._pending_d_registrations = {}, {}
    w._pending_completion_notifs = queue.Queue()
    # the host-tier READ: decode's pool (one rank) and its prepared descriptors
    w._turnkv_plans = {"turn-2": ReadPlan(host=((POOL_BASE,), POOL_SLOTS))}
    w._turnkv_host_handles = {(DECODE, 0, POOL_BASE, POOL_SLOTS): 99}
    w._turnkv_remote_meta = {}
    # As the mixin's constructor does (the code before the fix had no such step and swapped the plain dicts).
    getattr(worker_module, "share_block_counts", lambda _: None)(w)
    return w


def desc_ids(blocks: list[int], per_region: int) -> list[int]:
    """Upstream's descriptor ids of ``blocks`` in every region of ``per_region`` blocks (region after region)."""
    return [region * per_region + b for region in range(REGIONS) for b in blocks]


def test_a_push_write_posted_during_a_host_tier_read_addresses_decode_s_device_cache():
    on_read = threading.Event()
    nixl = FakeNixl(on_read)
    w = prefill_worker(nixl)
    writer = threading.Thread(target=w._push_writer_loop, name="nixl-push-writer", daemon=True)
    writer.start()
    write_blocks = [900, 901, 902]

    def write_when_the_read_posts():  # turn 3's KV pushed into decode while turn 2 is read from its host tier
        on_read.wait(5)
        w._deferred_push_inbox.put(("turn-3", [write_blocks], {
            "decode_engine_id": DECODE, "local_block_ids": [write_blocks], "request_id": "turn-3-decode",
            "decode_host": "127.0.0.1", "decode_port": 1, "decode_tp_size": 1}))
        w._push_writer_wake.set()

    trigger = threading.Thread(target=write_when_the_read_posts, daemon=True)
    trigger.start()
    try:
        read = ReadSpec(remote_rank=0, local_block_ids=[[10, 11]], remote_block_ids=[[5, 6]])
        assert w._read_blocks(read, DECODE, "turn-2", "turn-2-decode", 1, None, 8, 1, True) is True
    finally:
        trigger.join(5)
        w._push_writer_stop.set()
        w._push_writer_wake.set()
        writer.join(5)

    posts = {op: (ids, thread) for op, ids, thread in nixl.posts}
    assert set(posts) == {"READ", "WRITE"}, nixl.posts
    assert posts["WRITE"][1] == "nixl-push-writer"
    # The WRITE lands in decode's device cache (1000 blocks a region), not at pool-sized region offsets (40).
    assert posts["WRITE"][0] == desc_ids(write_blocks, DEVICE_BLOCKS)
    # The READ addresses the pool's slots (40 a region).
    assert posts["READ"][0] == desc_ids([5, 6], POOL_SLOTS)
    # And nothing of the READ stays behind in the shared per-engine counts.
    assert w.dst_num_blocks[DECODE] == DEVICE_BLOCKS
    assert w.dst_region_num_blocks[DECODE] == [DEVICE_BLOCKS] * REGIONS
