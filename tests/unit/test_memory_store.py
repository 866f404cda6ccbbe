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
