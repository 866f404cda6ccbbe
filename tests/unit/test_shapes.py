"""Deployment shapes the CPU engine suites never run (issue #26): tensor-parallel pairs, unequal block sizes,
speculative decoding, Neuron, metrics over TP ranks. Each test drives the connector code such a shape reaches,
without an engine (docs/connector.md, "Shapes")."""

from __future__ import annotations

import queue
import types
from collections import defaultdict

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker

from connector.admission import Admissions, ReadPlan
from connector.push_worker import PushBidiWorker


def topology(tp_size: int, tp_rank: int = 0) -> TransferTopology:
    return TransferTopology(tp_rank=tp_rank, tp_size=tp_size, block_size=16, engine_id=f"engine-tp{tp_size}",
                            is_mla=False, is_mamba=False, total_num_kv_heads=8, attn_backends=[])


def push_decode_worker(monkeypatch, tp_size: int) -> PushBidiWorker:
    """A push + bi-directional decode rank built through PushBidiWorker's constructor, upstream's reduced to the
    notification state its ``_get_new_notifs`` reads (no agent, no writer thread)."""

    def upstream_init(self, vllm_config, engine_id, kv_cache_config):
        self.world_size, self.tp_rank, self.transfer_topo = tp_size, 0, topology(tp_size)
        self._pending_completion_notifs = queue.Queue()
        self._reqs_to_send, self._reqs_to_process, self._recving_metadata = {}, set(), {}
        self.consumer_notification_counts_by_req = defaultdict(int)
        self.xfer_stats = types.SimpleNamespace(record_notification_after_expiry=lambda: None)

    monkeypatch.setattr(NixlPushConnectorWorker, "__init__", upstream_init)
    transfer = types.SimpleNamespace(kv_connector="TurnkvPushConnector",
                                     kv_connector_extra_config={"bidirectional_kv_xfer": False})
    w = PushBidiWorker(types.SimpleNamespace(kv_transfer_config=transfer), "decode-0", None)
    w._turnkv_hosted, w._turnkv_notified = {}, set()
    return w


# --- item 1: push + bi-directional, prefill TP > decode TP ------------------------------------------------


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(8, 4), (4, 4), (2, 4)])
def test_push_decode_frees_retained_blocks_only_after_every_reading_rank(monkeypatch, prefill_tp, decode_tp):
    """Prefill TP 8 reading decode TP 4: two prefill ranks read each decode rank and each sends "{req}:2" (pull's
    count). Upstream push counted one reader and freed the blocks while the second rank was still reading."""
    readers = topology(prefill_tp).dcp_consumer_count(decode_tp, 1)  # what each prefill rank sends
    assert readers == max(1, prefill_tp // decode_tp)
    w = push_decode_worker(monkeypatch, decode_tp)
    w._reqs_to_send["turn-1"] = 1e18
    w._reqs_to_process.add("turn-1")
    for n in range(readers):
        assert "turn-1" in w._reqs_to_send  # still held while a rank reads
        w._pending_completion_notifs.put(f"turn-1:{readers}".encode())
        freed = w._get_new_notifs()
        assert freed == ({"turn-1"} if n == readers - 1 else set())
    assert "turn-1" not in w._reqs_to_send and "turn-1" not in w._reqs_to_process


def test_push_decode_write_completions_are_counted_as_upstream_does(monkeypatch):
    """Not a retained request: prefill's WRITE-completion ("{req}:{prefill TP}") is push's own count, unchanged."""
    from connector.push_worker import push_read_notif

    assert push_read_notif(b"w-1:8", 4, lambda rid: False) == b"w-1:8"
    assert push_read_notif(b"HB:a,b", 4, lambda rid: True) == b"HB:a,b"
    assert push_read_notif(b"r-1:2", 4, lambda rid: rid == "r-1") == b"r-1:8"
    assert push_read_notif(b"r:1:1", 4, lambda rid: rid == "r:1") == b"r:1:4"  # ids may hold ":"
    w = push_decode_worker(monkeypatch, 4)
    w._recving_metadata["w-1"] = types.SimpleNamespace(pp_size=1)
    w._pending_completion_notifs.put(b"w-1:8")  # prefill TP 8 WRITEs into decode TP 4: 2 producers per rank
    w._get_new_notifs()
    assert w.consumer_notification_counts_by_req["w-1"] == 1  # one of the two producer ranks' WRITEs


# --- item 4: a stale push peer with WRITEs in flight ------------------------------------------------------


def test_a_stale_push_peer_is_not_released_while_a_write_into_it_is_in_flight(monkeypatch):
    """Push prefill: decode-0 failed a WRITE (restarted), but another request's WRITE into it is still posted.
    Releasing the handshake then would free descriptors that WRITE still uses: wait until NIXL reports it."""
    import threading

    def upstream_xfer(self, req_id, meta):  # the writer thread posts the request's WRITE handles
        self._sending_transfers[req_id].append(f"handle-{req_id}")

    monkeypatch.setattr(NixlPushConnectorWorker, "_xfer_blocks_for_req", upstream_xfer)
    monkeypatch.setattr(NixlPushConnectorWorker, "_cleanup_remote_engines", lambda self: None)
    w = object.__new__(PushBidiWorker)
    w._turnkv_peer_lock, w._handshake_lock, w._sending_transfers_lock = threading.RLock(), threading.Lock(), \
        threading.Lock()
    w._turnkv_stale_peers, w._turnkv_sending_to, w._turnkv_writing_to = set(), None, {}
    w._remote_agents = {"decode-0": {(0, 0): "agent"}}
    w._handshake_futures, w._invalid_remote_engines = {}, set()
    w._recving_metadata, w._recving_transfers, w._sending_transfers = {}, {}, defaultdict(list)
    w.engine_id = "prefill-0"
    w.released = []
    w._cleanup_remote_engine = lambda eid, log_eviction=True: (w.released.append(eid), w._remote_agents.pop(eid))

    meta = types.SimpleNamespace(remote=types.SimpleNamespace(engine_id="decode-0"))
    w._xfer_blocks_for_req("p-2", meta)  # posted, not done
    w._log_failure("transfer_setup_failed", "p-1", msg="Push WRITE submission failed", dst_engine_id="decode-0")
    w._cleanup_remote_engines()
    assert w.released == [] and w._turnkv_stale_peers == {"decode-0"}
    w._sending_transfers.pop("p-2")  # NIXL reported it (done or failed)
    w._cleanup_remote_engines()
    assert w.released == ["decode-0"] and not w._turnkv_stale_peers


def test_releasable_leaves_peers_with_writes_in_flight():
    from connector.push_worker import releasable

    assert releasable({"d"}, {"d"}, (), (), writing={"d"}) == set()
    assert releasable({"d", "e"}, {"d", "e"}, (), (), writing={"d"}) == {"e"}


# --- item 2: Neuron, whose platform declares device_type "cpu" --------------------------------------------


class NeuronPlatform:
    """Stand-in for vllm-neuron's ``NeuronPlatform``: it reports vLLM's CPU device type."""

    device_type = "cpu"


class OotPlatform:
    device_type = "cpu"


OotPlatform.__module__ = "vllm_neuron.platform"  # another class name, vllm-neuron's module


@pytest.fixture
def running_on(monkeypatch):
    """Make ``vllm.platforms.current_platform`` the given platform object (restored after the test)."""
    import vllm.platforms

    def use(platform: object) -> None:
        monkeypatch.setattr(vllm.platforms, "_current_platform", platform)

    monkeypatch.delenv("TURNKV_ALLOW_UNVERIFIED", raising=False)
    return use


@pytest.mark.parametrize("platform", [NeuronPlatform(), OotPlatform()], ids=["class-name", "module"])
def test_the_connector_refuses_a_neuron_platform_that_reports_cpu(running_on, platform):
    from connector import compat, cpu
    from turnkv import platforms

    running_on(platform)
    with pytest.raises(platforms.UnverifiedPlatformError) as refused:
        compat.check_platform()
    assert str(refused.value) == platforms.refusal("neuron", {})  # the message is the one Neuron always had
    assert not cpu._is_cpu_platform()  # nor are the CPU-only patches applied there
    compat.check_platform(env={"TURNKV_ALLOW_UNVERIFIED": "neuron"})  # the override still works


def test_a_loaded_vllm_neuron_module_means_neuron(monkeypatch, running_on):
    import sys

    from connector import compat, cpu
    from turnkv import platforms

    running_on(type("CpuLike", (), {"device_type": "cpu"})())
    assert cpu._is_cpu_platform()
    compat.check_platform()  # vLLM's CPU platform: nothing refused
    monkeypatch.setitem(sys.modules, "vllm_neuron", types.ModuleType("vllm_neuron"))
    assert compat.current_platform_name() == "neuron" and not cpu._is_cpu_platform()
    with pytest.raises(platforms.UnverifiedPlatformError):
        compat.check_platform()


def test_vllms_own_platforms_keep_their_device_type():
    from vllm.platforms.cpu import CpuPlatform

    from turnkv import platforms

    assert platforms.platform_name(CpuPlatform(), {"vllm"}) == "cpu"
    assert platforms.platform_name(types.SimpleNamespace(device_type="cuda"), ()) == "cuda"


# --- item 3: unequal block sizes, a partly matching proof --------------------------------------------------


def offer_checker(block_size: int):
    """Prefill's scheduler with the state ``_check_offer`` reads (proof required)."""
    from connector.pull import TurnkvPullScheduler
    from connector.stats import TurnkvKVConnectorStats

    s = TurnkvPullScheduler.__new__(TurnkvPullScheduler)
    s.__dict__.update(block_size=block_size, turnkv_stats=TurnkvKVConnectorStats(), _verdicts={}, _require_proof=True)
    return s


def partly_matching_offer(decode_block: int, held: int = 64, matching: int = 40, **extra):
    """Decode held ``held`` tokens in blocks of ``decode_block``; the prompt changes at token ``matching``."""
    from connector import token_proof

    tokens = list(range(1000, 1000 + held))
    prompt = tokens[:matching] + [7] * (held - matching) + list(range(50))
    blocks = list(range(10, 10 + -(-held // decode_block)))
    params = {"do_remote_decode": True, "remote_block_ids": [blocks], "remote_num_tokens": held,
              token_proof.PARAMS_KEY: token_proof.make_proof(tokens, decode_block), **extra}
    return types.SimpleNamespace(request_id="p-1", prompt_token_ids=prompt), params


def test_a_partial_offer_keeps_decodes_blocks_in_decodes_block_size():
    """Prefill blocks of 32, decode blocks of 16, 32 tokens verified: two of decode's blocks hold them (the old cut,
    in prefill's block size, kept one: half the verified KV, with remote_num_tokens still 32)."""
    s = offer_checker(block_size=32)
    req, params = partly_matching_offer(decode_block=16)
    s._check_offer(req, params)
    assert params["remote_num_tokens"] == 32 and params["remote_block_ids"] == [[10, 11]]


@pytest.mark.parametrize(("prefill_block", "decode_block", "extra"), [
    (16, 32, {}),  # upstream reads only when prefill's block size is a multiple of decode's
    (32, 16, {"remote_block_size": 32}),  # the offer's remote_block_size and its proof disagree
    (48, 32, {}),
])
def test_a_partial_offer_with_an_unusable_block_size_is_recomputed(prefill_block, decode_block, extra):
    s = offer_checker(block_size=prefill_block)
    req, params = partly_matching_offer(decode_block=decode_block, **extra)
    blocks = list(params["remote_block_ids"][0])
    s._check_offer(req, params)
    assert params["remote_num_tokens"] == 0 and params["remote_block_ids"] == [blocks]  # decode still notified


def test_remote_block_size_comes_from_the_offer_or_its_proof():
    from connector.scheduler import kept_remote_blocks, remote_block_size

    assert remote_block_size({"remote_block_size": 16}) == 16
    assert remote_block_size({"turnkv_token_proof": {"block_size": 16}, "remote_block_size": 16}) == 16
    assert remote_block_size({}) is None and remote_block_size({"remote_block_size": "16"}) is None
    assert kept_remote_blocks(4, 33, 16, 32) == 3 and kept_remote_blocks(2, 33, 16, 32) is None
    assert kept_remote_blocks(4, 32, None, 32) is None


# --- item 5: speculative decoding ---------------------------------------------------------------------------


def decode_scheduler():
    """Decode's pull scheduler with turnkv's mixin and the state a finished turn's ``request_finished`` reads."""
    from connector.policy import CostModel, StepClock
    from connector.pull import TurnkvPullScheduler
    from connector.retention import ReadDelays, RetentionLedger
    from connector.stats import TurnkvKVConnectorStats
    from tests.unit.test_push_scheduler import scheduler

    s = TurnkvPullScheduler.__new__(TurnkvPullScheduler)
    s.__dict__.update(scheduler().__dict__)
    s.__dict__.update(block_size=16, cost=CostModel(), _steps=StepClock(), _pending={}, _pulls_started={},
                      _admissions=Admissions(), _prefill_cached={}, _prefill_local={},
                      _retain_on_demand=True,
                      _boot=None, _fork_window=0.0, _forkable=set(),
                      _offer_secret=None, _model=None, turnkv_stats=TurnkvKVConnectorStats(), _bytes_per_block=4096,
                      _retained=RetentionLedger(), _read_delays=ReadDelays(), _idle_evict=0.0, _retained_share=0.5,
                      kv_cache_config=types.SimpleNamespace(num_blocks=1000), _host_pool_blocks=0, _host_bases={},
                      _host_started_mib=0, _host_budget_mib=0, _tp_size=1, _evictions={}, _to_host={},
                      _refused_at=float("-inf"), _block_pool=None, _decode_waiting={})
    return s


def test_a_spec_decode_turn_offers_only_the_tokens_it_holds_and_its_proof_verifies():
    """With draft tokens, num_computed_tokens (upstream's remote_num_tokens) can run past the request's token ids:
    the proof then covered fewer tokens than the offer claimed and prefill refused every offer (bad-proof)."""
    from vllm.v1.request import RequestStatus

    from connector import token_proof
    from connector.scheduler import RETAIN_KEY

    tokens = list(range(500, 620))  # 100 prompt tokens + 20 generated
    req = types.SimpleNamespace(request_id="d-1", status=RequestStatus.FINISHED_STOPPED, all_token_ids=tokens,
                                num_computed_tokens=len(tokens) + 3,  # 3 draft tokens' slots counted
                                kv_transfer_params={"do_remote_prefill": False, "do_remote_decode": False,
                                                    RETAIN_KEY: True})
    delay, out = decode_scheduler().request_finished(req, ([1, 2, 3, 4, 5, 6, 7, 8],))
    assert delay and out["remote_num_tokens"] == len(tokens)
    verdict = token_proof.verify(out[token_proof.PARAMS_KEY], [*tokens, 9, 9, 9], out["remote_num_tokens"])
    assert verdict.reason == "ok" and verdict.verified == len(tokens)


# --- item 8: worker metrics over tensor-parallel ranks ------------------------------------------------------


def test_worker_metrics_count_a_request_once_and_read_bandwidth_is_the_engines_over_tp_ranks():
    """TP 2: both ranks refuse one stale offer and each READs 1 MB in 0.5 s, at the same time. vLLM sums the ranks'
    stats: the stale offer was counted twice and read seconds were 1.0 s (bandwidth 2 MB/s, half the engine's)."""
    from connector import boot
    from connector.worker import TurnkvWorkerMixin

    class Upstream:
        def __init__(self, rank: int) -> None:
            self.tp_rank, self.world_size = rank, 2
            self._remote_agents = {"decode-0": {(0, rank): "agent"}}
            self._recv_failures: set[str] = set()

        def add_remote_agent(self, meta, remote_tp_rank=0, *args, **kwargs):
            return "agent"

        def start_load_kv(self, metadata):
            pass

        def _read_blocks_for_req(self, req_id, meta):
            pass

        def _handle_failed_transfer(self, req_id, handle, failed, record_failed_transfer=True):
            failed.add(req_id)
            return True

        def _pop_done_transfers(self, transfers):
            self.xfer_stats.data["bytes_transferred"].append(1_000_000)
            self.xfer_stats.data["transfer_duration"].append(0.5)
            return set(transfers), set()

    class Rank(TurnkvWorkerMixin, Upstream):
        pass

    ranks = [Rank(0), Rank(1)]
    meta = types.SimpleNamespace(remote=types.SimpleNamespace(engine_id="decode-0"))
    for r, w in enumerate(ranks):
        w.add_remote_agent(types.SimpleNamespace(engine_id="decode-0", agent_metadata=f"r{r}-boot2".encode()), r)
        stamp = boot.stamp([boot.fingerprint(b"r0-boot1"), boot.fingerprint(b"r1-boot1")])
        w.start_load_kv(types.SimpleNamespace(turnkv_reads={"old": ReadPlan(boot=stamp)}))
        w._read_blocks_for_req("old", meta)  # every rank refuses the stale offer
        w._pop_done_transfers({"t": [1]})  # and finishes a READ of its 1 MB shard in 0.5 s
    engine = ranks[0].xfer_stats.aggregate(ranks[1].xfer_stats)  # what vLLM's output aggregator does
    data = engine.data
    assert sum(data["turnkv_stale_offers"]) == 1
    assert sum(data["turnkv_read_bytes"]) == 2_000_000
    assert sum(data["turnkv_read_bytes"]) / sum(data["turnkv_read_seconds"]) == pytest.approx(4_000_000)


# --- FP8 KV cache: no fix needed, the model fingerprint carries the KV dtype -------------------------------


def test_an_offer_from_an_fp8_kv_cache_is_refused_by_a_prefill_with_another_kv_dtype():
    """KV of another dtype (fp8 on decode, the model's dtype on prefill) is not interchangeable: the offer's model
    fingerprint includes the KV cache dtype, so such an offer is "forged" and recomputed; equal dtypes read."""
    import time

    from connector.offers import model_fields
    from turnkv import wire

    def fingerprint(cache_dtype: str) -> str:
        config = types.SimpleNamespace(model_config=types.SimpleNamespace(model="m", dtype="bfloat16"),
                                       cache_config=types.SimpleNamespace(cache_dtype=cache_dtype))
        return wire.model_fingerprint(model_fields(config), env={})

    fp8, auto = fingerprint("fp8"), fingerprint("auto")
    assert fp8 != auto
    offer = wire.sign_offer(b"secret", {"remote_engine_id": "decode-0", "remote_block_ids": [[1]],
                                        "remote_num_tokens": 16}, time.time() + 100, fp8)
    assert wire.check_offer(b"secret", offer, auto, time.time(), 5) == "forged"
    assert wire.check_offer(b"secret", offer, fp8, time.time(), 5) == "ok"
