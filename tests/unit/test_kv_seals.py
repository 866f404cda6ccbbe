"""KV seals (issue 50): decode digests the bytes of a retained turn's blocks, the seal travels under a MAC bound to the
offer through decode's feed and the router, and prefill checks every block a READ brought before anything computes
with it. Real torch tensors stand for the engines' KV caches; a READ is a copy of blocks from one to the other."""

from __future__ import annotations

import queue
import time
import types

import pytest

torch = pytest.importorskip("torch")

from connector import fingerprint, seals  # noqa: E402
from connector.admission import ReadPlan  # noqa: E402
from connector.leases import merge_feeds  # noqa: E402
from router.engines.evictions import SEAL_PENDING, EvictionFeed  # noqa: E402
from turnkv import wire  # noqa: E402

SECRET = b"s" * 32
LAYERS, BLOCKS, BLOCK_SIZE, HEADS, DIM = 4, 32, 16, 2, 8


def kv_cache(seed: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """An engine's KV cache as vLLM 0.32's NIXL worker lays it out: one block-major tensor per layer."""
    gen = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.attn": torch.randn(BLOCKS, 2, BLOCK_SIZE, HEADS, DIM, generator=gen).to(dtype)
            for i in range(LAYERS)}


def sampler(caches) -> fingerprint.Sampler:
    return fingerprint.Sampler([v for n in sorted(caches) for v in fingerprint.block_major_views(caches[n], BLOCKS)])


def read(src, dst, src_blocks, dst_blocks) -> None:
    for name in src:
        dst[name][list(dst_blocks)] = src[name][list(src_blocks)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_equal_bytes_give_equal_digests_on_every_engine_and_any_misplacement_changes_them(dtype):
    decode, prefill = kv_cache(1, dtype), kv_cache(2, dtype)
    read(decode, prefill, [3, 4, 5], [10, 11, 12])
    expected = sampler(decode).digests([3, 4, 5])
    assert sampler(prefill).digests([10, 11, 12]) == expected  # a separately built sampler: the same positions
    assert len(set(expected)) == 3
    wrong_block = kv_cache(2, dtype)
    read(decode, wrong_block, [3, 5, 5], [10, 11, 12])  # the second block read from its neighbour
    assert fingerprint.mismatched(expected, sampler(wrong_block).digests([10, 11, 12]), [10, 11, 12]) == [11]
    swapped = kv_cache(2, dtype)
    read(decode, swapped, [3, 4, 5], [10, 11, 12])
    assert seals.swap_layers(swapped, BLOCKS, 12)  # a READ that wrote two layers into each other's place
    assert fingerprint.mismatched(expected, sampler(swapped).digests([10, 11, 12]), [10, 11, 12]) == [12]
    half = kv_cache(2, dtype)
    read(decode, half, [3, 4, 5], [10, 11, 12])
    half["model.layers.3.attn"][10, 1, BLOCK_SIZE - 1] = 0  # the last token of the last layer's V never landed
    assert fingerprint.mismatched(expected, sampler(half).digests([10, 11, 12]), [10, 11, 12]) == [10]


def test_k_and_v_split_caches_are_fingerprinted_per_half():
    cache = torch.randn(2, BLOCKS, BLOCK_SIZE, HEADS, DIM)
    views = fingerprint.block_major_views(cache, BLOCKS)
    assert len(views) == 2 and views[0].shape[0] == BLOCKS
    assert fingerprint.block_major_views(torch.zeros(7, 3), BLOCKS) == []


def test_digests_travel_as_text_and_garbage_is_refused():
    values = [0, 1, (1 << 64) - 1, 12345678901234567]
    assert fingerprint.decode(fingerprint.encode(values)) == values
    assert fingerprint.decode("not base64!") is None and fingerprint.decode("AAAA") is None
    assert fingerprint.decode(None) is None


def test_a_read_that_skips_prefills_own_cached_blocks_is_compared_on_the_tail():
    # decode offered 5 blocks; prefill's own cache held the first 2, so the READ filled 3 local blocks with the last 3
    assert fingerprint.mismatched([1, 2, 3, 4, 5], [3, 4, 5], [20, 21, 22]) == []
    assert fingerprint.mismatched([1, 2, 3, 4, 5], [3, 9, 5], [20, 21, 22]) == [21]
    assert fingerprint.mismatched([4, 5], [3, 4, 5], [20, 21, 22]) == [20]  # nothing sealed for the first: refused


def test_a_seal_is_bound_to_its_offer_and_rank():
    offer = {wire.SIGNATURE: "sig-a", wire.TP_SIZE: 2, wire.REMOTE_ENGINE_ID: "decode-0",
             wire.REMOTE_REQUEST_ID: "d1", wire.BOOT: "boot-1"}
    texts = [fingerprint.encode([1, 2]), fingerprint.encode([3, 4])]
    entries = [[r, t, wire.seal_mac(SECRET, wire.seal_identity(offer), r, t)] for r, t in enumerate(texts)]
    assert wire.seal_digests(SECRET, {**offer, wire.SEALS: entries}, 2) == texts
    renewed = {**offer, wire.SIGNATURE: "sig-renewed", wire.SEALS: entries}  # a lease renewal re-signs the offer
    assert wire.seal_digests(SECRET, renewed, 2) == texts
    assert wire.seal_digests(SECRET, {**offer, wire.SEALS: entries[:1]}, 2) is None  # a rank missing
    moved = {**offer, wire.REMOTE_REQUEST_ID: "d2", wire.SEALS: entries}
    assert wire.seal_digests(SECRET, moved, 2) is None  # another turn's seal
    restarted = {**offer, wire.BOOT: "boot-2", wire.SEALS: entries}
    assert wire.seal_digests(SECRET, restarted, 2) is None  # the same request id in a restarted decode
    swapped = [[0, texts[1], entries[0][2]], entries[1]]
    assert wire.seal_digests(SECRET, {**offer, wire.SEALS: swapped}, 2) is None  # edited digests
    assert wire.seal_digests(None, {**offer, wire.SEALS: entries}, 2) is None


class _Upstream:
    def __init__(self, caches, rank=0, world=1):
        self.device_kv_caches, self.num_blocks, self.tp_rank, self.world_size = caches, BLOCKS, rank, world
        self.block_size, self._recving_metadata, self._recv_failures = BLOCK_SIZE, {}, set()
        self._invalid_block_ids: queue.Queue = queue.Queue()

    def register_kv_caches(self, kv_caches):
        pass


def _worker(monkeypatch, caches, rank=0, world=1):
    from connector.stats import TurnkvKVConnectorStats
    from connector.worker import TurnkvWorkerMixin

    monkeypatch.setenv(wire.OFFER_SECRET_ENV, SECRET.decode())

    class Worker(TurnkvWorkerMixin, _Upstream):
        pass

    w = Worker.__new__(Worker)
    _Upstream.__init__(w, caches, rank, world)
    w._turnkv_sampler, w._turnkv_seals, w._turnkv_secret = seals.sampler_for(w), seals.SealBook(), SECRET
    w._turnkv_evicted, w._turnkv_evict_seq, w._turnkv_epoch, w._turnkv_hosted = {}, 0, "e1", {}
    w._turnkv_plans, w._turnkv_checked, w._turnkv_remote_meta = {}, set(), {}
    w.xfer_stats = TurnkvKVConnectorStats()
    return w


IDENTITY = {wire.REMOTE_ENGINE_ID: "decode-0", wire.REMOTE_REQUEST_ID: "d1", wire.BOOT: "b1"}


def _seal_and_route(monkeypatch, decode_ranks, request_id="d1", blocks=(3, 4, 5)):
    """Decode's ranks seal a retained turn; the router reads their merged feed and attaches the seals to the replay;
    prefill's scheduler turns them into each READ's plan."""
    until = time.time() + 60
    for w in decode_ranks:
        w._turnkv_seal({request_id: (list(blocks), wire.seal_identity(IDENTITY), until)})
    feed = merge_feeds([w.turnkv_evictions(0) for w in decode_ranks])
    assert feed["seals"] and len(feed["sealed"]) == len(decode_ranks)
    router = EvictionFeed()
    assert router.refuses(request_id, time.time(), 1.0, sealed_ranks=len(decode_ranks)) == SEAL_PENDING
    router.apply(feed, time.time())
    entries = router.seals_of(request_id, len(decode_ranks))
    params = {**IDENTITY, wire.TP_SIZE: len(decode_ranks), wire.SEALED: True, wire.SEALS: entries,
              wire.REMOTE_BLOCK_IDS: [list(blocks)]}
    texts = wire.seal_digests(SECRET, params, len(decode_ranks))
    return tuple(tuple(fingerprint.decode(t)) for t in texts)


def _received(w, request_id, plan, local):
    w._turnkv_plans[request_id] = plan
    w._recving_metadata[request_id] = types.SimpleNamespace(local_block_ids=[list(local)],
                                                            remote=types.SimpleNamespace(engine_id="decode-0"))
    w._turnkv_check_read(request_id)
    bad = set()
    while not w._invalid_block_ids.empty():
        bad |= w._invalid_block_ids.get_nowait()
    return bad


def test_prefill_recomputes_exactly_the_blocks_a_read_brought_wrong(monkeypatch):
    decode = _worker(monkeypatch, kv_cache(1))
    seal = _seal_and_route(monkeypatch, [decode])
    prefill = _worker(monkeypatch, kv_cache(2))
    read(decode.device_kv_caches, prefill.device_kv_caches, [3, 4, 5], [10, 11, 12])
    assert _received(prefill, "p1", ReadPlan(seal=seal), [10, 11, 12]) == set()
    read(decode.device_kv_caches, prefill.device_kv_caches, [3, 7, 5], [13, 14, 15])  # one block from elsewhere
    assert _received(prefill, "p2", ReadPlan(seal=seal, host=((1,), 8)), [13, 14, 15]) == {14}
    data = prefill.xfer_stats.data
    assert data["turnkv_fingerprint_checks"] == [0, 1]  # ok, mismatch
    assert data["turnkv_fingerprint_mismatches"] == [1]  # one block, host path (the tier names the path)
    # checked once: a second look (upstream's report after an inline read's forward) does not check again
    assert _received(prefill, "p2", ReadPlan(seal=seal), [13, 14, 15]) == set()


def test_each_tensor_parallel_rank_checks_its_own_shard(monkeypatch):
    decode = [_worker(monkeypatch, kv_cache(10 + r), r, 2) for r in range(2)]
    seal = _seal_and_route(monkeypatch, decode)
    prefill = [_worker(monkeypatch, kv_cache(20 + r), r, 2) for r in range(2)]
    for r in range(2):
        read(decode[r].device_kv_caches, prefill[r].device_kv_caches, [3, 4, 5], [1, 2, 3])
    read(decode[0].device_kv_caches, prefill[1].device_kv_caches, [5], [3])  # rank 1 got rank 0's shard of block 5
    assert _received(prefill[0], "p", ReadPlan(seal=seal), [1, 2, 3]) == set()
    assert _received(prefill[1], "p", ReadPlan(seal=seal), [1, 2, 3]) == {3}
    odd = _worker(monkeypatch, kv_cache(30))  # TP 1 reading a TP 2 decode: shards differ, not comparable
    assert _received(odd, "q", ReadPlan(seal=seal), [1, 2, 3]) == set()
    assert odd.xfer_stats.data["turnkv_fingerprint_checks"] == [2]  # unverifiable


def test_an_evicted_or_expired_turns_seal_leaves_the_feed(monkeypatch):
    decode = _worker(monkeypatch, kv_cache(1))
    decode._turnkv_seal({"a": ([1], "id-a", time.time() + 60), "b": ([2], "id-b", time.time() - 1)})
    decode._turnkv_evicted["a"] = (99, time.time() + 60)
    feed = decode.turnkv_evictions(0)
    assert feed["sealed"] == [] and len(decode._turnkv_seals) == 0


def test_a_renewed_lease_lists_the_seal_again_with_its_new_expiry(monkeypatch):
    decode = _worker(monkeypatch, kv_cache(1))
    decode._turnkv_renewed = []
    decode._reqs_to_send = {"a": time.perf_counter() + 300}  # upstream's lease, renewed to 300 s from now
    decode._turnkv_seal({"a": ([1, 2], "id-a", time.time() + 10)})
    first = decode.turnkv_evictions(0)
    [[_, _, _, _, until]] = first["sealed"]
    assert until == pytest.approx(time.time() + 10, abs=1)
    decode.turnkv_renewed(["a"])
    again = decode.turnkv_evictions(first["seq"])  # past the cursor: listed again, with the lease's expiry
    [[rid, _, _, _, until]] = again["sealed"]
    assert rid == "a" and until == pytest.approx(time.time() + 300, abs=1)
    feed = EvictionFeed()
    feed.apply(first, time.time())
    feed.apply(again, time.time(), first["seq"])
    assert feed.sealed_until["a"] == pytest.approx(time.time() + 300, abs=1)


def test_the_read_faults_misaddress_as_documented(tmp_path):
    switch = tmp_path / "fault"
    switch.write_text("block\n")
    assert seals.fault({seals.FAULT_FILE_ENV: str(switch)}) == "block"
    switch.write_text("")
    assert seals.fault({seals.FAULT_FILE_ENV: str(switch)}) is None
    assert seals.misaddress([[3, 4, 9]], 10) == [[4, 5, 8]]
    assert seals.fault({}) is None and seals.fault({seals.FAULT_ENV: "layer"}) == "layer"
    with pytest.raises(ValueError, match="expected one of"):
        seals.fault({seals.FAULT_ENV: "bits"})
    assert seals.fault({seals.FAULT_FILE_ENV: "/nonexistent/fault"}) is None
    assert not seals.enabled({seals.ENABLED_ENV: "0"})


def test_a_read_that_ends_after_decode_may_have_freed_its_blocks_is_recomputed(monkeypatch):
    """Issue 50, found by tests/sim (scenario stall): the read-by deadline bounds when a READ starts; decode frees an
    evicted or expired turn expiry_skew_margin after it, whatever READ is still in flight. A READ that ends later
    may have read the next turn's KV: all its blocks are recomputed, sealed or not."""
    prefill = _worker(monkeypatch, kv_cache(2))
    prefill._turnkv_count = lambda key: prefill.xfer_stats.record(key, 1)
    late = ReadPlan(deadline=time.time() - 10, safe_until=time.time() - 5)
    assert _received(prefill, "p1", late, [10, 11, 12]) == {10, 11, 12}
    assert prefill.xfer_stats.data["turnkv_reads_outlived"] == [1]
    in_time = ReadPlan(deadline=time.time() - 1, safe_until=time.time() + 4)  # started by its deadline, ends in time
    assert _received(prefill, "p2", in_time, [13, 14, 15]) == set()
