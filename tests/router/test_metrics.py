"""The router's /metrics as Prometheus scrapes it: request duration and inter-token latency histograms, build info,
and no ``*_created`` series."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.router.conftest import engines, router_over
from turnkv import versions

MSGS = [{"role": "user", "content": "hello there, how are you"}]


def _samples(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


async def test_metrics_have_duration_itl_and_build_info_and_no_created_series():
    # one SSE event per write: the router relays several chunks, so inter-token gaps exist
    async with router_over(engines(1, "prefill"), engines(1, "decode", event_writes=True)) as (s, _):
        async with s.post("/v1/chat/completions", json={"model": "tiny", "messages": MSGS, "max_tokens": 8,
                                                       "stream": True}) as r:
            assert r.status == 200
            await r.read()
        async with s.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3}) as r:
            assert r.status == 200
        async with s.post("/v1/completions", json={"model": "tiny", "prompt": 5}) as r:
            assert r.status == 400
        async with s.get("/metrics") as r:
            text = await r.text()
    samples = _samples(text)
    assert not [name for name in samples if name.endswith("_created")], "no *_created series"

    def count(name: str, **labels: str) -> float:
        return sum(x.value for x in samples.get(name, ()) if all(x.labels.get(k) == v for k, v in labels.items()))

    duration = "turnkv_router_request_duration_seconds_count"
    assert count(duration, route="/v1/chat/completions", outcome="ok") == 1
    assert count(duration, route="/v1/completions", outcome="ok") == 1
    assert count(duration, route="/v1/completions", outcome="client_error") == 1
    assert count("turnkv_router_inter_token_latency_seconds_count") >= 2  # several chunks after the first token
    assert count("turnkv_router_inter_token_latency_seconds_bucket", le="+Inf") \
        == count("turnkv_router_inter_token_latency_seconds_count")
    [info] = samples["turnkv_router_build_info"]
    assert info.value == 1
    assert info.labels == {"version": versions.TURNKV, "vllm": versions.VLLM_GPU, "nixl": versions.NIXL}
    # counters keep their _total (Prometheus' convention; what docs/router.md lists)
    assert count("turnkv_router_requests_total", route="/v1/completions", status="200") == 1


async def test_a_client_that_leaves_mid_stream_is_timed_as_disconnected():
    import asyncio

    decode = engines(1, "decode")
    async with router_over(engines(1, "prefill"), decode) as (s, _):
        decode[0].fault = {"token_delay": 0.2}
        body = {"model": "tiny", "messages": MSGS, "max_tokens": 50, "stream": True}
        async with s.post("/v1/chat/completions", json=body) as r:
            await r.content.readline()
        await asyncio.sleep(0.5)
        async with s.get("/metrics") as r:
            samples = _samples(await r.text())
    counts = {x.labels["outcome"]: x.value for x in samples["turnkv_router_request_duration_seconds_count"]}
    assert counts == {"disconnected": 1}


def test_duration_outcome_reads_the_status():
    from router.telemetry import duration_outcome

    assert [duration_outcome(s) for s in (200, 400, 429, 499, 500, 503, 0)] == [
        "ok", "client_error", "client_error", "disconnected", "server_error", "server_error", "server_error"]


def test_docs_name_every_router_metric_as_exported():
    """docs/router.md lists each family as /metrics exports it, and no doc names a counter without ``_total``."""
    from pathlib import Path

    from router.telemetry import Metrics

    root = Path(__file__).resolve().parents[2]
    router_doc = (root / "docs" / "router.md").read_text()
    docs = {p.name: p.read_text() for p in [*(root / "docs").glob("*.md"), root / "README.md"]}
    for family in Metrics().registry.collect():
        exported = family.name + ("_total" if family.type == "counter" else "")
        spellings = (exported, "..." + exported.removeprefix("turnkv_router"))
        assert any(f"`{n}{end}" in router_doc for n in spellings for end in ("`", "{")), exported
        if family.type == "counter":
            for name, text in docs.items():
                bare = (family.name, "..." + family.name.removeprefix("turnkv_router"))
                assert not any(f"`{n}{end}" in text for n in bare for end in ("`", "{")), \
                    f"{name} names {family.name} without _total"
