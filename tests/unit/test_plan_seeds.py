"""The seeds' measurements against the planner: Qwen3-32B at 24k and GLM-5-FP8 at 20k prompt tokens, 1P1D
p5en.48xlarge, TP 8, prefix caching off on prefill, threshold 64, TTL 480 s.

Since issue #28 the four TTFT cells are the GPU fit's calibration rows (turnkv/plan/data/gpu_measurements.json,
turnkv.plan.gpu_calibration), so meeting them is in-sample: it says the fitted terms can describe them, not that
the planner predicts them. What is held out: the seeds' KV transfer ranges (no transfer constant is fitted), and
each reuse-on cell predicted from a fit to the other three (leave-one-out). Those miss by more than 25% (the two
reuse-on cells want per-pull costs ~200 ms apart that one constant cannot give), so that test stays a strict xfail.

Inputs (the data file's ``ttft_assumptions``): the user message is 140 tokens (vllm-project/vllm#32553's
120-160), decode holds the rest, vLLM's GPU block size 16, pull mode, no queueing.
"""

import pytest

from turnkv.plan import gpu_calibration as gc
from turnkv.plan import hardware

TOLERANCE = 0.25
DATA = gc.load_data()
ROWS = {r["id"]: r for r in DATA["ttft"]}


def predict(row_id: str):
    return gc.predict(ROWS[row_id], hardware.load("p5en.48xlarge"), gc.settings(DATA))


@pytest.mark.parametrize("check", gc.transfer_checks(hardware.load("p5en.48xlarge"), DATA), ids=lambda c: c["id"])
def test_held_out_transfer_time_falls_in_the_seeds_range(check):
    assert check["low_ms"] <= check["predicted_ms"] <= check["high_ms"] * (1 + TOLERANCE), check


@pytest.mark.parametrize("model", ["qwen3-32b", "glm-5-fp8"])
def test_reuse_wins(model):
    c = predict(f"{model}-on")
    assert c.ttft_on[0] < c.ttft_off[0]


def test_reuse_wins_more_for_the_model_whose_recompute_costs_more():
    speedups = {m: float(predict(f"{m}-on").ttft_off[0] / predict(f"{m}-on").ttft_on[0])
                for m in ("qwen3-32b", "glm-5-fp8")}
    assert speedups["glm-5-fp8"] > speedups["qwen3-32b"]  # seeds: 3.3x against 1.6x


ERRORS = gc.ttft_errors(hardware.load("p5en.48xlarge"), DATA)
CALIBRATION = [r for r in ERRORS if r["split"] == "calibration"]
HELD_OUT = {r["id"]: r for r in ERRORS if r["split"] == "held_out"}


@pytest.mark.parametrize("row", CALIBRATION, ids=lambda r: r["id"])
def test_calibration_rows_within_25_percent_in_sample(row):
    assert row["source"] == "seeds-bidir-kv"
    assert abs(row["error"]) <= TOLERANCE, row


def test_every_printed_band_covers_the_calibration_residuals():
    band = gc.band()
    assert len(CALIBRATION) == 4 and all(abs(r["error"]) <= band for r in CALIBRATION)


# Held-out first-token figures of other stacks on H100 (TensorRT-LLM v0.5, NIM 1.8.0; docs/planning.md): a guard on
# what was reported when they were added (-35%, -24%, +3% at 2,048 tokens and more), not a fit. Since issue #39 the
# pull's fixed cost is its published components (111 ms), not fitted (246 ms): the seeds' reuse-on cells then want
# more fixed cost per hop, the reuse-off cells less compute, and the dense factor goes to its kernel cap (0.75):
# Llama-2-7B at 2,048 tokens in-process moved from -35% to -48%, past this guard. Shown, not hidden.
_REGRESSED = {"trtllm-llama2-7b-2048": "issue #39: dense factor at its kernel cap once the pull is not fitted "
                                       "(-35% -> -48%)"}


@pytest.mark.parametrize("row_id", [
    pytest.param(r["id"], marks=pytest.mark.xfail(strict=True, reason=_REGRESSED[r["id"]]))
    if r["id"] in _REGRESSED else r["id"]
    for r in DATA["ttft"] if r["split"] == "held_out" and r["prompt_tokens"] >= 2048])
def test_held_out_long_prompts_within_40_percent(row_id):
    assert abs(HELD_OUT[row_id]["error"]) <= 0.40, HELD_OUT[row_id]


@pytest.mark.xfail(strict=True, reason="held out, short prompts: in-process at 128 tokens the planner gives only the "
                                       "weight-read floor (-71%, -75%); one NIM server at 500 tokens pays far less "
                                       "than the seeds' 90 ms per hop (+144%)")
@pytest.mark.parametrize("row_id", [r["id"] for r in DATA["ttft"] if r["split"] == "held_out"
                                    and r["prompt_tokens"] < 2048])
def test_held_out_short_prompts_within_25_percent(row_id):
    assert abs(HELD_OUT[row_id]["error"]) <= TOLERANCE, HELD_OUT[row_id]


@pytest.mark.xfail(strict=True, reason="leave-one-out: Qwen3-32B reuse on predicted from the others is +27%, "
                                       "GLM-5-FP8's -29% (the pull held at its published components); no other vLLM "
                                       "P/D TTFT row is on hand")
@pytest.mark.parametrize("entry", [e for e in gc.leave_one_out(DATA) if e["error"] is not None], ids=lambda e: e["id"])
def test_held_out_reuse_on_within_25_percent(entry):
    assert abs(entry["error"]) <= TOLERANCE, entry
