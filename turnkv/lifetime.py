"""A conversation's lifetime, from decode's ``decoder_kv_blocks_ttl`` to the router's expiry (pure, no I/O).

Decode keeps a finished turn's blocks ``decoder_kv_blocks_ttl`` seconds for the next turn's READ (a lease extends
that), and everything downstream must stop using them *before* decode frees them. The deadlines along that chain
are computed here, once; the places that enforce them call these functions (docs/router.md, "Who enforces the
TTL", names each one):

- decode stamps its offer with a wall-clock expiry (``decode_wall_expiry``) and signs it (``turnkv.wire``);
- prefill refuses an offer ``expiry_skew_margin`` before that expiry on its own clock (``offer_expired``);
- the router keeps a stored entry at most ``entry_lifetime`` and never past decode's expiry minus
  ``expiry_margin`` (``entry_expiry``); the tunables catalog keeps ``conversation_ttl`` inside the engine TTL
  (``conversation_fits``, ``fitted_conversation_ttl``); the store forgets the entry then (``store_ttl_ms``);
- a lease moves decode's expiry (``renewed_until``, ``lease_ttl_ok``, ``default_lease_ttl``), the re-signed offer
  carries it on the wall clock (``wall_from_monotonic``), and the router's entry follows it (``entry_expiry``).

Two clocks meet here: upstream stamps ``remote_blocks_expiry_time`` on decode's ``time.perf_counter`` (no other
host can compare it); turnkv's signed ``turnkv_expires_at`` is the same instant on decode's wall clock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# -- the router's entry ------------------------------------------------------------------------------


def entry_lifetime(conversation_ttl: float, decoder_kv_blocks_ttl: float, expiry_margin: float) -> float:
    """Seconds a stored entry may be replayed, counted from when the router stores it: the router's own
    ``conversation_ttl``, and always ``expiry_margin`` before decode's TTL runs out."""
    return float(min(conversation_ttl, decoder_kv_blocks_ttl - expiry_margin))


def entry_expiry(now: float, lifetime: float, engine_expiry: float | None, margin: float) -> float:
    """When a stored entry stops being replayable: the earlier of ``now + lifetime`` and decode's wall-clock
    expiry (``turnkv_expires_at``, None when the offer has none) minus ``margin``.

    Decode's clock is the authority: ``now`` is when the router stores the entry, which for a slow reader of a
    long stream is long after decode finished and started its TTL."""
    expiry = now + lifetime
    if engine_expiry is not None:
        expiry = min(expiry, float(engine_expiry) - margin)
    return expiry


def store_ttl_ms(expires_at: float, now: float) -> int:
    """Milliseconds a store keeps an entry that expires at ``expires_at`` (0 or less: already expired)."""
    return int((expires_at - now) * 1000)


# -- the tunables: the router's TTL inside decode's ---------------------------------------------------


def conversation_fits(conversation_ttl: float, decoder_kv_blocks_ttl: float, expiry_margin: float) -> bool:
    """Whether the router's TTL plus its margin stays within decode's TTL (else it would replay freed blocks)."""
    return conversation_ttl + expiry_margin <= decoder_kv_blocks_ttl


def fitted_conversation_ttl(decoder_kv_blocks_ttl: float, expiry_margin: float, minimum: float) -> float:
    """The router's TTL lowered to fit a new engine TTL (never below the catalog's ``minimum``)."""
    return max(minimum, decoder_kv_blocks_ttl - expiry_margin)


# -- decode's expiry, on both clocks ----------------------------------------------------------------


def wall_from_monotonic(mono_expiry: float, mono_now: float, wall_now: float) -> float:
    """Decode's monotonic (``perf_counter``) expiry as a wall-clock instant, both clocks read now."""
    return wall_now + (mono_expiry - mono_now)


def decode_wall_expiry(mono_expiry: Any, ttl: float, wall_now: float, mono_clock: Callable[[], float]) -> float:
    """The wall-clock expiry decode signs into its offer: upstream's ``remote_blocks_expiry_time`` converted (the
    monotonic clock read only then) when it gave one, else ``wall_now`` plus the TTL."""
    if isinstance(mono_expiry, (int, float)):
        return wall_from_monotonic(float(mono_expiry), mono_clock(), wall_now)
    return wall_now + float(ttl)


def offer_expired(now: float, expires_at: float, skew: float) -> bool:
    """Prefill's check on its own wall clock: an offer is dead ``skew`` seconds before its signed expiry."""
    return now >= expires_at - skew


# -- leases ------------------------------------------------------------------------------------------


def lease_ttl_ok(ttl: Any, max_ttl: float) -> bool:
    """Whether a lease call's ``ttl`` is a number of seconds in (0, ``max_ttl``]."""
    return not isinstance(ttl, bool) and isinstance(ttl, (int, float)) and 0 < ttl <= max_ttl


def default_lease_ttl(lease_max_ttl: float, decoder_kv_blocks_ttl: float) -> float:
    """The lease a client gets when it names none: one more engine TTL, within the router's bound."""
    return min(lease_max_ttl, decoder_kv_blocks_ttl)


def renewed_until(held_until: float, now: float, ttl: float) -> float:
    """A retained turn's new expiry (decode's monotonic clock) after a lease of ``ttl``: never shortened."""
    return max(held_until, now + ttl)
