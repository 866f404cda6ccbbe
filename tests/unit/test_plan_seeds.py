"""The seeds' TTFT table as a check of the planner (never a fit): Qwen3-32B at 24k and GLM-5-FP8 at 20k
prompt tokens, 1P1D p5en.48xlarge, TP 8, prefix caching off on prefill, threshold 64, TTL 480 s.

Inputs, written out (from the seeds and from the feature's public benchmark, vllm-project/vllm#32553,
which the seeds' sweep builds on): one turn whose prompt is the row's length; decode holds everything
before this turn's user message (history = prompt - 140); the user message is 140 tokens (the
benchmark's 120-160); vLLM's GPU block size 16; pull mode; no queueing (the benchmark's 2 clients
spend ~20 s decoding 800-1,200 tokens per turn against well under a second of prefill).

What the model gets (figures in /work/notes/issue-14.md): reuse off within 25% for Qwen3-32B (-17%),
just outside for GLM-5-FP8 (-29%); reuse on far below both rows (-69%, -74%). The seeds say TTFT with
reuse stays "near-flat" across prompt lengths at 460-700 ms while their transfers take 30-130 ms: the
measured path carries ~300-500 ms that no published per-request cost accounts for (two hops, transfer
set-up, decode's first step sum to ~50 ms here). The strict xfails below keep that gap on record and
fail the day the model closes it, so the tolerance can become a plain assertion.
"""

import pytest

from turnkv.plan import hardware, models
from turnkv.plan import model as plan_model

SEEDS = {  # model: (prompt tokens, TTFT off ms, TTFT on ms, KV transfer range ms) from the seeds
    "Qwen3-32B": (24_000, 778, 460, (30, 130)),
    "GLM-5-FP8": (20_000, 2334, 702, (29, 110)),
}
NEW_TOKENS = 140
TOLERANCE = 0.25


def predict(name: str) -> plan_model.TurnCosts:
    inst = hardware.load("p5en.48xlarge")
    fleet = plan_model.Fleet(models.load(name), inst, inst, tp_prefill=8, tp_decode=8, block_size=16, mode="pull",
                             ttl_s=480, threshold=64, prefill_prefix_caching=False)
    prompt = SEEDS[name][0]
    return plan_model.turn_costs(fleet, [prompt], [prompt - NEW_TOKENS])


def off_by(predicted_s, seed_ms: float) -> float:
    return float(predicted_s[0]) * 1000 / seed_ms - 1


@pytest.mark.parametrize("name", list(SEEDS))
def test_transfer_time_falls_in_the_seeds_range(name):
    low, high = SEEDS[name][3]
    ms = float(predict(name).transfer_on[0]) * 1000
    assert low <= ms <= high * (1 + TOLERANCE), f"{name}: predicted {ms:.0f} ms, seeds {low}-{high} ms"


@pytest.mark.parametrize("name", list(SEEDS))
def test_reuse_wins_and_more_for_the_model_whose_recompute_costs_more(name):
    c = predict(name)
    assert c.ttft_on[0] < c.ttft_off[0]
    speedups = {n: float(predict(n).ttft_off[0] / predict(n).ttft_on[0]) for n in SEEDS}
    assert speedups["GLM-5-FP8"] > speedups["Qwen3-32B"]  # seeds: 3.3x against 1.6x


def test_qwen3_32b_reuse_off_within_25_percent():
    assert abs(off_by(predict("Qwen3-32B").ttft_off, SEEDS["Qwen3-32B"][1])) <= TOLERANCE


@pytest.mark.xfail(strict=True, reason="GLM-5-FP8 recompute predicted 29% under the seeds (MoE + DSA factors "
                                       "from vLLM's blogs, not from this table)")
def test_glm5_reuse_off_within_25_percent():
    assert abs(off_by(predict("GLM-5-FP8").ttft_off, SEEDS["GLM-5-FP8"][1])) <= TOLERANCE


@pytest.mark.xfail(strict=True, reason="the seeds' reuse-on TTFT carries ~300-500 ms the model has no published "
                                       "cost for (see the module docstring)")
@pytest.mark.parametrize("name", list(SEEDS))
def test_reuse_on_within_25_percent(name):
    assert abs(off_by(predict(name).ttft_on, SEEDS[name][2])) <= TOLERANCE
