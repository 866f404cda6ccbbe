"""connector.inline: which pulls are read inside the step that computes them, and the worker's wait for them."""

from __future__ import annotations

import queue
import types

import pytest

from connector import compat, inline, seals
from connector.admission import ReadPlan
from connector.worker import TurnkvWorkerMixin


def test_a_short_pull_from_a_ready_engine_is_read_inline():
    assert inline.plan(200, 300, 0.004, 25.0, True) == inline.Plan(True, "inline")
    assert inline.plan(200, 300, 0.004, 0.0, True).reason == "off"
    assert inline.plan(200, 300, 0.004, 25.0, False).reason == "engine"  # no handshake yet, or blocks converted
    assert inline.plan(300, 300, 0.004, 25.0, True).reason == "whole-prompt"  # the step must compute a token
    assert inline.plan(200, 300, None, 25.0, True).reason == "no-estimate"  # the first READ is timed async
    assert inline.plan(200, 300, 0.030, 25.0, True).reason == "slow"  # holding the whole batch's step for it


def test_only_reads_that_land_ready_to_use_are_inline():
    assert inline.same_layout(128, 128, "NHD", "NHD", 1, 1, converts=False)
    assert not inline.same_layout(128, 64, "NHD", "NHD", 1, 1, converts=False)  # block-size ratio: converted after
    assert not inline.same_layout(128, 128, "NHD", "HND", 1, 1, converts=False)
    assert not inline.same_layout(128, 128, "NHD", "NHD", 1, 2, converts=False)
    assert not inline.same_layout(128, 128, "NHD", "NHD", 1, 1, converts=True)  # a host buffer, a permutation


class FakeNixl:
    """NIXL's transfer states as the agent reports them: PROC until the bytes moved, then DONE (or ERR)."""

    def __init__(self, polls_until_done: dict[int, int], fail: set[int] = frozenset(), stuck: set[int] = frozenset()):
        self.left, self.fail, self.checked = dict(polls_until_done), set(fail), 0
        self.stuck, self.released = set(stuck), []  # handles NIXL will not release while in flight

    def release_xfer_handle(self, handle: int) -> None:
        if handle in self.stuck and self.left.get(handle, 0) > 0:
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")
        self.released.append(handle)

    def check_xfer_state(self, handle: int) -> str:
        self.checked += 1
        if handle in self.fail:
            return "ERR"
        self.left[handle] -= 1
        return "PROC" if self.left[handle] > 0 else "DONE"


class Upstream:
    """The parts of vLLM 0.32's pull worker the wait reads (base_worker.py): metadata of receives, their handles,
    failures, requests whose handshake finished, blocks that failed to load."""

    def __init__(self, nixl: FakeNixl):
        self.nixl_wrapper = nixl
        self._recving_metadata: dict = {}
        self._recving_transfers: dict = {}
        self._recv_failures: set = set()
        self._ready_requests: queue.Queue = queue.Queue()
        self._invalid_block_ids: queue.Queue = queue.Queue()
        self.posted: list[str] = []
        self.failed: list[str] = []

    def _read_blocks_for_req(self, req_id, meta):
        self.posted.append(req_id)
        self._recving_transfers[req_id] = [meta.handle]

    def _handle_failed_transfer(self, req_id, handle, failed=None, record_failed_transfer=True):
        self.failed.append(req_id)
        if failed is not None:
            failed.add(req_id)

    def _try_release_xfer_handle(self, req_id, handle):
        try:
            self.nixl_wrapper.release_xfer_handle(handle)
        except RuntimeError:
            return False
        return True


class Worker(TurnkvWorkerMixin, Upstream):
    turnkv_reads_inline = True

    def __init__(self, nixl: FakeNixl):
        Upstream.__init__(self, nixl)  # the mixin's own state, as far as the wait and the READ's checks read it
        self._turnkv_plans, self._remote_agents = {}, {"decode-0": {}}
        self._turnkv_checked, self._turnkv_faulted = set(), set()


def meta(handle: int, blocks=(4, 5)):
    return types.SimpleNamespace(handle=handle, local_block_ids=[list(blocks)],
                                 remote=types.SimpleNamespace(engine_id="decode-0"))


def test_the_step_waits_until_the_read_is_done(monkeypatch):
    monkeypatch.setattr(compat, "release", lambda: (0, 32))
    w = Worker(FakeNixl({7: 3}))
    w._recving_metadata["r"] = meta(7)
    w._recving_transfers["r"] = [7]
    w._turnkv_wait_inline({"r"})
    assert w.nixl_wrapper.left[7] == 0  # polled until DONE, not past it
    assert w._invalid_block_ids.empty()


def test_a_read_whose_handshake_finishes_during_the_wait_is_posted_then():
    w = Worker(FakeNixl({9: 2}))
    w._recving_metadata["r"] = meta(9)
    w._ready_requests.put(("r", meta(9)))  # upstream would post it only at its next start_load_kv
    w._turnkv_wait_inline({"r"})
    assert w.posted == ["r"] and w.nixl_wrapper.left[9] == 0


def test_a_failed_read_ends_the_wait_and_is_left_to_upstreams_report():
    w = Worker(FakeNixl({3: 1}, fail={3}))
    w._recving_metadata["r"] = meta(3)
    w._recving_transfers["r"] = [3]
    w._turnkv_wait_inline({"r"})  # ERR: upstream's poll after the forward reports it, with its blocks
    w._recv_failures.add("q")
    w._recving_metadata["q"] = meta(4)
    w._turnkv_wait_inline({"q"})  # failed before posting (a late deadline): nothing to wait for
    assert w.nixl_wrapper.checked == 1


def test_a_read_past_the_limit_is_released_then_failed_so_its_blocks_are_reported_once(monkeypatch):
    monkeypatch.setattr(inline, "WAIT_LIMIT_S", 0.01)
    monkeypatch.setattr(compat, "release", lambda: (0, 32))
    w = Worker(FakeNixl({5: 10**9}))
    w._recving_metadata["r"] = meta(5, blocks=(11, 12))
    w._recving_transfers["r"] = [5]
    w._recving_metadata["s"] = meta(6)  # never posted (its handshake hangs)
    w._turnkv_wait_inline({"r", "s"})
    # NIXL stopped r's READ; both are failed with no handle left, so upstream's next poll reports each once, with
    # its blocks (the scheduler recomputes them), and no READ lands in them later
    assert w.nixl_wrapper.released == [5] and "r" not in w._recving_transfers
    assert sorted(w.failed) == ["r", "s"] and w._recv_failures == {"r", "s"}
    assert w._invalid_block_ids.empty()  # not reported ahead of upstream's report (it would come twice)


def test_a_read_nixl_will_not_release_holds_the_step_until_it_ends(monkeypatch):
    monkeypatch.setattr(inline, "WAIT_LIMIT_S", 0.001)
    monkeypatch.setattr(inline, "POLL_S", 0.001)
    w = Worker(FakeNixl({5: 40}, stuck={5}))
    w._recving_metadata["r"] = meta(5, blocks=(11, 12))
    w._recving_transfers["r"] = [5]
    w._turnkv_wait_inline({"r"})
    # the READ could not be stopped: the step waited for it rather than let it write into recomputed blocks
    assert w.nixl_wrapper.left[5] == 0 and w.failed == [] and w._recving_transfers["r"] == [5]


def test_inline_reads_are_never_reported_received():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

    class Reporting(Worker):
        def __init__(self):
            super().__init__(FakeNixl({}))
            self._turnkv_copying, self._turnkv_hosted, self._turnkv_device_done = {}, {}, set()
            self._turnkv_copy_ended, self._turnkv_seals, self._turnkv_host_released = set(), seals.SealBook(), []
            self._turnkv_fork_reads = types.SimpleNamespace(forget=lambda ids: None)
            self._turnkv_plans = {"inline-1": ReadPlan(inline=True), "inline-2": ReadPlan(inline=True),
                                  "async-1": ReadPlan()}

        def _turnkv_finish_copies(self):
            pass

    class Base:
        def get_transfer_results(self):
            return KVConnectorTransferResults(finished_sending=set(), finished_recving={"inline-1", "async-1"},
                                              failed_recving={"inline-1"})

    class W(Reporting, Base):
        pass

    w = W()
    results = w.get_transfer_results()
    assert results.finished_recving == {"async-1"} and not results.failed_recving
    assert set(w._turnkv_plans) == {"inline-2"}  # still in flight elsewhere: filtered when upstream reports it


@pytest.mark.parametrize(("release", "reads"), [((0, 32, 0), True), ((0, 29, 0), False)])
def test_workers_offer_inline_engines_only_where_the_release_keeps_what_the_wait_reads(monkeypatch, release, reads):
    monkeypatch.setattr(compat, "release", lambda: release)
    w = Worker(FakeNixl({}))
    w.block_size, w.kv_cache_layout, w._physical_blocks_per_logical_kv_block = 128, "NHD", 1
    remote = types.SimpleNamespace(block_size=128, kv_cache_layout="NHD", physical_blocks_per_logical_kv_block=1)
    assert w._turnkv_reads_inline(remote) is reads
    w.use_host_buffer = True
    assert not w._turnkv_reads_inline(remote)


def test_an_inline_read_lands_in_the_blocks_of_the_pulled_tokens():
    """Upstream's destination is the request's unhashed blocks; a synchronous load hashes its full blocks at once, so
    that would start one block late (the three-arm sweep: 5 of 6 inline pulls answered differently)."""
    from connector.scheduler import TurnkvSchedulerMixin

    class Scheduler(TurnkvSchedulerMixin):
        def __init__(self):  # only what the destination reads
            self.block_size, self._prefill_local = 128, {"r": 384}
            self._reqs_need_recv = {"r": ("request", [[15]], (5,), True)}  # upstream's: unhashed blocks only

        def get_exchange_clipped_blocks(self, block_ids):
            return block_ids

    s = Scheduler()
    blocks = types.SimpleNamespace(get_block_ids=lambda: ([10, 11, 12, 13, 14, 15],))
    s._inline_destination("r", blocks, 132)  # tokens 384..515: block 3 (full) and block 4 (4 tokens)
    assert s._reqs_need_recv["r"] == ("request", ([13, 14],), (3,), True)


def test_an_engine_is_inline_ready_only_while_every_rank_holds_its_handshake(monkeypatch, tmp_path):
    """Issue 50: readiness was the union over ranks (one rank's handshake made every rank's READ inline, the others
    waiting for theirs inside the step), and it was never withdrawn when a READ failed and upstream invalidated the
    engine, or when upstream evicted an idle handshake."""
    from connector.scheduler import TurnkvSchedulerMixin
    from connector.worker import TurnkvWorkerMeta
    from tests.unit.test_wire import SECRET, _Upstream
    from turnkv import wire

    monkeypatch.setenv(wire.OFFER_SECRET_ENV, SECRET.decode())
    monkeypatch.setenv("TURNKV_TUNABLES_FILE", str(tmp_path / "none.json"))

    class Scheduler(TurnkvSchedulerMixin, _Upstream):
        pass

    class Base:
        def _mark_remote_engine_invalid(self, engine_id, now):
            pass

        def _cleanup_remote_engine(self, engine_id, *, log_eviction=True):
            pass

    class RankWorker(TurnkvWorkerMixin, Base):
        def __init__(self, rank):
            self.tp_rank, self._turnkv_inline_engines = rank, []

    s = Scheduler(None, "prefill-0", None)
    s._tp_size = 2
    ranks = [RankWorker(0), RankWorker(1)]

    def step(*events_per_rank):
        for w, events in zip(ranks, events_per_rank, strict=True):
            w._turnkv_inline_engines.extend((engine, w.tp_rank, True) for engine in events)
        metas = [TurnkvWorkerMeta(inline_engines=w._turnkv_inline_engines) for w in ranks]
        for w in ranks:
            w._turnkv_inline_engines = []
        s._observe_worker(metas[0].aggregate(metas[1]), 0.0)

    def ready(engine):
        return len(s._inline_engines.get(engine, ())) >= s._tp_size

    step(["decode-0"], [])
    assert not ready("decode-0")  # rank 1 has not handshaken yet
    step([], ["decode-0"])
    assert ready("decode-0")
    ranks[1]._mark_remote_engine_invalid("decode-0", 0.0)  # a READ of rank 1 failed: its peer is invalidated
    step([], [])
    assert not ready("decode-0")
    step([], ["decode-0"])  # handshaken again
    assert ready("decode-0")
    ranks[0]._cleanup_remote_engine("decode-0")  # upstream's idle eviction on rank 0
    step([], [])
    assert not ready("decode-0")


def test_inline_is_off_under_model_runner_v2_and_beside_an_offloading_connector():
    """Issue 50: a failed inline READ relies on the scheduler's rollback, which Model Runner V2 (vLLM 0.32's CUDA
    default) gets wrong (upstream #49250), and on nothing having stored the unfilled blocks, which vLLM's
    OffloadingConnector does (its store jobs are built when the step is scheduled)."""
    assert inline.refusal(uses_v2_model_runner=False, offload_sibling=False) is None
    assert inline.refusal(uses_v2_model_runner=True, offload_sibling=False) == "runner"
    assert inline.refusal(uses_v2_model_runner=False, offload_sibling=True) == "offload"
    assert inline.plan(200, 300, 0.004, 25.0, True, "runner") == inline.Plan(False, "runner")
    assert inline.plan(200, 300, 0.004, 0.0, True, "runner").reason == "off"  # switched off says so first
    assert set(inline.REASONS) >= {"runner", "offload"}


def test_the_runner_is_read_from_the_engines_own_config():
    assert compat.uses_v2_model_runner(types.SimpleNamespace(use_v2_model_runner=True))
    assert not compat.uses_v2_model_runner(types.SimpleNamespace(use_v2_model_runner=False))
    assert not compat.uses_v2_model_runner(types.SimpleNamespace())  # a release without the switch runs V1

    class Refusing:
        @property
        def use_v2_model_runner(self):
            raise ValueError("HiSparse requires Model Runner V2; remove VLLM_USE_V2_MODEL_RUNNER=0.")

    assert compat.uses_v2_model_runner(Refusing())


def test_turnkvs_child_of_a_multiconnector_with_an_offloading_sibling_is_told_so():
    from turnkv import engine_args, wire

    own = {"kv_connector": "TurnkvPullConnector", "kv_role": "kv_both", "engine_id": "p0",
           "kv_connector_extra_config": {"backends": ["UCX"]}}
    offload = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
    child = engine_args.multi_connector(own, [offload])["kv_connector_extra_config"]["connectors"][0]
    assert child["kv_connector_extra_config"] == {"backends": ["UCX"], wire.OFFLOAD_SIBLING_KEY: True}
    alone = engine_args.multi_connector(own, [])["kv_connector_extra_config"]["connectors"][0]
    assert wire.OFFLOAD_SIBLING_KEY not in alone["kv_connector_extra_config"]
    assert own["kv_connector_extra_config"] == {"backends": ["UCX"]}  # the caller's config is not edited
