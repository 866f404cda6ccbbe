"""The engines' fair queue (router.fairqueue, pure) and its event-loop side (router.enginegate): fairness, a lone
tenant never held, the heaviest cut first, no starvation, nothing leaked however a request ends."""

from __future__ import annotations

import asyncio
import random

import pytest

from router.enginegate import EngineGate
from router.fairqueue import FairQueue, Ticket


def take(q: FairQueue, tenant: str, n: int, cost: float = 1) -> list[Ticket]:
    return [q.acquire(tenant, cost) for _ in range(n)]


def test_a_lone_tenant_is_never_held_whatever_it_asks():
    q = FairQueue(4)
    tickets = take(q, "solo", 50)
    assert all(t.granted for t in tickets) and q.waiting == 0 and q.in_flight("solo") == 50
    big = q.acquire("solo", 10_000)  # larger than the whole capacity: clipped, and alone it goes
    assert big.granted and big.cost == 4


def test_without_the_lone_exemption_a_lone_tenant_gets_the_capacity_and_a_newcomer_goes_first():
    """Decode's queue (``alone_exempt=False``): the engine runs ``capacity`` sequences at once, so a lone tenant's
    surplus waits here, not in the engine's first-come queue, and the next tenant to come goes ahead of it."""
    q = FairQueue(4, alone_exempt=False)
    solo = take(q, "solo", 6)
    assert [t.granted for t in solo] == [True] * 4 + [False] * 2
    newcomer = q.acquire("new", 1)
    assert newcomer.granted, "under the fair level: it goes at once (the pool over capacity by one request)"
    assert q.done(solo[0]) == [] and q.total == 4, "solo's room goes back to the pool: solo is over its fair share"
    assert q.done(newcomer) == [solo[4]] and q.done(solo[1]) == [solo[5]]
    for t in solo:
        q.done(t)
    assert q.total == 0 and q.waiting == 0


def test_a_tenant_between_two_turns_still_counts_so_the_heavy_one_is_not_alone():
    """A light tenant with nothing in flight right now (thinking between turns) asked a moment ago: the heavy tenant
    is not alone, so it gets the pool's room, not more; once the light one has been quiet for the window it is."""
    now = [100.0]
    q = FairQueue(4, clock=lambda: now[0])
    q.done(q.acquire("light", 1))  # a turn, answered
    now[0] += 0.5
    heavy = take(q, "heavy", 6)
    assert [t.granted for t in heavy] == [True] * 4 + [False] * 2
    for t in heavy:
        q.done(t)
    now[0] += 2.5  # the light tenant has been quiet for longer than the window
    assert all(t.granted for t in take(q, "heavy", 6))


def test_room_is_first_come_until_the_pool_is_full():
    q = FairQueue(4)
    assert all(t.granted for t in take(q, "a", 2) + take(q, "b", 2))
    late = q.acquire("a", 1)
    assert not late.granted and q.waiting == 1  # a is at its fair half and the pool is full


def test_a_light_tenant_never_waits_behind_a_heavy_one():
    """The heavy tenant filled the pool (alone, it was never held); the light one's requests go at once up to its
    fair level, and the heavy one's new requests wait while it is over its own."""
    q = FairQueue(8)
    heavy = take(q, "heavy", 16)
    assert all(t.granted for t in heavy) and q.total == 16
    light = take(q, "light", 3)
    assert all(t.granted for t in light), "the light tenant is under its fair level: it goes though the pool is full"
    more = q.acquire("heavy", 1)
    assert not more.granted
    # the light tenant goes on being served while it stays under the level (here half of 8)
    assert q.acquire("light", 1).granted
    assert not q.acquire("light", 1).granted  # a fifth in flight is over its half: it waits, as the heavy one does


def test_the_heaviest_is_cut_first_and_released_room_goes_to_the_lightest():
    q = FairQueue(7)
    heavy = take(q, "heavy", 5)  # alone: all go
    middle = take(q, "middle", 1)
    light = take(q, "light", 3)  # under its level each time: all go (the pool holds 9 of 7)
    assert all(t.granted for t in heavy + middle + light) and q.total == 9
    wait_heavy = q.acquire("heavy", 1)  # first to wait, but it holds the most
    wait_light = q.acquire("light", 1)
    assert not wait_heavy.granted and not wait_light.granted  # each at its fair level (3) of a full pool
    assert q.done(middle[0]) == [wait_light], "the room goes to the tenant with the fewest in flight"
    assert not wait_heavy.granted  # the level is now 3.5: heavy (5) is over it
    assert q.done(heavy[0]) == []
    assert q.done(heavy[1]) == [wait_heavy]  # heavy (3) under the level again


def test_each_tenant_keeps_its_own_order():
    q = FairQueue(2)
    take(q, "a", 2)
    first, second = q.acquire("b", 1), q.acquire("b", 1)
    assert first.granted and not second.granted
    third = q.acquire("b", 1)
    assert q.done(first) == [second] and not third.granted


def test_shares_converge_to_max_min_under_contention():
    """Three tenants that always want more (ten requests each, sent again as soon as one ends), their requests
    ending at random: the in-flight shares of a capacity of 12 settle at 4 each, whatever the first one held when
    it was alone."""
    q = FairQueue(12)
    held: dict[str, list[Ticket]] = {"a": take(q, "a", 30), "b": [], "c": []}
    waiting: list[Ticket] = []
    rng = random.Random(7)
    for _ in range(2000):
        for name in "abc":
            while q.in_flight(name) + q.waiting_of(name) < 10:
                t = q.acquire(name, 1)
                (held[name] if t.granted else waiting).append(t)
        name = rng.choice([n for n in "abc" if held[n]])
        for t in q.done(held[name].pop(0)):
            waiting.remove(t)
            held[t.tenant].append(t)
    assert {n: q.in_flight(n) for n in "abc"} == {"a": 4, "b": 4, "c": 4}
    assert q.total == 12


def test_a_tenant_holding_nothing_always_gets_one_request_however_large():
    """Requests are whole: a tenant under its fair level may send one more even if it takes it over the level, so
    every tenant may have one request in flight whatever it asks."""
    q = FairQueue(100)
    take(q, "a", 2, cost=60)  # alone: both go
    huge = q.acquire("b", 10**9)
    assert huge.cost == 100 and huge.granted  # b held nothing: under its level (50)
    assert not q.acquire("b", 1).granted  # b (100) is now over it
    assert q.acquire("c", 80).granted


def test_a_large_request_is_not_starved_by_small_ones():
    """A waiting request of 6 units beside a stream of small ones from a tenant that keeps asking: it is granted
    once its tenant is under its level again (its first request ended), though the other keeps the pool full."""
    q = FairQueue(8)
    small = take(q, "small", 8)
    first = q.acquire("big", 4)
    assert first.granted  # it held nothing
    big = q.acquire("big", 6)
    assert not big.granted  # big (4) is at its fair level (4) and the pool is full
    held = [*small[:3], first, *small[3:]]  # requests end in the order they started
    releases = 0
    while not big.granted and releases < 100:
        woken = q.done(held.pop(0))
        releases += 1
        held += [t for t in woken if t.tenant == "small"]
        t = q.acquire("small", 1)  # the small tenant keeps asking
        if t.granted:
            held.append(t)
    assert big.granted and releases <= 6, releases


def test_done_is_idempotent_and_leaves_nothing_behind():
    q = FairQueue(3)
    granted = take(q, "a", 3)
    waiting = take(q, "b", 1) + take(q, "c", 2)
    for t in [*granted, *waiting, *granted, *waiting]:  # every ticket ended twice, in any state
        q.done(t)
    assert q.total == 0 and q.waiting == 0 and q._tenants == {}
    assert q.acquire("z", 3).granted


def test_random_ends_never_leak_or_overdraw():
    """Random acquires and ends (released, or dropped while waiting, like a client gone): the books always add up and
    end empty."""
    rng = random.Random(3)
    q = FairQueue(10)
    live: list[Ticket] = []
    for _ in range(5000):
        if live and rng.random() < 0.5:
            q.done(live.pop(rng.randrange(len(live))))
        else:
            live.append(q.acquire(rng.choice("abcd"), rng.choice([1, 2, 5, 11])))
        granted = [t for t in live if t.granted]
        assert q.total == pytest.approx(sum(t.cost for t in granted))
        assert q.waiting == len(live) - len(granted)
        if q.waiting:
            assert q.total > 0  # someone waits only while something is held
    for t in live:
        q.done(t)
    assert q.total == 0 and q.waiting == 0 and q._tenants == {}


def test_resize_lets_waiters_through():
    q = FairQueue(2)
    take(q, "a", 2)
    w = take(q, "b", 1) + take(q, "b", 1)
    assert w[0].granted and not w[1].granted
    assert q.resize(4) == [w[1]]
    with pytest.raises(ValueError):
        q.resize(0)


# -- the event-loop side ----------------------------------------------------------------------------


def test_gate_wakes_the_waiter_when_room_is_released():
    async def main() -> None:
        gate = EngineGate(2)
        held = [await gate.enter("a", 1), await gate.enter("a", 1)]
        await gate.enter("b", 1)  # under its level: at once
        waiter = asyncio.create_task(gate.enter("a", 1))
        await asyncio.sleep(0)
        assert not waiter.done() and gate.waits == 1
        gate.leave(held[0])
        assert not waiter.done()  # a still holds 1 of its fair 1 and the pool (2) is full
        gate.leave(held[1])
        ticket = await asyncio.wait_for(waiter, 1)
        assert ticket.granted and gate.queue.in_flight("a") == 1

    asyncio.run(main())


def test_gate_a_cancelled_waiter_leaves_the_queue_and_holds_nothing():
    async def main() -> None:
        gate = EngineGate(2)
        a = await gate.enter("a", 1)
        b = await gate.enter("b", 1)
        waiter = asyncio.create_task(gate.enter("a", 1))
        await asyncio.sleep(0)
        assert not waiter.done()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert gate.queue.waiting == 0 and gate.queue.in_flight("a") == 1 and gate._wakers == {}
        gate.leave(a)
        gate.leave(b)
        assert gate.queue.total == 0 and gate.queue._tenants == {}

    asyncio.run(main())


def test_gate_a_waiter_cancelled_just_after_its_grant_gives_the_room_back():
    async def main() -> None:
        gate = EngineGate(2)
        a = await gate.enter("a", 1)
        b = await gate.enter("b", 1)
        waiter = asyncio.create_task(gate.enter("a", 1))
        await asyncio.sleep(0)
        gate.leave(a)  # the waiter is granted (its future set), but it has not run yet
        assert gate.queue.in_flight("a") == 1 and not waiter.done()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert gate.queue.in_flight("a") == 0 and gate._wakers == {}
        gate.leave(b)
        assert gate.queue.total == 0 and gate.queue._tenants == {}

    asyncio.run(main())


def test_gate_follows_the_pool_capacity():
    async def main() -> None:
        gate = EngineGate(2)
        await gate.enter("a", 1)
        await gate.enter("b", 1)
        waiter = asyncio.create_task(gate.enter("a", 1))
        await asyncio.sleep(0)
        assert not waiter.done()
        await asyncio.wait_for(gate.enter("c", 1, capacity=4), 1)  # the pool grew: the waiter fits now
        assert (await asyncio.wait_for(waiter, 1)).granted

    asyncio.run(main())
