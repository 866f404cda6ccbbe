"""turnkv.lifetime: the conversation's deadlines, with the numbers the router, the connector and the catalog computed
before they called it (each old expression is repeated here as the reference)."""

from __future__ import annotations

import itertools
import time

import pytest

from turnkv import lifetime, params

#: (conversation_ttl, decoder_kv_blocks_ttl, expiry_margin): the catalog's defaults, an engine TTL set alone, a
#: router TTL below it, the bounds.
TTLS = [(450, 480, 10), (110, 120, 10), (300, 480, 10), (5, 10, 5), (3600, 3600, 120), (450, 455, 10)]


@pytest.mark.parametrize(("conversation", "engine", "margin"), TTLS)
def test_the_entry_lifetime_is_the_router_ttl_within_decodes(conversation, engine, margin):
    assert lifetime.entry_lifetime(conversation, engine, margin) == float(min(conversation, engine - margin))


def test_the_entry_lifetime_at_the_catalogs_defaults():
    d = params.defaults()
    assert lifetime.entry_lifetime(d["conversation_ttl"], d["decoder_kv_blocks_ttl"], d["expiry_margin"]) == 450.0
    assert lifetime.entry_lifetime(450, 300, 10) == 290.0  # decode's TTL lowered under the router's


def test_the_entry_expiry_is_decodes_clock_minus_the_margin_when_sooner():
    now = 1_800_000_000.0
    assert lifetime.entry_expiry(1000, 450, None, 10) == 1450
    assert lifetime.entry_expiry(now, 450, now + 100, 10) == now + 90
    assert lifetime.entry_expiry(now, 450, now - 30, 10) == now - 40
    assert lifetime.entry_expiry(now, 450, now + 1000, 10) == now + 450
    for engine_expiry, life, margin in itertools.product((None, now + 5, now + 460.5, now + 9999), (450.0, 290.0),
                                                        (10.0, 5.0)):
        old = now + life
        if engine_expiry is not None:
            old = min(old, float(engine_expiry) - margin)
        assert lifetime.entry_expiry(now, life, engine_expiry, margin) == old


def test_the_store_keeps_an_entry_for_its_remaining_milliseconds():
    assert lifetime.store_ttl_ms(1450.0, 1000.0) == 450_000
    assert lifetime.store_ttl_ms(1000.0004, 1000.0) == 0  # under a millisecond: the store refuses (already gone)
    assert lifetime.store_ttl_ms(999.0, 1000.0) == -1000
    for expires, now in ((1_800_000_450.123, 1_800_000_000.0), (10.5, 10.25)):
        assert lifetime.store_ttl_ms(expires, now) == int((expires - now) * 1000)


@pytest.mark.parametrize(("conversation", "engine", "margin"), TTLS)
def test_the_router_ttl_fits_inside_decodes_exactly_as_the_catalog_checked(conversation, engine, margin):
    assert lifetime.conversation_fits(conversation, engine, margin) == (not conversation + margin > engine)


def test_an_engine_ttl_set_alone_lowers_the_router_ttl_to_fit():
    minimum = params.get("conversation_ttl").minimum
    assert lifetime.fitted_conversation_ttl(120, 10, minimum) == 110
    assert lifetime.fitted_conversation_ttl(480, 10, minimum) == 470
    assert lifetime.fitted_conversation_ttl(12, 10, minimum) == minimum == 5  # never below the catalog's minimum
    assert params.fit_router_ttl({"decoder_kv_blocks_ttl": "120"})["conversation_ttl"] == 110
    assert params.fit_router_ttl({"decoder_kv_blocks_ttl": "120", "expiry_margin": "30"})["conversation_ttl"] == 90


def test_decodes_expiry_on_the_wall_clock():
    assert lifetime.wall_from_monotonic(1500.0, 1000.0, 1_800_000_000.0) == 1_800_000_500.0
    assert lifetime.wall_from_monotonic(900.0, 1000.0, 1_800_000_000.0) == 1_800_000_000.0 - 100
    reads = []

    def mono():
        reads.append(1)
        return 1000.0

    # upstream's perf_counter expiry converted; the monotonic clock is read only then
    assert lifetime.decode_wall_expiry(1480.0, 480, 1_800_000_000.0, mono) == 1_800_000_480.0 and len(reads) == 1
    assert lifetime.decode_wall_expiry(1480, 480, 1_800_000_000.0, mono) == 1_800_000_480.0
    assert lifetime.decode_wall_expiry(None, 480, 1_800_000_000.0, mono) == 1_800_000_480.0 and len(reads) == 2
    assert lifetime.decode_wall_expiry("soon", 300, 5.0, mono) == 305.0


def test_the_connectors_wall_expiry_goes_through_the_module():
    from connector.scheduler import _wall_expiry

    mono = time.perf_counter() + 480
    assert _wall_expiry({"remote_blocks_expiry_time": mono}, 10) == pytest.approx(time.time() + 480, abs=1)
    assert _wall_expiry({}, 480) == pytest.approx(time.time() + 480, abs=1)


def test_prefill_refuses_an_offer_skew_seconds_before_its_expiry():
    expires = 1_800_000_000.0
    assert not lifetime.offer_expired(expires - 6, expires, 5)
    assert lifetime.offer_expired(expires - 5, expires, 5)
    assert lifetime.offer_expired(expires - 4, expires, 5)
    assert lifetime.offer_expired(expires, expires, 0) and not lifetime.offer_expired(expires - 0.001, expires, 0)


@pytest.mark.parametrize(("ttl", "ok"), [
    (60, True), (0.5, True), (3600, True), (3600.0001, False), (0, False), (-1, False), (True, False),
    ("60", False), (None, False), (float("nan"), False),
])
def test_a_lease_asks_for_seconds_within_the_bound(ttl, ok):
    assert lifetime.lease_ttl_ok(ttl, 3600) is ok
    old = not (isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl <= 3600)
    assert old is ok


def test_the_default_lease_and_a_renewal_never_shorten():
    assert lifetime.default_lease_ttl(900, 480) == 480  # the catalog's defaults: one more engine TTL
    assert lifetime.default_lease_ttl(300, 480) == 300
    assert lifetime.renewed_until(1500.0, 1000.0, 600) == 1600.0
    assert lifetime.renewed_until(1500.0, 1000.0, 30) == 1500.0  # a shorter lease leaves the longer one
