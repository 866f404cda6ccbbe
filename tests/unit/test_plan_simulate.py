"""turnkv.plan.simulate against the closed form where both apply, and where only the simulation can go."""

from dataclasses import replace

import numpy as np
import pytest

from turnkv.plan import architectures, closed_form, hardware
from turnkv.plan import simulate as sim
from turnkv.plan.workload import Workload, sample

WORKLOAD = {
    "num_conversations": 4000,
    "prompt_input": {
        "num_turns": {"distribution": "uniform", "min": 8, "max": 16},
        "common_prefix_num_tokens": {"distribution": "constant", "value": 500},
        "prefix_num_tokens": {"distribution": "lognormal", "average": 4000, "max": 10000},
        "num_tokens": {"distribution": "uniform", "min": 120, "max": 160},
    },
    "prompt_output": {"num_tokens": {"distribution": "uniform", "min": 200, "max": 400}},
    "num_clients": 32,
    "think_time_s": {"distribution": "lognormal", "average": 120, "max": 1200},
}


def fleet(**kw) -> closed_form.Fleet:
    inst = hardware.load("p5en.48xlarge")
    # queueing and retention under test, not prefill's cache: the seeds' setting (no prefix cache on prefill)
    return closed_form.Fleet(architectures.load("Qwen3-32B"), inst, inst, **({"prefill_prefix_caching": False} | kw))


@pytest.fixture(scope="module")
def setup():
    w = Workload.from_dict(WORKLOAD)
    turns = sample(w, seed=1)
    return w, turns


@pytest.mark.parametrize("ttl", [120, 480])
def test_simulation_agrees_with_the_closed_form_within_5_percent(setup, ttl):
    """Light load, ample decode memory: both apply (queueing small, no capacity evictions)."""
    w, turns = setup
    f = fleet(ttl_s=float(ttl))
    closed = closed_form.evaluate(f, w, turns=turns)
    for arm in ("off", "on"):
        result = sim.simulate(f, w, arm=arm, turns=turns)
        assert result.ttft_s.mean() == pytest.approx(closed.ttft(arm).mean(), rel=0.05), arm
    on = sim.simulate(f, w, arm="on", turns=turns)
    assert on.reuse_share == pytest.approx(closed.retention.reuse_share, rel=0.05)
    assert on.retained_gib_per_decode == pytest.approx(closed.retention.retained_gib_per_decode, rel=0.05)
    assert on.prefill_util == pytest.approx(closed.load_on.prefill_util, rel=0.05)
    if ttl == 120:  # a short TTL loses a visible share of turns: the comparison is not trivial
        assert 0.2 < on.reuse_share < 0.8


def test_lindley_recursion_matches_a_plain_fcfs_loop():
    rng = np.random.default_rng(4)
    arrival = np.sort(rng.uniform(0, 100, 400))
    service = rng.exponential(0.6, 400)
    waits = sim._fcfs_waits(arrival, service, servers=2)
    free = [0.0, 0.0]
    for i, (a, s) in enumerate(zip(arrival, service, strict=True)):
        server = i % 2  # dealt in arrival order
        start = max(a, free[server])
        assert waits[i] == pytest.approx(start - a, abs=1e-9)
        free[server] = start + s


def test_decode_memory_limits_what_the_closed_form_cannot_see(setup):
    """Shrink decode's KV cache below what retention needs: the simulation drops retentions and the hit
    share falls; so does the closed form, to the share of retained KV that fits (its two tiers)."""
    w, turns = setup
    f = fleet()
    closed = closed_form.evaluate(f, w, turns=turns)
    roomy = sim.simulate(f, w, arm="on", turns=turns)
    need = closed.retention.retained_gib_per_decode * 2**30
    weights = f.model.total_params() * f.model.weight_bytes_per_param
    tight_hbm = (weights + 0.5 * need) / (8 * f.decode.memory_utilization)
    tight = replace(f, decode=replace(f.decode, hbm_bytes=tight_hbm))
    squeezed = sim.simulate(tight, w, arm="on", turns=turns)
    assert squeezed.reuse_share < roomy.reuse_share - 0.1
    assert squeezed.retained_gib_peak <= closed_form.kv_cache_gib(tight) * 1.001
    # the closed form now sees the room too: reuse falls to the share of retained KV that fits
    tight_closed = closed_form.evaluate(tight, w, turns=turns).retention
    assert tight_closed.fits < 0.6 and tight_closed.reuse_share < closed.retention.reuse_share - 0.1
    # a host tier as large as what retention needs gives the simulation its reuse back
    hosted = sim.simulate(replace(tight, host_kv_gib=closed.retention.retained_gib_per_decode), w, arm="on",
                          turns=turns)
    assert hosted.reuse_share > roomy.reuse_share - 0.05


def test_more_prefill_engines_cut_the_queue():
    w = Workload.from_dict(WORKLOAD | {"num_clients": 400, "think_time_s": 1})
    turns = sample(w, 2000, seed=2)
    one = sim.simulate(fleet(), w, arm="off", turns=turns)
    four = sim.simulate(fleet(prefill_nodes=4), w, arm="off", turns=turns)
    assert one.prefill_util > 0.8
    assert np.percentile(four.ttft_s, 90) < 0.5 * np.percentile(one.ttft_s, 90)


@pytest.mark.parametrize("clients", [256, 512])
def test_queueing_agrees_with_pollaczek_khinchine_at_moderate_load(clients):
    """Prefill at ~30% and ~57% utilization: the simulated FCFS queue and the closed form's M/G/1 wait
    give the same mean TTFT within 5% (and the same utilization)."""
    w = Workload.from_dict(WORKLOAD | {"num_clients": clients, "num_conversations": 20000})
    turns = sample(w, seed=1)
    f = fleet(decode_nodes=8)
    closed = closed_form.evaluate(f, w, turns=turns)
    result = sim.simulate(f, w, arm="off", turns=turns)
    assert closed.load_off.wait_s > 0.02  # the queue matters here
    assert result.prefill_util == pytest.approx(closed.load_off.prefill_util, rel=0.05)
    assert result.ttft_s.mean() == pytest.approx(closed.ttft("off").mean(), rel=0.05)
