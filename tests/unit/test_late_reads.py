"""A read never starts after its deadline (issue 38): prefill admits a cleared offer at its first look, then waits
(no KV room, or a NIXL handshake) while decode evicts the turn, frees the blocks (or host slots, or a fork window
ends) and gives them to another tenant's turn. Whatever prefill's scheduler and worker do afterwards, no READ may
deliver the other tenant's KV: the late request is recomputed.

The connector's mixins run over stand-ins of the upstream slices they rely on (``tests.unit.test_wire``): a pull
scheduler that keeps a look's offer until the request is allocated and hands it to the worker in the step's
metadata, and a pull worker that handshakes in the background and READs the named blocks of a decode memory that
records which tenant's turn each block and host slot holds now. The clock is a fake wall clock, so the waits are
the minutes they stand for."""

from __future__ import annotations

import queue
import time
import types

import pytest

from tests.unit.test_wire import RETAIN, SECRET, _freed, _request, _step, _Upstream, _worker_news
from turnkv import wire

PROMPT_TAIL = list(range(1000, 1100))


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(time, "time", fake)
    return fake


class DecodeMemory:
    """Which tenant's turn each of decode's device blocks and host slots holds now."""

    def __init__(self) -> None:
        self.device: dict[int, str] = {}
        self.host: dict[int, str] = {}

    def write(self, params: dict, tenant: str) -> None:
        place = self.host if wire.HOST_TIER in params else self.device
        for block in params[wire.REMOTE_BLOCK_IDS][0]:
            place[block] = tenant


class _UpstreamPullScheduler(_Upstream):
    """Upstream's pull scheduler as far as these tests go: an allocated request's offer goes to the worker in the
    next step's metadata (``reqs_to_recv``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.engine_id = "prefill-0"
        self._need_recv: dict[str, object] = {}

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        params = request.kv_transfer_params
        if params and params.get(wire.DO_REMOTE_DECODE) and params.get(wire.REMOTE_BLOCK_IDS) \
                and num_external_tokens > 0:
            remote = types.SimpleNamespace(engine_id=params[wire.REMOTE_ENGINE_ID],
                                           block_ids=[list(g) for g in params[wire.REMOTE_BLOCK_IDS]])
            self._need_recv[request.request_id] = types.SimpleNamespace(remote=remote, local_block_ids=[[70, 71, 72]],
                                                                        awaiting_kvs=True)

    def build_connector_meta(self, scheduler_output):
        recv, self._need_recv = self._need_recv, {}
        return types.SimpleNamespace(reqs_to_recv=recv)


class _UpstreamPullWorker:
    """Upstream's pull worker as far as these tests go: an engine not handshaken yet is handshaken in the background
    (the read is queued until it finishes), then the READ copies what decode's blocks (or host slots) hold."""

    def __init__(self, memory: DecodeMemory) -> None:
        self.memory = memory
        self.tp_rank = 0
        self._remote_agents: dict[str, dict] = {}
        self._recving_metadata: dict[str, object] = {}
        self._recv_failures: set[str] = set()
        self._ready_requests: queue.Queue = queue.Queue()
        self._handshaking: list[tuple[str, object]] = []
        self.read: dict[str, list[str]] = {}
        self.failed: list[str] = []

    def start_load_kv(self, metadata):
        for req_id, meta in metadata.reqs_to_recv.items():
            self._recving_metadata[req_id] = meta
            self._read_blocks_for_req(req_id, meta)
        while not self._ready_requests.empty():
            self._read_blocks_for_req(*self._ready_requests.get_nowait())

    def _read_blocks_for_req(self, req_id, meta):
        if meta.remote.engine_id not in self._remote_agents:
            self._handshaking.append((req_id, meta))
            return
        plan = self._turnkv_plans.get(req_id)
        place = self.memory.host if plan is not None and plan.host is not None else self.memory.device
        self.read[req_id] = [place[b] for b in meta.remote.block_ids[0]]

    def finish_handshakes(self) -> None:
        for req_id, meta in self._handshaking:
            self._remote_agents.setdefault(meta.remote.engine_id, {})
            self._ready_requests.put((req_id, meta))
        self._handshaking = []

    def _handle_failed_transfer(self, req_id, handle, failed=None, record_failed_transfer=True):
        """0.32 passes the failed set, 0.29 only the request id and handle (``connector.compat.fail_read``)."""
        self.failed.append(req_id)
        if failed is not None:
            failed.add(req_id)
        return True


@pytest.fixture
def engines(monkeypatch, tmp_path, clock):
    pytest.importorskip("vllm")
    from connector.scheduler import TurnkvSchedulerMixin
    from connector.worker import TurnkvWorkerMixin

    monkeypatch.setenv(wire.OFFER_SECRET_ENV, SECRET.decode())
    monkeypatch.setenv(wire.MODEL_FINGERPRINT_ENV, "model-x")
    monkeypatch.setenv("TURNKV_TUNABLES_FILE", str(tmp_path / "none.json"))

    class Scheduler(TurnkvSchedulerMixin, _UpstreamPullScheduler):
        pass

    class Worker(TurnkvWorkerMixin, _UpstreamPullWorker):
        pass

    memory = DecodeMemory()
    decode, prefill = Scheduler(None, "decode-0", None), Scheduler(None, "prefill-0", None)
    worker = Worker(memory)
    return types.SimpleNamespace(decode=decode, prefill=prefill, worker=worker, memory=memory, clock=clock)


def _retain(e, request_id: str, tenant: str, blocks: list[int], tokens: list[int]) -> dict | None:
    """Decode finishes a turn of ``tenant`` in ``blocks`` and retains it: the offer, with the memory written."""
    _, offer = e.decode.request_finished(_request(request_id, tokens, dict(RETAIN)), [list(blocks)])
    if offer is not None:
        e.memory.write(offer, tenant)
        _step(e.decode)
    return offer


def _look(e, request):
    """One look of prefill's scheduler at a waiting request (vLLM asks again on every step until it has room)."""
    return e.prefill.get_num_new_matched_tokens(request, 0)[0]


def _admit_and_run(e, request, count: int) -> None:
    """There is room now: the request is allocated, the step's metadata goes to the worker."""
    if count > 0:
        e.prefill.update_state_after_alloc(request, None, count)
    e.worker.start_load_kv(e.prefill.build_connector_meta(types.SimpleNamespace(total_num_scheduled_tokens=1)))


def _handshaken(e) -> None:
    e.worker._remote_agents["decode-0"] = {}


def _only_own_kv(e, request_id: str) -> None:
    """What the READ delivered (if anything) is tenant A's turn, never another tenant's."""
    assert set(e.worker.read.get(request_id, [])) <= {"A"}, e.worker.read


def test_a_request_held_in_prefills_waiting_queue_past_its_read_by_is_recomputed_not_read_from_reused_blocks(
        engines):
    e = engines
    _handshaken(e)
    tokens = list(range(300))
    offer = _retain(e, "a1", "A", [1, 2, 3], tokens)
    request = _request("p1", tokens + PROMPT_TAIL, wire.clear_offer(SECRET, offer, time.time() + 10))
    assert _look(e, request) == 300  # first look: signed, live, cleared, read-by 10 s ahead: admitted
    # no KV room on prefill: the request stays in the waiting queue. Meanwhile decode, under retention pressure,
    # evicts a1 (announced on its feed 11 s later, after the router's read-by), frees it after the 30 s grace and
    # retains tenant B's turn in the same blocks
    e.clock.advance(11)
    e.decode._retained_share = 0.03
    e.decode._idle_evict = 5.0
    assert _retain(e, "b0", "B", [4, 5, 6], tokens) is None  # no room: a1 (idle) announced
    e.clock.advance(31)
    _freed(e.decode, "a1")
    assert _retain(e, "b1", "B", [1, 2, 3], tokens) is not None
    assert e.memory.device == {1: "B", 2: "B", 3: "B"}
    e.clock.advance(18)  # 60 s after the first look, prefill has room
    count = _look(e, request)
    _admit_and_run(e, request, count)
    _only_own_kv(e, "p1")
    assert count == 0 and "p1" not in e.worker.read  # recomputed
    assert e.prefill.turnkv_stats.data["turnkv_offers_late"] == [1]


def test_a_read_whose_handshake_ends_past_its_read_by_is_not_posted(engines):
    """Admitted and allocated in time, but the first READ from this decode engine waits for the NIXL handshake;
    the blocks are reused meanwhile. The worker checks the deadline right before posting the READ."""
    e = engines
    tokens = list(range(300))
    offer = _retain(e, "a1", "A", [1, 2, 3], tokens)
    request = _request("p1", tokens + PROMPT_TAIL, wire.clear_offer(SECRET, offer, time.time() + 10))
    _admit_and_run(e, request, _look(e, request))
    assert e.worker._handshaking  # the READ waits for the handshake
    e.clock.advance(45)
    e.decode._evictions.clear()
    _freed(e.decode, "a1")
    assert _retain(e, "b1", "B", [1, 2, 3], tokens) is not None
    e.worker.finish_handshakes()
    e.worker.start_load_kv(types.SimpleNamespace(reqs_to_recv={}))  # the next step posts the ready READs
    _only_own_kv(e, "p1")
    assert "p1" not in e.worker.read and e.worker.failed == ["p1"]  # failed before posting: recomputed


def test_a_host_tier_offer_held_past_its_read_by_is_not_read_from_a_reused_host_slot(engines):
    e = engines
    _handshaken(e)
    e.decode._retained_share = 0.03  # one 3-block turn on the device, the next on the host
    e.decode._host_budget_mib = e.decode._host_started_mib = 64
    _worker_news(e.decode, pools=[(0, 0x7F0000, 8)])
    tokens = list(range(300))
    assert _retain(e, "d0", "C", [1, 2, 3], tokens) is not None
    offer = _retain(e, "a1", "A", [4, 5, 6], tokens)
    assert offer[wire.HOST_TIER] and offer[wire.REMOTE_BLOCK_IDS] == [[0, 1, 2]]
    _freed(e.decode, "a1")  # copied to the host slots: the device blocks go back
    request = _request("p1", tokens + PROMPT_TAIL, wire.clear_offer(SECRET, offer, time.time() + 10))
    assert _look(e, request) == 300
    # decode evicts the host turn, frees its slots after the grace and puts tenant B's turn in the same slots
    e.clock.advance(41)
    _worker_news(e.decode, released=[("a1", False)])
    offer_b = _retain(e, "b1", "B", [7, 8, 9], tokens)
    assert offer_b[wire.REMOTE_BLOCK_IDS] == [[0, 1, 2]] and e.memory.host == {0: "B", 1: "B", 2: "B"}
    e.clock.advance(19)
    count = _look(e, request)
    _admit_and_run(e, request, count)
    _only_own_kv(e, "p1")
    assert count == 0 and "p1" not in e.worker.read


def test_a_fork_held_past_the_end_of_its_fork_window_is_not_read_from_reused_blocks(engines):
    """A fork-readable offer: the router clears a fork's replay to be read by the first read + the window + the
    slack; decode frees the read turn that long (and the clocks' margin) after its window. A fork that waits in
    prefill's queue past that must not read the blocks another tenant's turn holds by then."""
    e = engines
    _handshaken(e)
    e.decode._fork_window = 10.0
    tokens = list(range(300))
    offer = _retain(e, "a1", "A", [1, 2, 3], tokens)
    assert wire.fork_window(offer) == 10.0
    fork_until = time.time() + 10.0  # the router's first take of the offer
    first = _request("p0", tokens + PROMPT_TAIL, wire.clear_offer(SECRET, offer, time.time() + 10, reader="a" * 16))
    _admit_and_run(e, first, _look(e, first))
    assert e.worker.read["p0"] == ["A", "A", "A"]
    e.clock.advance(5)
    second = _request("p1", tokens + PROMPT_TAIL, wire.clear_offer(
        SECRET, offer, min(time.time() + 10, fork_until + wire.FORK_READ_SLACK), reader="b" * 16))
    assert _look(e, second) == 300  # a second fork, in its window: admitted; then it waits for room
    from connector.worker import TurnkvWorkerMeta

    e.decode.update_connector_output(types.SimpleNamespace(  # decode's workers report the first read
        finished_sending=set(), finished_recving=set(), kv_connector_worker_meta=TurnkvWorkerMeta(fork_held=["a1"])))
    e.clock.advance(11)  # the window has passed: announced, freed FORK_READ_SLACK + the clocks' margin later
    e.decode.update_connector_output(types.SimpleNamespace(finished_sending=set(), finished_recving=set(),
                                                           kv_connector_worker_meta=TurnkvWorkerMeta()))
    assert "a1" in _step(e.decode).turnkv_evict
    e.clock.advance(8)
    _freed(e.decode, "a1")
    assert _retain(e, "b1", "B", [1, 2, 3], tokens) is not None
    e.clock.advance(6)
    count = _look(e, second)
    _admit_and_run(e, second, count)
    _only_own_kv(e, "p1")
    assert count == 0 and "p1" not in e.worker.read


def test_a_request_admitted_and_allocated_in_time_is_read(engines):
    """The deadline costs nothing when prefill is on time: admitted, allocated and read within the read-by."""
    e = engines
    _handshaken(e)
    tokens = list(range(300))
    offer = _retain(e, "a1", "A", [1, 2, 3], tokens)
    request = _request("p1", tokens + PROMPT_TAIL, wire.clear_offer(SECRET, offer, time.time() + 10))
    assert _look(e, request) == 300
    e.clock.advance(9)
    count = _look(e, request)  # a later look, still in time
    _admit_and_run(e, request, count)
    assert count == 300 and e.worker.read["p1"] == ["A", "A", "A"]


def test_a_request_first_decided_for_recompute_is_still_held_to_its_deadline_at_later_looks(engines):
    """A first look that chose to recompute (the cost model, the threshold) leaves the offer in the params, and
    a later look asks upstream again: past the deadline that look reads nothing either."""
    e = engines
    _handshaken(e)
    e.prefill.kv_recompute_threshold = 10_000  # 300 tokens are not worth a pull
    tokens = list(range(300))
    offer = _retain(e, "a1", "A", [1, 2, 3], tokens)
    request = _request("p1", tokens + PROMPT_TAIL, wire.clear_offer(SECRET, offer, time.time() + 10))
    assert _look(e, request) == 0
    e.clock.advance(60)
    e.decode._evictions.clear()
    _freed(e.decode, "a1")
    assert _retain(e, "b1", "B", [1, 2, 3], tokens) is not None
    count = _look(e, request)
    _admit_and_run(e, request, count)
    _only_own_kv(e, "p1")
    assert count == 0 and "p1" not in e.worker.read


def test_a_host_tier_offer_declined_at_its_first_look_is_never_read_at_a_later_one(engines):
    """Issue 50: the cost model declines a host-tier offer at the first look (a pull of it is slower than
    recomputing), and prefill has no KV room that step. At the next look the offer must still be declined: before
    the admission record, the later look asked upstream again, upstream pulled, and with the host entry dropped at
    the decline the worker READ decode's device blocks at the host pool's slot numbers (another tenant's KV)."""
    e = engines
    _handshaken(e)
    e.decode._retained_share = 0.03  # one 3-block turn on the device, the next on the host
    e.decode._host_budget_mib = e.decode._host_started_mib = 64
    _worker_news(e.decode, pools=[(0, 0x7F0000, 8)])
    tokens = list(range(300))
    assert _retain(e, "c0", "C", [0, 1, 2], tokens) is not None  # tenant C's turn in device blocks 0-2
    offer = _retain(e, "a1", "A", [4, 5, 6], tokens)
    assert offer[wire.HOST_TIER] and offer[wire.REMOTE_BLOCK_IDS] == [[0, 1, 2]]  # host slots 0-2
    _freed(e.decode, "a1")
    request = _request("p1", tokens + PROMPT_TAIL, wire.clear_offer(SECRET, offer, time.time() + 10))
    e.prefill.kv_recompute_threshold = 10_000  # the cost model declines: recompute
    assert _look(e, request) == 0
    e.clock.advance(1)  # no room that step: the request waits and is looked at again, well within its read-by
    e.prefill.kv_recompute_threshold = 0
    count = _look(e, request)
    _admit_and_run(e, request, count)
    _only_own_kv(e, "p1")
    assert count == 0 and "p1" not in e.worker.read  # decided once: recomputed


def test_an_offer_naming_more_blocks_than_its_tokens_fill_is_read_without_the_spare_ones(engines):
    """Issue 50, found by tests/sim (scenario spec): with speculative decoding vLLM allocates a running request's
    lookahead blocks, and decode offered every block it held. Upstream pairs decode's blocks with prefill's from the
    end of the list, so a spare block at the end shifted every block the READ brought by one."""
    e = engines
    _handshaken(e)
    tokens = list(range(300))  # 3 blocks of 128 hold them; decode also held a lookahead block (9)
    offer = _retain(e, "a1", "A", [1, 2, 3, 9], tokens)
    request = _request("p1", tokens + PROMPT_TAIL, wire.clear_offer(SECRET, offer, time.time() + 10))
    count = _look(e, request)
    _admit_and_run(e, request, count)
    assert count == 300 and request.kv_transfer_params[wire.REMOTE_BLOCK_IDS] == [[1, 2, 3]]
    assert e.worker.read["p1"] == ["A", "A", "A"]
