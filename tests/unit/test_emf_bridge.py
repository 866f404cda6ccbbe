"""The engine metrics bridge: Prometheus text -> per-interval EMF values, sent to a TCP listener."""

from __future__ import annotations

import json
import math
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from turnkv import emf_bridge as bridge
from turnkv import metric_names as mn


def exposition(ttft_buckets: dict[str, float], ttft_sum: float, kv: float, expired: float,
               nixl_bytes: float = 0.0) -> str:
    count = ttft_buckets["+Inf"]
    lines = ["# HELP vllm:time_to_first_token_seconds TTFT", "# TYPE vllm:time_to_first_token_seconds histogram"]
    # two label sets (e.g. two API servers): the bridge adds them up
    for server in ("0", "1"):
        for le, c in ttft_buckets.items():
            lines.append(f'vllm:time_to_first_token_seconds_bucket{{le="{le}",server="{server}"}} {c / 2}')
        lines.append(f'vllm:time_to_first_token_seconds_sum{{server="{server}"}} {ttft_sum / 2}')
        lines.append(f'vllm:time_to_first_token_seconds_count{{server="{server}"}} {count / 2}')
    lines += ["# TYPE vllm:kv_cache_usage_perc gauge", f'vllm:kv_cache_usage_perc{{engine="0"}} {kv}',
              f'vllm:kv_cache_usage_perc{{engine="1"}} {kv / 2}',
              "# TYPE vllm:nixl_num_kv_expired_reqs_total counter", f"vllm:nixl_num_kv_expired_reqs_total {expired}",
              "# TYPE vllm:nixl_bytes_transferred histogram",
              'vllm:nixl_bytes_transferred_bucket{le="+Inf"} 1', f"vllm:nixl_bytes_transferred_sum {nixl_bytes}",
              "vllm:nixl_bytes_transferred_count 1",
              "# TYPE unrelated_metric gauge", "unrelated_metric 7"]
    return "\n".join(lines) + "\n"


FIRST = exposition({"0.1": 10, "0.5": 20, "1.0": 20, "+Inf": 20}, ttft_sum=3.0, kv=0.4, expired=1, nixl_bytes=100)
SECOND = exposition({"0.1": 10, "0.5": 20, "1.0": 110, "+Inf": 120}, ttft_sum=3.0 + 80.0, kv=0.8, expired=4,
                    nixl_bytes=1100)


def test_parse_combines_label_sets_and_ignores_other_families():
    snap = bridge.parse(FIRST)
    h = snap[mn.VLLM_TTFT]
    assert (h.count, h.sum, h.buckets[0.1], h.buckets[math.inf]) == (20, 3.0, 10, 20)
    assert snap[mn.VLLM_KV_USAGE] == 0.4  # max over engines
    assert snap[mn.VLLM_NIXL_EXPIRED] == 1
    assert "unrelated_metric" not in snap


def test_quantile_interpolates_like_prometheus():
    assert bridge.quantile(0.5, {1.0: 50, 2.0: 100, math.inf: 100}) == pytest.approx(1.0)
    assert bridge.quantile(0.75, {1.0: 50, 2.0: 100, math.inf: 100}) == pytest.approx(1.5)
    assert bridge.quantile(0.99, {1.0: 50, math.inf: 100}) == 1.0  # beyond the last finite bound
    assert bridge.quantile(0.5, {math.inf: 0}) is None


def test_interval_values_are_deltas_means_and_percentiles():
    values = bridge.interval_values(bridge.parse(FIRST), bridge.parse(SECOND))
    # 100 new requests, 80 s more: mean 800 ms; 90 of them in (0.5, 1.0], 10 in (1.0, +Inf)
    assert values[mn.ENGINE_TTFT] == (pytest.approx(800.0), "Milliseconds")
    assert values[mn.ENGINE_TTFT_P99][0] == pytest.approx(1000.0)
    assert values[mn.KV_CACHE_USAGE] == (pytest.approx(80.0), "Percent")
    assert values[mn.NIXL_EXPIRED] == (3, "Count")
    assert values[mn.NIXL_BYTES] == (1000, "Bytes")
    # first scrape: only gauges (no interval yet)
    first = bridge.interval_values({}, bridge.parse(FIRST))
    assert set(first) == {mn.KV_CACHE_USAGE}


def test_engine_restart_resets_counters_without_negative_values():
    restarted = exposition({"0.1": 2, "0.5": 2, "1.0": 2, "+Inf": 2}, ttft_sum=0.1, kv=0.1, expired=0)
    values = bridge.interval_values(bridge.parse(SECOND), bridge.parse(restarted))
    assert values[mn.ENGINE_TTFT][0] == pytest.approx(50.0)
    assert values[mn.NIXL_EXPIRED] == (0, "Count")


def test_emf_document_shape():
    doc = bridge.emf_document({mn.ENGINE_TTFT: (800.0, "Milliseconds")}, {"Deployment": "d", "Role": "decode",
                                                                          "Pool": "p"},
                              log_group="/turnkv/d/engines", timestamp_ms=1)
    assert doc["_aws"]["CloudWatchMetrics"][0] == {"Namespace": "turnkv/Engine", "Dimensions": [["Deployment", "Role"]],
                                                   "Metrics": [{"Name": "EngineTTFT", "Unit": "Milliseconds"}]}
    assert doc["EngineTTFT"] == 800.0 and doc["Role"] == "decode" and doc["_aws"]["LogGroupName"] == "/turnkv/d/engines"


def test_each_engine_of_a_node_is_its_own_metric_and_the_dashboards_sets_stay():
    """A node of two engines: each bridge's records carry its engine id as a dimension of their own set, and both
    still publish under {Deployment, Role}, which the dashboards and alarms read."""
    values = {mn.ENGINE_TTFT: (800.0, "Milliseconds"), mn.KV_CACHE_USAGE: (30.0, "Percent")}
    docs = [bridge.emf_document(values, {mn.DEPLOYMENT: "d", mn.ROLE: "decode", mn.POOL: "p",
                                         mn.ENGINE_ID: engine_id}, log_group="/turnkv/d/engines", timestamp_ms=1)
            for engine_id in ("i-0abc", "i-0abc-1")]
    for doc in docs:
        (directive,) = doc["_aws"]["CloudWatchMetrics"]
        assert directive["Dimensions"] == [[mn.DEPLOYMENT, mn.ROLE], [mn.DEPLOYMENT, mn.ROLE, mn.ENGINE_ID]]
        assert all(name in doc for dims in directive["Dimensions"] for name in dims)
    assert [d[mn.ENGINE_ID] for d in docs] == ["i-0abc", "i-0abc-1"]
    strip = [{k: v for k, v in d.items() if k != mn.ENGINE_ID} for d in docs]
    assert strip[0] == strip[1]  # the engine id is the only difference


def test_the_command_line_adds_the_engine_id_only_when_given(monkeypatch):
    seen = []
    monkeypatch.setattr(bridge, "run", lambda url, dims, *args: seen.append(dims))
    common = ["--deployment", "d", "--role", "decode", "--pool", "p", "--log-group", "/g"]
    assert bridge.main(common) == 0 and bridge.main([*common, "--engine-id", "i-0abc-1"]) == 0
    assert seen == [{"Deployment": "d", "Role": "decode", "Pool": "p"},
                    {"Deployment": "d", "Role": "decode", "Pool": "p", "EngineId": "i-0abc-1"}]


def test_run_scrapes_and_sends_emf_lines_over_tcp():
    pages = [FIRST, SECOND]

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self):
            body = pages.pop(0).encode() if len(pages) > 1 else pages[0].encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    received: list[bytes] = []

    def accept():
        listener.settimeout(10)
        while len(received) < 2:
            conn, _ = listener.accept()
            with conn:
                data = b""
                while not data.endswith(b"\n"):
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                received.append(data)

    threading.Thread(target=http.serve_forever, daemon=True).start()
    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        bridge.run(f"http://127.0.0.1:{http.server_address[1]}/metrics", {"Deployment": "d", "Role": "prefill"},
                   "/turnkv/d/engines", interval=0.05, address=listener.getsockname(), iterations=2)
        acceptor.join(5)
    finally:
        http.shutdown()
        listener.close()
    docs = [json.loads(line) for line in received]
    assert [sorted(k for k in d if not k.startswith("_") and k not in ("Deployment", "Role")) for d in docs] == [
        [mn.KV_CACHE_USAGE],
        sorted([mn.ENGINE_TTFT, mn.ENGINE_TTFT_P99, mn.KV_CACHE_USAGE, mn.NIXL_BYTES, mn.NIXL_EXPIRED])]
    assert docs[1][mn.ENGINE_TTFT] == pytest.approx(800.0)


def test_unreachable_engine_is_logged_not_fatal(capsys):
    bridge.run("http://127.0.0.1:9/metrics", {}, "g", interval=0, iterations=1)
    assert "turnkv emf bridge" in capsys.readouterr().err


def test_retention_tiers_are_published_one_series_per_label_value():
    def text(host_pulls: float, device_pulls: float, full: float, held: float) -> str:
        return "\n".join([
            "# TYPE vllm:turnkv_pulls_total counter",
            f'vllm:turnkv_pulls_total{{engine="0",tier="device"}} {device_pulls}',
            f'vllm:turnkv_pulls_total{{engine="0",tier="host"}} {host_pulls}',
            "# TYPE vllm:turnkv_retention_refusals_total counter",
            f'vllm:turnkv_retention_refusals_total{{engine="0",reason="full"}} {full}',
            'vllm:turnkv_retention_refusals_total{engine="0",reason="too_large"} 0',
            "# TYPE vllm:turnkv_host_retained_bytes gauge", f'vllm:turnkv_host_retained_bytes{{engine="0"}} {held}',
        ]) + "\n"

    values = bridge.interval_values(bridge.parse(text(1, 5, 0, 10)), bridge.parse(text(4, 6, 2, 30)))
    assert values[mn.pulls("host")] == (3, "Count") and values[mn.pulls("device")] == (1, "Count")
    assert values[mn.refused("full")] == (2, "Count") and values[mn.refused("too_large")] == (0, "Count")
    assert values[mn.HOST_RETAINED_BYTES] == (30, "Bytes") and mn.refused("too_large") == "RetentionRefusedTooLarge"
