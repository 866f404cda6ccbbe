"""Decode's retention yields to requests waiting for blocks (connector.scheduler): while incoming decode requests need
more blocks than vLLM's pool has free, a finished turn is not retained on the device (issue #36: at 8x the live
conversations, a burst of first turns waited behind retained turns holding half of decode's cache)."""

from __future__ import annotations

import types

from connector.pull import TurnkvPullScheduler
from connector.retention import ReadDelays, RetentionLedger, Tier
from connector.stats import TurnkvKVConnectorStats


class Pool:
    def __init__(self, free: int):
        self.free = free

    def get_num_free_blocks(self) -> int:
        return self.free


def scheduler(free: int) -> TurnkvPullScheduler:
    s = TurnkvPullScheduler.__new__(TurnkvPullScheduler)
    s.__dict__.update(_block_pool=Pool(free), _decode_waiting={}, block_size=128, _retained=RetentionLedger(),
                      _retained_share=0.5, kv_cache_config=types.SimpleNamespace(num_blocks=80),
                      _host_pool_blocks=0, _host_bases={}, _tp_size=1, _host_started_mib=0, _host_budget_mib=0,
                      decoder_kv_blocks_ttl=480, _read_delays=ReadDelays(), _idle_evict=0.0, _idle_floor=10.0,
                      turnkv_stats=TurnkvKVConnectorStats(), _refused_at=float("-inf"))
    return s


def test_turns_stay_off_the_device_while_requests_wait_for_blocks():
    s = scheduler(free=10)
    s._decode_waiting["a"] = 8  # what get_num_new_matched_tokens records for a 1,000-token incoming request
    assert not s._device_pressure()  # 8 blocks wanted, 10 free: room
    s._decode_waiting["b"] = 8
    assert s._device_pressure()
    placed = s._place(5, [[1, 2, 3, 4, 5]])
    assert placed.tier is None  # no host tier here: not retained rather than holding room the requests wait for
    assert s.turnkv_stats.data["turnkv_retention_yielded"] == [1]
    del s._decode_waiting["b"]  # given blocks (update_state_after_alloc) or finished
    assert s._place(5, [[1, 2, 3, 4, 5]]).tier is Tier.DEVICE


def test_without_a_block_pool_retention_is_as_before():
    s = scheduler(free=0)
    s._block_pool = None
    s._decode_waiting["a"] = 100
    assert not s._device_pressure() and s._place(5, [[1, 2, 3, 4, 5]]).tier is Tier.DEVICE
