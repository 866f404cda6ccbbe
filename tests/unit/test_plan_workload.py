"""turnkv.plan.workload: vLLM's multi-turn generator format, sampled as vLLM samples it."""

import itertools
import json

import numpy as np
import pytest

from turnkv.plan.workload import Distribution, Workload, WorkloadError, load, sample

#: vLLM benchmarks/multi_turn/generate_multi_turn.json, as published.
VLLM_EXAMPLE = {
    "filetype": "generate_conversations", "num_conversations": 24, "text_files": ["pg1184.txt"], "print_stats": False,
    "prompt_input": {
        "num_turns": {"distribution": "uniform", "min": 12, "max": 18},
        "common_prefix_num_tokens": {"distribution": "constant", "value": 500},
        "prefix_num_tokens": {"distribution": "lognormal", "average": 1000, "max": 5000},
        "num_tokens": {"distribution": "uniform", "min": 120, "max": 160},
    },
    "prompt_output": {"num_tokens": {"distribution": "uniform", "min": 80, "max": 120}},
}


def test_vllm_example_reads_and_counts_messages_not_turns():
    w = Workload.from_dict(VLLM_EXAMPLE)
    turns = w.user_turns(np.random.default_rng(0), 10_000)
    # 12..18 messages, rounded up to even, user + assistant: 6..9 user turns
    assert set(turns.tolist()) == {6, 7, 8, 9}
    assert w.num_clients == 1 and w.think_time_s.mean() == 0


def test_prompts_grow_by_each_reply_and_user_message():
    w = Workload.from_dict(VLLM_EXAMPLE | {"num_conversations": 50})
    t = sample(w, seed=3)
    for c in range(5):
        sel = np.nonzero(t.conv == c)[0]
        first = sel[0]
        assert t.history_tokens[first] == 0 and t.prompt_tokens[first] == t.new_tokens[first]
        assert t.new_tokens[first] >= 500 + 120  # common prefix + prefix + first message
        for a, b in itertools.pairwise(sel):
            assert t.prompt_tokens[b] == t.prompt_tokens[a] + t.output_tokens[a] + t.new_tokens[b]
            assert t.history_tokens[b] == t.prompt_tokens[a] + t.output_tokens[a] - 1  # last token: no KV


def test_lognormal_average_is_kept_and_capped():
    d = Distribution.parse({"distribution": "lognormal", "average": 1000, "median_ratio": 0.5}, "x")
    vals = d.sample(np.random.default_rng(1), 100_000)
    assert abs(vals.mean() - 1000) < 2  # vLLM rescales each batch to the exact average
    capped = Distribution.parse({"distribution": "lognormal", "mean": 6.0, "sigma": 1.0, "max": 800}, "x")
    assert capped.sample(np.random.default_rng(1), 10_000).max() == 800


@pytest.mark.parametrize("conf,needle", [
    ({"distribution": "gamma", "alpha": 1}, "unknown distribution 'gamma'"),
    ({"distribution": "uniform", "min": 5}, "uniform needs max"),
    ({"distribution": "zipf"}, "zipf needs alpha"),
    ({"distribution": "uniform", "min": 9, "max": 2}, "min 9.0 > max 2.0"),
])
def test_bad_distributions_name_the_fix(conf, needle):
    with pytest.raises(WorkloadError, match=needle):
        Distribution.parse(conf, "prompt_input.num_tokens")


def test_missing_fields_and_files(tmp_path):
    with pytest.raises(WorkloadError, match="prompt_output"):
        Workload.from_dict({"num_conversations": 1, "prompt_input": VLLM_EXAMPLE["prompt_input"]})
    with pytest.raises(WorkloadError, match="no such workload file"):
        load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(WorkloadError, match="not JSON"):
        load(bad)


def test_turnkv_extensions_clients_and_think_time(tmp_path):
    path = tmp_path / "w.json"
    path.write_text(json.dumps(VLLM_EXAMPLE | {"num_clients": 8,
                                               "think_time_s": {"distribution": "uniform", "min": 10, "max": 30}}))
    w = load(path)
    t = sample(w, seed=0)
    assert w.num_clients == 8
    assert (t.think_s[t.turn == 0] == 0).all()
    later = t.think_s[t.turn > 0]
    assert later.min() >= 10 and later.max() <= 30 and abs(later.mean() - 20) < 1.5
