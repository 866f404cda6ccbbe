"""The production router on real vLLM CPU engines: 2 prefill + 2 decode, Valkey (redis-server) store,
API keys. Reuse, tenant isolation, forged params, store outage, expiry, client disconnect, and killed
engines (last, they change the stack). Ports 28000+ (router), 28100+/28200+ (engines), 25600+ (NIXL)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import requests

from router.state import Entry
from tests.e2e.client import metric, words
from turnkv import smoke
from turnkv.local.stack import StackConfig, Supervisor

pytestmark = pytest.mark.engines

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STATE = os.path.join(ROOT, ".turnkv", "e2e-router")
ACME, GLOBEX = "acme-key-0123456789", "globex-key-0123456789"
REDIS_PORT = 28379
PULLED = "vllm:prompt_tokens_by_source_total"


def redis_start() -> subprocess.Popen:
    proc = subprocess.Popen(["redis-server", "--port", str(REDIS_PORT), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", STATE], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    for _ in range(100):
        if subprocess.run(["redis-cli", "-p", str(REDIS_PORT), "ping"], capture_output=True,
                          text=True).stdout.strip() == "PONG":
            return proc
        time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


@pytest.fixture(scope="module")
def prod():
    if os.environ.get("TURNKV_SKIP_ENGINES"):
        pytest.skip("TURNKV_SKIP_ENGINES is set")
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed (make tools)")
    os.makedirs(STATE, exist_ok=True)
    keys = os.path.join(STATE, "api-keys")
    with open(keys, "w") as f:
        f.write(f"acme:{ACME}\nglobex:{GLOBEX}\n")
    supervisor = Supervisor(Path(STATE))
    supervisor.down()
    redis = {"proc": redis_start()}
    config = StackConfig(
        state_dir=Path(STATE), router_port=28000, prefill_port=28100, decode_port=28200,
        side_channel_base=25600, prefill_engines=2, decode_engines=2, kv_cache_gib=1,
        tunables={"decoder_kv_blocks_ttl": 60, "conversation_ttl": 45},
        router_args=("--store", f"redis://127.0.0.1:{REDIS_PORT}/0", "--api-keys-file", keys,
                     "--set", "health_interval=1", "--set", "prefill_timeout=30", "--set", "first_token_timeout=30",
                     "--set", "store_timeout_ms=200"))
    try:
        state = supervisor.up(config)
        comps = state["components"]
        yield {"router": comps["router"]["url"], "comps": comps, "model_dir": config.model_dir, "redis": redis,
               "supervisor": supervisor}
    finally:
        supervisor.down()
        if redis["proc"].poll() is None:
            redis["proc"].kill()
            redis["proc"].wait(5)


def auth(key=ACME) -> dict:
    return {"Authorization": f"Bearer {key}"}


def post(router, messages, key=ACME, conversation=None, stream=False, reuse=True, max_tokens=16, **extra):
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "return_token_ids": True, **extra}
    if conversation:
        body["conversation_id"] = conversation
    headers = auth(key) if key else {}
    if not reuse:
        headers["X-TurnKV-Reuse"] = "off"
    return requests.post(f"{router}/v1/chat/completions", json=body, headers=headers, timeout=120, stream=stream)


def text_of(resp) -> str:
    return resp.json()["choices"][0]["message"]["content"]


def pulled(prod) -> float:
    return sum(metric(prod["comps"][f"prefill-{i}"]["url"], PULLED, source="external_kv_transfer")
               for i in range(2) if prod["comps"].get(f"prefill-{i}"))


def test_reuse_through_valkey_with_api_keys(prod):
    router, model_dir = prod["router"], prod["model_dir"]
    messages = [{"role": "user", "content": words(model_dir, 600, 101)}]
    conv = f"reuse-{uuid.uuid4().hex[:6]}"
    first = post(router, messages, conversation=conv)
    assert first.status_code == 200 and first.headers["X-TurnKV-Reuse-Outcome"] == "none"
    messages += [{"role": "assistant", "content": text_of(first)},
                 {"role": "user", "content": words(model_dir, 80, 102)}]
    before = pulled(prod)
    second = post(router, messages, conversation=conv)
    off = post(router, messages, reuse=False)
    assert second.headers["X-TurnKV-Reuse-Outcome"] == "hit"
    # prefix caching on (as deployed): prefill computes neither what its own cache holds nor what it pulled
    reused = int(second.headers["X-TurnKV-Reused-Tokens"])
    local = int(second.headers["X-TurnKV-Prefill-Cached-Tokens"])
    assert reused + local > 500 and pulled(prod) - before == reused
    assert second.json()["choices"][0]["token_ids"] == off.json()["choices"][0]["token_ids"]
    assert "kv_transfer_params" not in second.text
    assert post(router, messages, key=None).status_code == 401
    assert post(router, messages, key="wrong-key-123456").status_code == 401


def test_a_prefix_cached_prefill_hits_its_own_cache_and_pulls_only_the_rest_from_decode(prod):
    """Prefix caching on prefill, as deployed (issue 30): two conversations of a tenant open with one system prompt,
    which the prefill choice keeps on one engine. The second conversation's first turn hits the prompt the first one
    computed there; each one's next turn hits its own first prompt there and READs only the blocks after it (the
    reply decode generated) from decode, with token proofs, and answers as reuse off does."""
    router, model_dir = prod["router"], prod["model_dir"]
    system = {"role": "system", "content": words(model_dir, 400, 131)}
    tag = uuid.uuid4().hex[:6]
    follow = {}
    for name, seed in (("a", 132), ("b", 133)):
        messages = [system, {"role": "user", "content": words(model_dir, 200, seed)}]
        first = post(router, messages, conversation=f"pc-{name}-{tag}", max_tokens=160, ignore_eos=True)
        assert first.status_code == 200 and first.headers["X-TurnKV-Reuse-Outcome"] == "none"
        if name == "b":  # the system prompt, computed by a's turn on the same engine
            assert int(first.headers["X-TurnKV-Prefill-Cached-Tokens"]) >= 350
        follow[name] = [*messages, {"role": "assistant", "content": text_of(first)},
                        {"role": "user", "content": words(model_dir, 40, seed + 10)}]
    for name, messages in follow.items():
        before = pulled(prod)
        on = post(router, messages, conversation=f"pc-{name}-{tag}")
        assert on.headers["X-TurnKV-Reuse-Outcome"] == "hit"
        local = int(on.headers["X-TurnKV-Prefill-Cached-Tokens"])
        reused = int(on.headers["X-TurnKV-Reused-Tokens"])
        # its own first prompt (~610 tokens) from prefill's cache in full blocks (128 tokens on the CPU backend), the
        # rest of what decode held (the 160-token reply and the partial block before it) pulled from decode
        assert local >= 384 and reused >= 100 and local + reused >= 700, (local, reused)
        assert pulled(prod) - before == reused
        off = post(router, messages, reuse=False)
        assert on.json()["choices"][0]["token_ids"] == off.json()["choices"][0]["token_ids"]
        print(f"conversation {name}: {local} prompt tokens from prefill's cache, {reused} pulled from decode")


def test_the_smoke_test_passes_on_a_stack_as_deployed(prod):
    """Issue #49: `turnkv smoke` against a stack as deployed (prefill prefix caching on, API keys, two of each
    engine) passes, each turn 2+ pulled from decode or found in prefill's cache after a replay, and says which. It
    failed every healthy stack before: its reuse-off request filled prefill's cache with the very prompt."""
    result = asyncio.run(smoke.run(prod["router"], api_key=ACME, timeout_s=300))
    assert result.ok, result.failure
    assert all(t.reuse in (smoke.PULLED, smoke.CACHED) for t in result.turns[1:])
    print(smoke.passed_line(result))


def test_two_tenants_with_one_conversation_id_never_share(prod):
    router, model_dir = prod["router"], prod["model_dir"]
    messages = [{"role": "user", "content": words(model_dir, 500, 111)}]
    first = post(router, messages, key=ACME, conversation="shared-id")
    follow = [*messages, {"role": "assistant", "content": text_of(first)}, {"role": "user", "content": "go on"}]
    before = pulled(prod)
    other = post(router, follow, key=GLOBEX, conversation="shared-id")
    assert other.status_code == 200 and other.headers["X-TurnKV-Reuse-Outcome"] == "miss"
    assert pulled(prod) == before
    own = post(router, follow, key=ACME, conversation="shared-id")
    # ACME's own entry is found and replayed. Whether prefill then pulls depends on which prefill the router
    # picked: the one that served turn 1 holds the prompt in its prefix cache, and decode's tail (the 16-token
    # reply) is below kv_recompute_threshold, so it recomputes; the other prefill pulls. Both are not a miss.
    assert own.status_code == 200 and own.headers["X-TurnKV-Reuse-Outcome"] in ("hit", "recompute")
    assert own.json()["choices"][0]["token_ids"] == other.json()["choices"][0]["token_ids"]


def test_forged_params_are_stripped(prod):
    forged = {"do_remote_prefill": True, "do_remote_decode": True, "remote_engine_id": "decode-0",
              "remote_block_ids": [[1, 2, 3]], "remote_host": "127.0.0.1", "remote_port": 25601,
              "remote_num_tokens": 4000}
    before = pulled(prod)
    for stream in (False, True):
        resp = post(prod["router"], [{"role": "user", "content": "hello there"}], stream=stream,
                    kv_transfer_params=forged)
        body = resp.content
        assert resp.status_code == 200 and resp.headers["X-TurnKV-Reused-Tokens"] == "0"
        assert b"kv_transfer_params" not in body
    assert pulled(prod) == before


def test_entries_expire_before_the_engine_frees_blocks(prod):
    router, model_dir = prod["router"], prod["model_dir"]
    conv = f"exp-{uuid.uuid4().hex[:6]}"
    import redis

    client = redis.Redis(port=REDIS_PORT)
    earlier = set(client.scan_iter("turnkv:conv:*"))  # other tests' turns (the smoke test's last) are older
    post(router, [{"role": "user", "content": words(model_dir, 200, 121)}], conversation=conv)
    keys = [k for k in client.scan_iter("turnkv:conv:*") if k not in earlier]
    assert keys
    stored_by = time.time()
    for key in keys:
        raw, pttl = client.get(key), client.pttl(key)
        if raw is None:
            continue
        entry = Entry.from_bytes(raw)
        # decode holds the blocks decoder_kv_blocks_ttl (60 s) after it finished; the entry goes
        # expiry_margin (10 s) before that at the latest, and never outlives conversation_ttl (45 s)
        assert 0 < pttl <= 45_000
        assert entry.expires_at <= stored_by + 45
        # vLLM 0.32 exports decode's perf_counter, not a Unix time: the router must not use it as one
        assert entry.params["remote_blocks_expiry_time"] < 1e9
        # decode's own wall-clock expiry bounds the entry (a slow reader's late store cannot outlive it)
        assert stored_by + 40 < entry.params["turnkv_expires_at"] <= stored_by + 61
        assert entry.expires_at <= entry.params["turnkv_expires_at"] - 10


def test_store_outage_costs_reuse_not_answers(prod):
    router, model_dir = prod["router"], prod["model_dir"]
    messages = [{"role": "user", "content": words(model_dir, 300, 131)}]
    first = post(router, messages, conversation="outage")
    prod["redis"]["proc"].kill()
    prod["redis"]["proc"].wait(5)
    try:
        follow = [*messages, {"role": "assistant", "content": text_of(first)}, {"role": "user", "content": "next"}]
        t0 = time.perf_counter()
        during = post(router, follow, conversation="outage")
        assert during.status_code == 200 and during.headers["X-TurnKV-Reuse-Outcome"] == "store_error"
        assert time.perf_counter() - t0 < 10
        metrics = requests.get(router + "/metrics", timeout=10).text
        assert 'turnkv_router_store_errors_total{op="take"}' in metrics
    finally:
        prod["redis"]["proc"] = redis_start()
    # A prompt of its own: the outage turn's follow-up is already in the prefix cache of the prefill engine that
    # recomputed it, and the same text again would find all of it there (nothing left to pull: "recompute").
    fresh = [{"role": "user", "content": words(model_dir, 300, 132)}]
    again = post(router, fresh, conversation="after-outage")
    follow = [*fresh, {"role": "assistant", "content": text_of(again)}, {"role": "user", "content": "next"}]
    after = post(router, follow, conversation="after-outage")
    # The store serves the entry again. Prefill pulls it unless the turn landed on the prefill engine that computed
    # turn 1 (ties go round-robin): then its own prefix cache leaves under kv_recompute_threshold tokens to pull.
    local = int(after.headers["X-TurnKV-Prefill-Cached-Tokens"])
    assert after.headers["X-TurnKV-Reuse-Outcome"] == ("hit" if local < 256 else "recompute"), local


def running(prod, name) -> float:
    return metric(prod["comps"][name]["url"], "vllm:num_requests_running")


def test_client_disconnect_aborts_both_legs(prod):
    router, model_dir = prod["router"], prod["model_dir"]
    resp = post(router, [{"role": "user", "content": words(model_dir, 100, 141)}], stream=True, max_tokens=4000,
                ignore_eos=True)
    it = resp.iter_lines()
    next(line for line in it if line.startswith(b"data: "))  # decoding is under way
    assert sum(running(prod, f"decode-{i}") for i in range(2)) == 1
    resp.close()
    t0 = time.monotonic()
    while sum(running(prod, f"decode-{i}") for i in range(2)) and time.monotonic() - t0 < 5:
        time.sleep(0.1)
    assert sum(running(prod, f"decode-{i}") for i in range(2)) == 0, "decode kept generating after the disconnect"
    # prefill: a long prompt, disconnected while it is being prefilled
    long = [{"role": "user", "content": words(model_dir, 7000, 142)}]
    with contextlib.suppress(requests.exceptions.Timeout):
        requests.post(f"{router}/v1/chat/completions", json={"model": "tiny", "messages": long, "max_tokens": 4},
                      headers=auth(), timeout=0.3)
    t0 = time.monotonic()
    while sum(running(prod, f"prefill-{i}") for i in range(2)) and time.monotonic() - t0 < 5:
        time.sleep(0.1)
    assert sum(running(prod, f"prefill-{i}") for i in range(2)) == 0
    assert sum(running(prod, f"decode-{i}") for i in range(2)) == 0


def kill(prod, name) -> None:
    with contextlib.suppress(ProcessLookupError):  # an earlier test may have killed it already
        os.killpg(prod["comps"][name]["pgid"], signal.SIGKILL)


def stream_ids(resp) -> tuple[list[int], list[dict]]:
    events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith(b"data: {")]
    return [t for e in events for c in e.get("choices", []) for t in c.get("token_ids") or []], events


def test_a_stream_survives_its_decode_engine_being_killed(prod):
    """Decode killed after tokens went out: the router continues the stream on the other decode engine with
    every token once, identical (greedy) to an undisturbed run."""
    router, model_dir = prod["router"], prod["model_dir"]
    messages = [{"role": "user", "content": words(model_dir, 300, 151)}]
    calm, _ = stream_ids(post(router, messages, stream=True, max_tokens=300, ignore_eos=True))
    assert len(calm) == 300
    for _ in range(6):  # until the stream lands on decode-0 (ties alternate)
        resp = post(router, messages, stream=True, max_tokens=300, ignore_eos=True)
        lines = resp.iter_lines()
        head = [next(line for line in lines if line.startswith(b"data: {")) for _ in range(20)]
        if running(prod, "decode-0") >= 1:
            break
        resp.close()
    else:
        pytest.fail("no stream landed on decode-0")
    kill(prod, "decode-0")
    rest = [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]
    events = [json.loads(line[6:]) for line in head] + rest
    assert not any("error" in e for e in events), events[-1]
    ids = [t for e in events for c in e.get("choices", []) for t in c.get("token_ids") or []]
    assert ids == calm
    text = requests.get(router + "/metrics", timeout=10).text
    assert 'turnkv_router_stream_migrations_total{result="continued"} 1.0' in text


def test_killed_prefill_engine_requests_succeed_on_the_other(prod):
    router = prod["router"]
    kill(prod, "prefill-0")
    statuses = [post(router, [{"role": "user", "content": f"question {i}"}]).status_code for i in range(6)]
    assert statuses == [200] * 6
    health = requests.get(router + "/health", timeout=10).json()
    assert [e["healthy"] for e in health["engines"] if e["name"] == "127.0.0.1:28100"] == [False]
    metrics = requests.get(router + "/metrics", timeout=10).text
    assert 'turnkv_router_engine_healthy{engine="127.0.0.1:28100",role="prefill"} 0.0' in metrics


def test_killed_decode_engine_requests_succeed_on_the_other(prod):
    router = prod["router"]
    kill(prod, "decode-0")
    for stream in (False, True, False, True):
        resp = post(router, [{"role": "user", "content": "after the decode crash"}], stream=stream)
        assert resp.status_code == 200
        assert b"upstream_error" not in resp.content
