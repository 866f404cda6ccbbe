"""bench.fault_load's breakdown of later turns that pulled nothing, by where they fell among the faults (pure)."""

from __future__ import annotations

from bench.fault_load import AFTER_RESTART_S, counter_increase, lost_by_phase, phase_of, retention_samples

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


def test_counted_events_add_their_counts():
    found = [(120.0, "evicted on decode-1", 30.0), (125.0, "evicted on decode-1", 5.0),
             (170.0, "refused on decode-1", 4.0)]
    assert lost_by_phase(found, FAULTS) == {"evicted on decode-1": {"decode-0 down": 35},
                                            "refused on decode-1": {"decode-0 back": 4}}


def test_decode_retention_counters_rise_and_start_over_with_a_restarted_engine():
    last: dict = {}
    assert counter_increase(last, ("decode-0", "evicted"), 0.0) == 0
    assert counter_increase(last, ("decode-0", "evicted"), 12.0) == 12
    assert counter_increase(last, ("decode-0", "evicted"), 12.0) == 0
    assert counter_increase(last, ("decode-0", "evicted"), 3.0) == 3  # restarted: counting from 0 again
    text = ('# TYPE vllm:turnkv_retention_evicted_total counter\n'
            'vllm:turnkv_retention_evicted_total{engine="0",model_name="tiny"} 7.0\n'
            '# TYPE vllm:turnkv_retention_refused_total counter\n'
            'vllm:turnkv_retention_refused_total{engine="0",model_name="tiny"} 2.0\n')
    assert retention_samples(text) == {"evicted": 7.0, "refused": 2.0}
    assert retention_samples("") == {"evicted": 0.0, "refused": 0.0}


def test_replays_use_the_loads_own_request_settings():
    """Issue 31: --max-tokens 48 replayed with 16 counted every longer answer as wrong reuse."""
    import argparse

    from bench.fault_load import replay_body, request_settings

    sent = {**request_settings(argparse.Namespace(max_tokens=48)), "messages": [{"role": "user", "content": "x"}],
            "stream": True, "conversation_id": "c", "return_token_ids": True}
    replay = replay_body(sent)
    assert replay["max_tokens"] == 48 and replay["temperature"] == 0 and replay["messages"] == sent["messages"]
    assert "stream" not in replay and "conversation_id" not in replay
