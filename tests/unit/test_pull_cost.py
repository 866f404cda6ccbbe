"""bench.pull_cost's pure parts: the metrics reader, one request's breakdown, the summary."""

from __future__ import annotations

import math

from bench import pull_cost as pc

ROUTER = """# HELP turnkv_router_leg_seconds Latency
# TYPE turnkv_router_leg_seconds histogram
turnkv_router_leg_seconds_bucket{le="0.1",leg="prefill"} 1.0
turnkv_router_leg_seconds_sum{leg="prefill"} %s
turnkv_router_leg_seconds_sum{leg="decode"} %s
turnkv_router_store_seconds_sum{op="take"} %s
turnkv_router_store_seconds_sum{op="put"} 9.0
"""

PREFILL = """vllm:e2e_request_latency_seconds_sum{engine="0",model_name="m"} %s
vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} %s
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} %s
vllm:turnkv_read_seconds_total{engine="0",model_name="m"} %s
vllm:turnkv_read_bytes_total{engine="0",model_name="m"} %s
vllm:turnkv_handshake_seconds{engine="0",model_name="m"} %s
"""


def test_parse_metrics_sums_label_sets_and_keeps_the_split_labels() -> None:
    m = pc.parse_metrics(ROUTER % (1.0, 2.0, 0.5))
    assert m["turnkv_router_leg_seconds_sum"] == 3.0
    assert m["turnkv_router_leg_seconds_sum{leg=prefill}"] == 1.0
    assert m["turnkv_router_store_seconds_sum{op=take}"] == 0.5
    assert "turnkv_router_leg_seconds_bucket{le=0.1}" not in m  # only leg/op/decision are split out


def _snap(leg_p: float, leg_d: float, take: float, e2e: float, queue: float, prefill: float, read_s: float,
          read_b: float, hs: float) -> dict[str, dict[str, float]]:
    return {"router": pc.parse_metrics(ROUTER % (leg_p, leg_d, take)),
            "prefill": pc.parse_metrics(PREFILL % (e2e, queue, prefill, read_s, read_b, hs)), "decode": {}}


def test_breakdown_of_a_pull_splits_the_wait_into_handshake_read_and_admission() -> None:
    before = _snap(1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1000, 0.2)
    after = _snap(1.100, 1.030, 0.001, 1.090, 1.060, 1.020, 1.010, 5096, 0.04)
    t = pc.breakdown(pc.Turn("pull", 0, 1, prompt_tokens=900, pulled_tokens=150, cached_tokens=700), 140.0,
                     before, after, handshake_changed=True)
    assert math.isclose(t.prefill_leg_ms, 100.0, abs_tol=1e-6)
    assert math.isclose(t.decode_leg_ms, 30.0, abs_tol=1e-6)
    assert math.isclose(t.router_ms, 10.0, abs_tol=1e-6)  # TTFT less both legs
    assert math.isclose(t.p_http_ms, 10.0, abs_tol=1e-6)  # the leg less prefill's own e2e
    assert math.isclose(t.read_ms, 10.0, abs_tol=1e-6)
    assert t.read_bytes == 4096
    assert math.isclose(t.handshake_ms, 40.0, abs_tol=1e-6)  # the gauge's new value
    assert math.isclose(t.admit_poll_ms, 60.0 - 10.0 - 40.0, abs_tol=1e-6)
    assert t.computed_tokens == 50


def test_breakdown_of_a_recompute_has_no_read_and_no_admission_share() -> None:
    snap = _snap(1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1000, 0.2)
    after = _snap(1.05, 1.03, 0.0, 1.04, 1.001, 1.035, 1.0, 1000, 0.2)
    t = pc.breakdown(pc.Turn("recompute", 0, 1), 90.0, snap, after, handshake_changed=False)
    assert t.read_ms == 0.0 and t.read_bytes == 0 and t.admit_poll_ms == 0.0 and t.handshake_ms == 0.0
    assert math.isclose(t.p_compute_ms, 35.0, abs_tol=1e-6)


def test_summary_keeps_the_first_pull_apart_and_compares_the_same_turns() -> None:
    turns = [pc.Turn("pull", 0, 1, pulled_tokens=150, ttft_ms=300, first_pull=True),
             pc.Turn("recompute", 0, 1, ttft_ms=100),
             pc.Turn("pull", 0, 2, pulled_tokens=150, ttft_ms=90),
             pc.Turn("recompute", 0, 2, ttft_ms=100),
             pc.Turn("pull", 0, 3, ttft_ms=95),  # recomputed by the cost model
             pc.Turn("recompute", 0, 3, ttft_ms=110),
             pc.Turn("pull", 0, 0, ttft_ms=500), pc.Turn("recompute", 0, 0, ttft_ms=500),  # first turns: no pull
             pc.Turn("pull", 0, 4, pulled_tokens=150, ttft_ms=1, error="HTTP 500")]
    rows = {r["group"]: r for r in pc.summary_rows(turns)}
    assert rows["pull, first (handshake)"]["ttft_ms"] == 300
    assert rows["pull, later"]["n"] == 1 and rows["pull, later"]["ttft_ms"] == 90
    assert rows["recompute, same turns"]["n"] == 1 and rows["recompute, same turns"]["ttft_ms"] == 100
    assert rows["pull arm, recomputed by the cost model"]["ttft_ms"] == 95
    assert math.isclose(pc.ratio(pc.summary_rows(turns)) or 0, 0.9)
    # as deployed: the pull arm's later turns, pulled or not (300, 90, 95) over the recompute arm's (100, 100, 110)
    assert rows["pull arm, all later turns"]["n"] == 3
    assert math.isclose(pc.ratio(pc.summary_rows(turns), over_all=True) or 0, 95 / 100)
    table = pc.markdown(pc.summary_rows(turns))
    assert table.splitlines()[0].startswith("| group | n |") and "| pull, later | 1 |" in table


def test_a_batch_breakdown_is_the_mean_per_request() -> None:
    before = _snap(1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1000, 0.2)
    after = _snap(1.4, 1.2, 0.004, 1.36, 1.08, 1.2, 1.04, 1000 + 4 * 2048, 0.2)  # four requests at once
    t = pc.breakdown(pc.Turn("pull", -1, 1, pulled_tokens=200), 200.0, before, after, handshake_changed=False,
                     requests=4)
    assert math.isclose(t.prefill_leg_ms, 100.0, abs_tol=1e-6) and math.isclose(t.decode_leg_ms, 50.0, abs_tol=1e-6)
    assert math.isclose(t.router_ms, 50.0, abs_tol=1e-6) and t.read_bytes == 2048
    assert math.isclose(t.read_ms, 10.0, abs_tol=1e-6) and math.isclose(t.admit_poll_ms, 10.0, abs_tol=1e-6)
