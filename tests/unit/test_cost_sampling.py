"""The cost model's inputs as the connector gathers them: step times, READs, handshakes, and the load.

The turnkv scheduler and worker mixins run over small stand-ins for upstream's NIXL classes (what the
mixins call of them), with a fake clock, so the engine's call order can be replayed exactly, including
async scheduling's (schedule() for step N+1 before update_connector_output for step N).
"""

from __future__ import annotations

import types

import pytest

pytest.importorskip("vllm")

from connector import scheduler as scheduler_mod
from connector import token_proof
from connector.scheduler import TurnkvSchedulerMixin
from connector.worker import TurnkvWorkerMeta, TurnkvWorkerMixin
from turnkv import metric_names as mn

BLOCK = 128
BYTES_PER_BLOCK = 128 * 4096  # 4 KiB of KV per token


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class UpstreamScheduler:
    """What the mixin calls of upstream's NIXL scheduler."""

    def __init__(self) -> None:
        self.kv_cache_config = types.SimpleNamespace(
            num_blocks=100, kv_cache_tensors=[types.SimpleNamespace(size=100 * BYTES_PER_BLOCK)])
        self.block_size, self.kv_recompute_threshold = BLOCK, 64
        self.is_bidirectional_kv_xfer_enabled, self.decoder_kv_blocks_ttl = True, 480

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        offer = request.kv_transfer_params
        if offer and offer.get("do_remote_decode"):
            return int(offer["remote_num_tokens"]), True
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return types.SimpleNamespace(reqs_to_recv={})

    def update_connector_output(self, connector_output):
        pass

    def request_finished(self, request, block_ids):
        return False, None


class Scheduler(TurnkvSchedulerMixin, UpstreamScheduler):
    pass


@pytest.fixture
def clock(monkeypatch, tmp_path):
    monkeypatch.setenv("TURNKV_TUNABLES_FILE", str(tmp_path / "none.json"))
    monkeypatch.setenv("TURNKV_REQUIRE_SIGNED_OFFERS", "0")  # these offers are unsigned: the cost model is tested here
    c = Clock()
    monkeypatch.setattr(scheduler_mod.time, "perf_counter", c)
    return c


def schedule(s: Scheduler, tokens: int):
    return s.build_connector_meta(types.SimpleNamespace(total_num_scheduled_tokens=tokens))


def output(meta=None, recving=None):
    return types.SimpleNamespace(finished_recving=recving, finished_sending=None, kv_connector_worker_meta=meta)


def request(rid: str, prompt: int, offer: int = 0, engine: str = "decode-0"):
    params = None
    if offer:
        params = {"do_remote_decode": True, "remote_block_ids": [list(range(-(-offer // BLOCK)))],
                  "remote_num_tokens": offer, "remote_engine_id": engine,
                  token_proof.PARAMS_KEY: token_proof.make_proof(list(range(offer)), BLOCK)}
    return types.SimpleNamespace(request_id=rid, kv_transfer_params=params, prompt_token_ids=list(range(prompt)),
                                 num_prompt_tokens=prompt, num_computed_tokens=0)


def test_async_scheduling_schedule_n_plus_1_before_update_n(clock, monkeypatch):
    """Each overlapping step gives its own sample: its own tokens, busy from when the engine got to it."""
    s = Scheduler()
    samples = []
    monkeypatch.setattr(s.cost, "observe_step", lambda seconds, tokens, *a: samples.append((round(seconds, 6),
                                                                                              tokens)))
    clock.now = 0.00
    meta_n = schedule(s, 2000)
    clock.now = 0.01
    meta_n1 = schedule(s, 500)  # async scheduling: step N+1 handed out while step N runs
    clock.now = 1.00
    s.update_connector_output(output(TurnkvWorkerMeta(steps=[meta_n.turnkv_step])))
    clock.now = 1.25
    s.update_connector_output(output(TurnkvWorkerMeta(steps=[meta_n1.turnkv_step])))
    assert samples == [(1.0, 2000), (0.25, 500)]


def test_async_steps_teach_the_marginal_compute_cost(clock):
    s = Scheduler()
    metas = []
    for i in range(30):  # overlapping steps of 0.02 s + 0.4 ms per token, each scheduled one step ahead
        tokens = (300, 2000, 900)[i % 3]
        metas.append((schedule(s, tokens), tokens))
        if len(metas) == 2:
            meta, done_tokens = metas.pop(0)
            clock.now += 0.02 + 0.0004 * done_tokens
            s.update_connector_output(output(TurnkvWorkerMeta(steps=[meta.turnkv_step])))
    assert abs(s.cost.compute_per_token - 0.0004) < 1e-6
    assert abs(s.turnkv_stats.data["turnkv_compute_seconds_per_token"][-1] - 0.0004) < 1e-6


def test_the_transfer_cost_is_the_read_not_the_wait_for_busy_steps(clock):
    """A pull that waited 2 s for the engine's steps moved its KV in 16 ms: the model learns 16 ms."""
    s = Scheduler()
    s._handshaken.add("decode-0")
    s._pulled_from.add("decode-0")  # pulled from before: no handshake in the wait
    for i in range(3):
        req = request(f"r{i}", prompt=2100, offer=2000)
        assert s.get_num_new_matched_tokens(req, 0) == (2000, True)
        clock.now += 0.001
        s.update_state_after_alloc(req, None, 2000)
        clock.now += 2.0  # busy steps before the worker reports the READ done
        reads = [(2000 * BYTES_PER_BLOCK // BLOCK, 0.016)]
        s.update_connector_output(output(TurnkvWorkerMeta(reads=reads), recving={f"r{i}"}))
    assert abs(s.cost.predicted_pull(2000) - 0.016) < 1e-6
    assert abs(s.cost.pull_per_token - 8e-6) < 1e-9
    assert s.turnkv_stats.data["turnkv_pull_wait_seconds"][-1] > 1.9  # the queue, shown apart


def test_the_handshake_is_learned_apart_and_charged_to_a_new_engine_only(clock):
    s = Scheduler()
    s.update_connector_output(output(TurnkvWorkerMeta(handshakes=[("decode-0", 0.4)],
                                                      reads=[(1000 * BYTES_PER_BLOCK // BLOCK, 0.008)])))
    assert s.cost.handshake.value == 0.4 and "decode-0" in s._handshaken
    assert abs(s.cost.pull_per_token - 8e-6) < 1e-9  # the handshake is not in the per-token cost
    assert s.turnkv_stats.data["turnkv_handshake_seconds"] == [0.4]


def busy_scheduler(clock) -> Scheduler:
    """A slow link: pulling 2,000 tokens takes 1.0 s, recomputing them 0.8 s of engine time."""
    s = Scheduler()
    s._handshaken.add("decode-0")
    for tokens in (300, 2000, 900) * 10:
        meta = schedule(s, tokens)
        clock.now += 0.02 + 0.0004 * tokens
        s.update_connector_output(output(TurnkvWorkerMeta(steps=[meta.turnkv_step],
                                                          reads=[(tokens * BYTES_PER_BLOCK // BLOCK,
                                                                  0.0005 * tokens)])))
    return s


def test_an_idle_engine_recomputes_when_the_link_is_slower(clock):
    s = busy_scheduler(clock)
    assert s.get_num_new_matched_tokens(request("alone", prompt=2100, offer=2000), 0) == (0, False)
    data = s.turnkv_stats.data
    assert data["turnkv_decisions"] == [mn.DECISIONS.index("recompute")]
    assert data["turnkv_decision_queue_requests"] == [0]
    assert data["turnkv_decision_reasons"] == [4]  # REASONS.index("slower")


def test_a_busy_engine_pulls_to_spare_the_queue(clock):
    s = busy_scheduler(clock)
    for i in range(3):  # three requests with prefill work already in the engine
        s.get_num_new_matched_tokens(request(f"q{i}", prompt=1500), 0)
    assert s.get_num_new_matched_tokens(request("turn", prompt=2100, offer=2000), 0) == (2000, True)
    data = s.turnkv_stats.data
    assert data["turnkv_decisions"] == [mn.DECISIONS.index("pull")] and data["turnkv_decision_reasons"] == [3]  # load
    assert data["turnkv_decision_queue_requests"] == [3] and data["turnkv_decision_queue_tokens"] == [4500]
    assert abs(data["turnkv_decision_queue_delay_seconds"][0] - 2.4) < 1e-3
    # once they finish the engine is idle again: the same offer is recomputed
    for rid in ("q0", "q1", "q2", "turn"):
        s.request_finished(request(rid, prompt=1500), ())
    assert s.get_num_new_matched_tokens(request("later", prompt=2100, offer=2000), 0) == (0, False)


def test_worker_echoes_the_step_and_reports_its_reads_and_handshakes():
    class UpstreamWorker:
        def __init__(self):
            self.xfer_stats = None
            self._sending_transfers: dict = {}

        def start_load_kv(self, metadata):
            pass

        def _nixl_handshake(self, host, port, remote_tp_size, expected_engine_id, *rest):
            return {}

        def _pop_done_transfers(self, transfers):
            self.xfer_stats.data["bytes_transferred"].append(4096)
            self.xfer_stats.data["transfer_duration"].append(0.002)
            return set(transfers), set()

    class Worker(TurnkvWorkerMixin, UpstreamWorker):
        pass

    w = Worker()
    w.start_load_kv(types.SimpleNamespace(turnkv_step=7))
    w._nixl_handshake("127.0.0.1", 5601, 1, "decode-0")
    w._pop_done_transfers({"r1": [1]})  # a READ (receiving side)
    w._pop_done_transfers(w._sending_transfers)  # a WRITE: not a pull sample
    meta = w.build_turnkv_meta()
    assert meta.steps == [7] and meta.reads == [(4096, 0.002)]
    assert [engine for engine, _ in meta.handshakes] == ["decode-0"]
    assert w.build_turnkv_meta() is None  # nothing new: the step's output stays empty
    other_rank = TurnkvWorkerMeta(steps=[7], reads=[(4096, 0.003)])
    both = meta.aggregate(other_rank)
    assert both.steps == [7] and len(both.reads) == 2
