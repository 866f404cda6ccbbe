"""bench.plan_accuracy's pure parts: predictions from calibration constants, the turn-by-turn comparison."""

import pytest

from bench import plan_accuracy
from turnkv.plan import calibrate, hardware
from turnkv.plan.architectures import tiny_local


def _constants(hop=0.02, ctx_rate=40e9):
    fit = {"hop_s": hop, "linear_flops_s": 90e9, "attention_flops_s": 60e9, "context_attention_flops_s": ctx_rate,
           "step_s": 0.0}
    return calibrate.constants(tiny_local(), hardware.INSTANCES["local-cpu"], fit, (0.002, 1.5 * 2**30), {})


def test_predictions_follow_the_demo_workload_and_the_constants():
    rows = plan_accuracy.predict(_constants())
    assert [r["turn"] for r in rows] == list(range(1, 9))
    assert [r["prompt_tokens"] for r in rows] == sorted(r["prompt_tokens"] for r in rows)
    assert rows[0]["ttft_ms_on"] == rows[0]["ttft_ms_off"]  # nothing to pull on a first turn
    assert all(r["ttft_ms_on"] < r["ttft_ms_off"] for r in rows[1:])
    # slower attention over a cached context makes only the reuse-on arm slower
    slow = plan_accuracy.predict(_constants(ctx_rate=20e9))
    assert slow[-1]["ttft_ms_on"] > rows[-1]["ttft_ms_on"]
    # a dearer hop adds two hops to both arms
    dear = plan_accuracy.predict(_constants(hop=0.03))
    assert dear[-1]["ttft_ms_off"] - rows[-1]["ttft_ms_off"] == pytest.approx(20, abs=0.2)


def test_comparison_counts_cells_outside_the_tolerance():
    predicted = [{"ttft_ms_off": 110.0, "ttft_ms_on": 110.0}, {"ttft_ms_off": 200.0, "ttft_ms_on": 50.0}]
    measured = [{"turn": 1, "prompt_tokens": 1000, "ttft_ms_off": 100.0, "ttft_ms_on": 100.0},
                {"turn": 2, "prompt_tokens": 1400, "ttft_ms_off": 160.0, "ttft_ms_on": 40.0}]
    rows = plan_accuracy.compare(predicted, measured)
    assert rows[1]["error_off"] == pytest.approx(0.25) and rows[0]["error_on"] == pytest.approx(0.10)
    assert "cells outside ±15%: 2 of 4" in plan_accuracy.markdown(rows, 0.15)
