from router.guard import History
from router.state import Entry
from router.state.memory import MemoryStore

H = History("chat", "r", "d", 3)


def entry(expires_at=100.0):
    return Entry({"remote_engine_id": "d"}, H, expires_at, "decode-0")


async def test_take_is_single_use():
    store = MemoryStore(10, clock=lambda: 0.0)
    await store.put("k", entry())
    assert (await store.take("k")) == entry()
    assert await store.take("k") is None


async def test_expired_entries_are_never_returned_and_purged():
    now = [0.0]
    store = MemoryStore(10, clock=lambda: now[0])
    await store.put("a", entry(expires_at=5))
    await store.put("b", entry(expires_at=50))
    now[0] = 10
    assert store.purge_expired() == 1
    await store.put("c", entry(expires_at=12))
    now[0] = 20
    assert await store.take("c") is None
    assert await store.take("b") is not None


async def test_bounded_lru():
    store = MemoryStore(2, clock=lambda: 0.0)
    for key in "abc":
        await store.put(key, entry())
    assert len(store) == 2 and store.evicted == 1
    assert await store.take("a") is None


def test_entry_round_trips_through_bytes():
    e = entry()
    assert Entry.from_bytes(e.to_bytes()) == e


async def test_bounded_in_bytes_whatever_the_entry_count():
    """A 128k-token entry is about 208 KB: an entry-count bound alone lets the store outgrow its task."""
    big = Entry({"remote_block_ids": [list(range(8000))], "turnkv_token_proof": {"digests": ["ab" * 8] * 1000}},
                H, 100.0, "decode-0")
    store = MemoryStore(100_000, clock=lambda: 0.0, max_bytes=1_000_000)
    for i in range(40):
        await store.put(f"{i:04x}", big)
    assert store.bytes <= 1_000_000 and 0 < len(store) < 40 and store.evicted == 40 - len(store)
    assert await store.take("0000") is None and await store.take(f"{39:04x}") is not None
    assert store.bytes < 1_000_000 - 20_000
    store.max_bytes = 100  # an entry larger than the whole store is not kept
    await store.put("ffff", entry())
    assert store.peek("ffff") is None


async def test_swap_is_compare_and_set():
    store = MemoryStore(10, clock=lambda: 0.0)
    await store.put("k", entry())
    assert await store.get("k") == entry()
    assert await store.swap("k", entry(expires_at=1.0), entry(expires_at=200.0)) is False  # not what is stored
    assert await store.swap("k", entry(), entry(expires_at=200.0)) is True
    assert (await store.get("k")).expires_at == 200.0
    assert await store.swap("k", entry(expires_at=200.0), None) is True and await store.get("k") is None
