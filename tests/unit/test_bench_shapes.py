"""bench.shapes' pure parts: the n-gram shape's decode flags and the report line that shows decode drafted."""

import json

from bench import engine_metrics, shapes

TURNS = [{"turn": 1, "ttft_off_ms": 9.0, "ttft_on_ms": 9.0, "outcome": "none", "reused_tokens": 0, "same_answer": True},
         {"turn": 2, "ttft_off_ms": 9.0, "ttft_on_ms": 5.0, "outcome": "hit", "reused_tokens": 253,
          "same_answer": True}]


def test_the_ngram_shape_runs_vllms_prompt_lookup_drafter_on_decode_only():
    ngram = next(s for s in shapes.SHAPES if s.key == "ngram")
    flag, value = ngram.decode_args
    assert flag == "--speculative-config" and json.loads(value)["method"] == "ngram"
    assert (ngram.prefill_tp, ngram.decode_tp, ngram.prefill_block_size) == (1, 1, None)


def test_the_report_says_how_many_tokens_decode_drafted_and_accepted():
    row = shapes.ShapeRun("ngram", "D with n-gram", "pull", started=True, turns=TURNS, pulled_tokens=253,
                          drafted_tokens=96, accepted_tokens=12, passed=True)
    line = shapes.markdown([row]).splitlines()[-1]
    assert line == ("| D with n-gram | pull | yes | 1/1 | 253 | 2/2 | 253 | passed (decode drafted 96 tokens, "
                    "accepted 12) |")
    plain = shapes.ShapeRun("equal", "P TP1 / D TP1", "pull", started=True, turns=TURNS, passed=True)
    assert shapes.markdown([plain]).splitlines()[-1].endswith("| passed |")


def test_a_decode_that_did_not_answer_its_metrics_adds_no_drafter_figures():
    row = shapes.ShapeRun("p2d1", "P TP2 / D TP1", "push", started=True, failure="turn 1: no complete answer",
                          drafted_tokens=float("nan"), accepted_tokens=float("nan"))
    assert shapes.markdown([row]).splitlines()[-1].endswith("| turn 1: no complete answer |")


def test_counters_are_summed_over_matching_series_and_nan_without_a_page():
    page = ('# TYPE vllm:prompt_tokens_by_source counter\n'
            'vllm:prompt_tokens_by_source_total{source="external_kv_transfer",engine="0"} 900.0\n'
            'vllm:prompt_tokens_by_source_total{source="external_kv_transfer",engine="1"} 16.0\n'
            'vllm:prompt_tokens_by_source_total{source="local_compute",engine="0"} 40.0\n')
    assert engine_metrics.total(page, shapes.PULLED, source="external_kv_transfer") == 916.0
    assert engine_metrics.total(page, shapes.PULLED) == 956.0
    assert engine_metrics.total(None, shapes.PULLED) != engine_metrics.total(None, shapes.PULLED)  # NaN
