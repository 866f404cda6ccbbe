"""bench.fault_load's breakdown of later turns that pulled nothing, by where they fell among the faults (pure)."""

from __future__ import annotations

from bench.fault_load import AFTER_RESTART_S, lost_by_phase, phase_of

FAULTS = [(100.0, "kill", "decode-0"), (105.0, "restart", "decode-0"), (150.0, "healthy", "decode-0"),
          (200.0, "kill", "prefill-1"), (205.0, "restart", "prefill-1"), (240.0, "healthy", "prefill-1")]


def test_each_lost_turn_is_placed_among_the_faults():
    assert phase_of(50.0, FAULTS) == "before any fault"
    assert phase_of(100.0, FAULTS) == phase_of(149.9, FAULTS) == "decode-0 down"
    assert phase_of(150.0 + AFTER_RESTART_S, FAULTS) == "decode-0 back"
    assert phase_of(150.1 + AFTER_RESTART_S, FAULTS) == "calm"
    assert phase_of(201.0, FAULTS) == "prefill-1 down"
    assert phase_of(500.0, FAULTS) == "calm"
    assert phase_of(5.0, []) == "before any fault"


def test_lost_turns_are_counted_by_outcome_then_phase():
    lost = [(120.0, "refused"), (130.0, "refused"), (160.0, "miss"), (400.0, "miss"), (210.0, "recompute")]
    assert lost_by_phase(lost, FAULTS) == {
        "miss": {"decode-0 back": 1, "calm": 1},
        "recompute": {"prefill-1 down": 1},
        "refused": {"decode-0 down": 2},
    }
