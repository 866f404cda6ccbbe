"""Pure router logic: choice policy, pool health, auth, reuse decisions, expiry, EMF, tunable merges, config."""

from __future__ import annotations

import json

import pytest

from router import guard
from router.auth import ApiKeys, AuthError, parse_keys
from router.config import RouterConfig, build, load_file
from router.engines import Engine, EnginePool, join_host_port, parse_engine
from router.engines.discovery import engines_from_instances
from router.engines.policy import RoundRobin
from router.legs import push_decode_params, push_identity, reused_tokens
from router.reload import merge
from router.telemetry import PrefillRate, emf_record, prompt_bucket
from turnkv import params

T = params.defaults()


def pool(n=3, clock=lambda: 100.0):
    return EnginePool([f"http://10.0.0.{i}:8000" for i in range(n)], ["http://10.0.1.1:8000"], tunables=dict(T),
                      clock=clock)


def test_least_load_counts_requests_and_tokens_and_round_robins_ties():
    p = pool()
    a, b, c = p.prefill
    a.outstanding, b.outstanding_tokens = 1, 4096  # b: 2 requests' worth of tokens
    assert p.pick("prefill") is c
    c.outstanding = 1
    assert {p.pick("prefill").name for _ in range(4)} == {a.name, c.name}


def test_least_load_ties_turn_each_role_on_its_own():
    # Idle engines all tie. With one turn counter for both roles, 2 prefill + 2 decode engines sent every
    # prefill leg to the first prefill engine and every decode leg to the second decode engine.
    p = EnginePool(["http://p1:1", "http://p2:1"], ["http://d1:1", "http://d2:1"], tunables=dict(T),
                   clock=lambda: 0.0)
    legs = [(p.pick("prefill").name, p.pick("decode").name) for _ in range(4)]
    assert [pf for pf, _ in legs] == [p.prefill[0].name, p.prefill[1].name] * 2
    assert [d for _, d in legs] == [p.decode[0].name, p.decode[1].name] * 2


def test_round_robin_turns_each_role_on_its_own():
    p = EnginePool(["http://p:1"], ["http://d1:1", "http://d2:1"], tunables=dict(T), clock=lambda: 0.0,
                   policy=RoundRobin())
    picks = []
    for _ in range(4):  # a request picks prefill, then decode: the decode legs still alternate
        p.pick("prefill")
        picks.append(p.pick("decode", prefer=p.decode[0].name).name)
    assert picks == [p.decode[0].name, p.decode[1].name] * 2


def test_decode_affinity_unless_overloaded():
    p = EnginePool(["http://p:1"], ["http://d1:1", "http://d2:1"], tunables=dict(T), clock=lambda: 0.0)
    d1, d2 = p.decode
    d1.outstanding = 3
    assert p.pick("decode", prefer=d1.name) is d1  # 3 more than the best, slack 4
    d1.outstanding = 5
    assert p.pick("decode", prefer=d1.name) is d2
    assert p.pick("decode", prefer="gone") is d2


def test_exclusion_falls_back_to_tried_engines_and_none_healthy_raises():
    p = pool(2)
    a, b = p.prefill
    assert p.pick("prefill", exclude=[a]) is b
    b.healthy = False
    assert p.pick("prefill", exclude=[a]) is a
    a.healthy = False
    assert p.pick("prefill", exclude=[a]) is b  # panic mode: all ejected, try them anyway
    p.prefill = []
    with pytest.raises(Exception, match="no prefill engine known"):
        p.pick("prefill")


def test_ejection_and_gradual_return():
    now = [100.0]
    p = pool(2, clock=lambda: now[0])
    p.tunables.update(eject_failures=2, return_successes=2, slow_start=30)
    a, b = p.prefill
    assert not p.report_failure(a) and a.healthy
    assert p.report_failure(a) and not a.healthy
    assert not p.report_success(a)  # request successes do not bring an ejected engine back
    assert not p.report_success(a, probe=True) and not a.healthy
    assert p.report_success(a, probe=True) and a.healthy
    assert a.weight(now[0], 30) == pytest.approx(0.1)
    picks = [p.pick("prefill") for _ in range(20)]
    assert picks.count(b) == 20  # while ramping, a idle-but-returning engine loses to an idle full one
    now[0] += 15
    assert a.weight(now[0], 30) == pytest.approx(0.55)
    now[0] += 20
    assert a.weight(now[0], 30) == 1.0


def test_engine_urls_identity_and_ipv6():
    e = parse_engine("http://[fd00::5]:8000?engine_id=prefill-0&side_channel_port=5600", "prefill")
    assert e.url == "http://[fd00::5]:8000" and e.name == "prefill-0"
    assert e.push_identity.host == "fd00::5" and e.push_identity.port == 5600
    assert join_host_port("fd00::5", 8000) == "[fd00::5]:8000" and join_host_port("10.0.0.1", 1) == "10.0.0.1:1"
    assert parse_engine("http://h:1", "decode").push_identity is None
    with pytest.raises(ValueError, match="unknown attribute"):
        parse_engine("http://h:1?color=red", "decode")
    with pytest.raises(ValueError):
        Engine("h:1", "decode")
    p = EnginePool([e], ["http://[FD00::6]:8000"])
    assert {"fd00::5", "fd00::6"} <= p.known_hosts()


def test_cloud_map_instances():
    found = engines_from_instances([
        {"InstanceId": "i-1", "Attributes": {"AWS_INSTANCE_IPV4": "10.0.0.5", "AWS_INSTANCE_PORT": "8000",
                                             "role": "prefill", "engine_id": "p-1", "side_channel_host": "10.0.0.5",
                                             "side_channel_port": "5600", "tp_size": "8", "http_port": "8000"}},
        {"InstanceId": "i-2", "Attributes": {"AWS_INSTANCE_IPV4": "10.0.0.6", "role": "decode"}},  # no port
        {"InstanceId": "i-3", "Attributes": {"AWS_INSTANCE_IPV4": "10.0.0.7", "http_port": "8000", "role": "x"}},
    ])
    [p] = found["prefill"]
    assert p.url == "http://10.0.0.5:8000" and p.push_identity.tp_size == 8 and found["decode"] == []


def test_pool_replace_keeps_state():
    p = pool(2)
    a = p.prefill[0]
    a.outstanding, a.healthy = 3, False
    p.replace("prefill", [Engine(a.url, "prefill", engine_id="p-a"), Engine("http://10.9.0.1:1", "prefill")])
    assert p.prefill[0] is a and a.outstanding == 3 and not a.healthy and a.name == "p-a"
    assert len(p.prefill) == 2


def test_api_keys_formats_and_errors():
    keys = ApiKeys(parse_keys('{"keys": ["key-one-1234"], "initial": "key-zero-1234"}'))
    assert keys.tenant("Bearer key-one-1234").startswith("key-")
    assert keys.tenant("Bearer key-zero-1234") != keys.tenant("Bearer key-one-1234")
    named = ApiKeys(parse_keys("# tenants\nacme:acme-key-1\nglobex:globex-key-1\n"))
    assert named.tenant("bearer acme-key-1") == "acme"
    for header, message in ((None, "missing"), ("Basic x", "malformed"), ("Bearer nope-nope", "unknown")):
        with pytest.raises(AuthError, match=message):
            named.tenant(header)
    assert ApiKeys().tenant(None) == "" and ApiKeys().open
    with pytest.raises(ValueError, match="at least 8"):
        parse_keys('["short"]')


def _turn(messages):
    return guard.parse_turn("chat", {"model": "m", "messages": messages})


def test_reuse_outcome():
    first = [{"role": "user", "content": "hi"}]
    turn1 = _turn(first)
    history = turn1.extended_by({"role": "assistant", "content": "yo"})
    turn2 = _turn([*first, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}])
    good = {"remote_host": "10.0.1.1", "remote_port": 1, "remote_engine_id": "d", "remote_block_ids": [[1]],
            "remote_num_tokens": 9, "do_remote_decode": True}
    hosts = {"10.0.1.1"}
    assert guard.reuse_outcome(good, history, 200, turn2, 100, hosts) == "hit"
    assert guard.reuse_outcome(good, history, 99, turn2, 100, hosts) == "expired"
    assert guard.reuse_outcome(good, history, 200, turn1, 100, hosts) == "mismatch"
    assert guard.reuse_outcome({**good, "remote_host": "10.6.6.6"}, history, 200, turn2, 100, hosts) == "refused"
    assert guard.reuse_outcome({**good, "remote_block_ids": []}, history, 200, turn2, 100, hosts) == "refused"
    assert guard.reuse_outcome(None, None, 0, turn2, 100, hosts) == "miss"
    assert guard.normalize_host("[FD00::0:1]") == "fd00::1"


def test_content_keys_differ_by_tenant_and_secret():
    history = _turn([{"role": "user", "content": "hi"}]).extended_by({"role": "assistant", "content": "yo"})
    k = guard.content_key(b"s", "acme", history)
    assert k != guard.content_key(b"s", "globex", history)
    assert k != guard.content_key(b"t", "acme", history)
    assert k == guard.content_key(b"s", "acme", history)


def test_entry_expiry_never_outlives_the_engine():
    assert guard.entry_expiry(1000, 450, {}, 10) == 1450
    now = 1.8e9
    # decode's wall-clock expiry (turnkv's connector) is the authority: a late store cannot outlive it
    assert guard.entry_expiry(now, 450, {"turnkv_expires_at": now + 100}, 10) == now + 90
    assert guard.entry_expiry(now, 450, {"turnkv_expires_at": now - 30}, 10) == now - 40
    assert guard.entry_expiry(now, 450, {"turnkv_expires_at": None}, 10) == now + 450
    # vLLM exports decode's perf_counter (seconds since boot): not comparable, ignored
    assert guard.entry_expiry(now, 450, {"remote_blocks_expiry_time": 12345.6}, 10) == now + 450
    assert guard.entry_expiry(now, 450, {"remote_blocks_expiry_time": now + 100}, 10) == now + 450


def test_push_helpers():
    ident = push_identity({"transfer_mode": "push", "remote_engine_id": "p", "remote_host": "h", "remote_port": 5,
                           "tp_size": 2})
    assert ident is not None and ident.tp_size == 2
    assert push_identity({"transfer_mode": "pull", "remote_engine_id": "p", "remote_host": "h"}) is None
    sent = push_decode_params(ident, "rid", "tid")
    assert sent["remote_request_id"] == "rid" and sent["transfer_id"] == "tid" and "remote_block_ids" not in sent
    assert reused_tokens({"remote_prefill_cached_tokens": 7}) == 7 and reused_tokens({}) == 0


def test_emf_record_matches_the_dashboard_names():
    rec = emf_record(namespace="turnkv/Router", deployment="prod", outcome="hit", prompt_tokens=1500, ttft_ms=12.5,
                     error=False, reused_tokens=900, prefill_ms=8.0, saved_ms=40.0, fields={"request_id": "r"},
                     timestamp_ms=1)
    directives = rec["_aws"]["CloudWatchMetrics"]
    assert directives[0]["Dimensions"] == [["Deployment"], ["Deployment", "ReuseOutcome"],
                                           ["Deployment", "ReuseOutcome", "PromptBucket"]]
    names = {m["Name"] for d in directives for m in d["Metrics"]}
    assert {"TTFT", "Requests", "Errors", "ReuseHit", "ReusedTokens", "PrefillTimeSaved"} <= names
    assert all(n in rec for n in names)
    assert rec["PromptBucket"] == "1k-8k" and rec["ReuseHit"] == 1 and rec["request_id"] == "r"
    assert [prompt_bucket(n) for n in (10, 1000, 8000, 40000)] == ["lt1k", "1k-8k", "8k-32k", "ge32k"]
    r = PrefillRate(alpha=0.5)
    r.observe(100, 100)
    r.observe(300, 100)
    assert r.ms_per_token == 2.0


def test_merge_keeps_last_good_values():
    current = params.defaults()
    new, errors = merge(current, {"prefill_retries": "4", "sse_keepalive": "0"})
    assert new["prefill_retries"] == 4 and new["sse_keepalive"] == 15 and len(errors) == 1
    new, errors = merge(current, {"conversation_ttl": "475"})
    assert new == current and "must stay below" in errors[0]
    assert merge(current, {}) == (current, [])


def test_config_file_and_flags(tmp_path, monkeypatch):
    f = tmp_path / "router.json"
    f.write_text(json.dumps({"decode": ["http://d:1"], "prefill": ["http://p:1"], "store": "redis://v:6379",
                             "set": {"prefill_retries": 3}, "port": 9000}))
    config = build(load_file(f), {"port": 9100, "prefill": None}, {"sse_keepalive": "5"})
    assert config.port == 9100 and config.store == "redis://v:6379" and config.prefill_retries == 3
    assert config.sse_keepalive == 5
    toml = tmp_path / "router.toml"
    toml.write_text('discovery = "cloudmap"\nnamespace = "turnkv-prod"\n[set]\ndecoder_kv_blocks_ttl = 120\n')
    c2 = build(load_file(toml), {}, {})
    assert c2.discovery == "cloudmap" and c2.tunables["conversation_ttl"] == 110
    with pytest.raises(ValueError, match="unknown setting"):
        load_file(tmp_path / "x.json") if (tmp_path / "x.json").write_text('{"colour": 1}') else None
    for bad, message in (({"mode": "sideways"}, "mode"), ({"store": "mysql://x"}, "store"),
                         ({"discovery": "cloudmap"}, "namespace"), ({"prefill": []}, "at least one")):
        with pytest.raises(ValueError, match=message):
            RouterConfig(**{"prefill": ["http://p:1"], "decode": ["http://d:1"], **bad})
    monkeypatch.setenv("TURNKV_KEY_SECRET", "shared")
    assert RouterConfig(prefill=["http://p:1"], decode=["http://d:1"]).key_secret == b"shared"


def test_an_engine_lease_counts_in_once_and_out_once():
    e = Engine("http://10.0.0.1:8000", "decode")
    lease = EnginePool.lease(e, 300)
    assert (e.outstanding, e.outstanding_tokens) == (1, 300)
    lease.release()
    lease.release()  # idempotent: a leg that ends on two paths gives its load back once
    assert (e.outstanding, e.outstanding_tokens) == (0, 0)
    try:
        with EnginePool.lease(e, 10):
            assert e.outstanding == 1
            raise ConnectionError("leg failed")
    except ConnectionError:
        pass
    assert (e.outstanding, e.outstanding_tokens) == (0, 0)


def test_the_router_freezes_what_it_loaded_and_waits_longer_between_young_gc_passes():
    """Cyclic GC took 4% of the router's CPU at CPython's defaults (py-spy --native, 16 reply tokens): what the
    imports left is frozen out of it and young passes wait for GC_YOUNG_THRESHOLD allocations."""
    import gc

    from router import app

    before = gc.get_threshold()
    try:
        app.tune_gc()
        assert gc.get_threshold() == (app.GC_YOUNG_THRESHOLD, before[1], before[2])
        assert before[0] < app.GC_YOUNG_THRESHOLD
        assert gc.get_freeze_count() > 10_000  # aiohttp, prometheus_client, the catalog, ... no longer walked
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
