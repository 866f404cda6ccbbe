"""The host tier on real vLLM CPU engines: with no device room for retained turns (``retained_kv_share`` 0), decode
copies each finished turn into its host pool (64 MiB, registered with NIXL at start), prefill READs it back from
there through the router, and every answer equals reuse-off. When the pool is full, newcomers are refused (not
retained), the pool's bytes never exceed its size, and slots freed by reads serve newer turns with the right KV.

Runs right after the retention module (conftest.FIRST): decode's host tier holds nothing of another module."""

from __future__ import annotations

import json
import time
from importlib.metadata import version

import pytest
from packaging.version import Version

from tests.e2e import STACK_RETENTION, TUNABLES
from tests.e2e.client import chat, metric, words

# vLLM 0.29 (the Neuron image's, `make test`'s second engine run) has no per-region KV layout: decode ignores the
# budget with a warning (connector.worker), which tests/unit/test_platform_paths.py checks.
pytestmark = [pytest.mark.engines,
              pytest.mark.skipif(Version(version("vllm")).release < (0, 32),
                                 reason="the host tier needs vLLM 0.32's NIXL worker (per-region layout)")]
ENGINE = {"retained_kv_share": 0.0, "host_kv_budget_mib": TUNABLES["host_kv_budget_mib"]}


@pytest.fixture(scope="module", autouse=True)
def host_only(stack):
    tunables = stack["state_dir"] / "tunables.json"
    tunables.write_text(json.dumps({**ENGINE, "decoder_kv_blocks_ttl": TUNABLES["decoder_kv_blocks_ttl"]}))
    time.sleep(1.2)
    try:
        yield
    finally:
        tunables.write_text(json.dumps(STACK_RETENTION))
        time.sleep(1.2)


def _first_turn(router: str, model_dir, seed: int) -> list[dict]:
    messages = [{"role": "user", "content": words(model_dir, 450, seed)}]
    reply = chat(router, messages, conversation=f"host-{seed}")
    assert reply.status == 200
    return [*messages, {"role": "assistant", "content": reply.text},
            {"role": "user", "content": words(model_dir, 40, seed + 500)}]


def _next_turn_reuses_from_host(stack, history: list[dict], seed: int, stream: bool = False) -> None:
    router = stack["router"]
    on = chat(router, history, conversation=f"host-{seed}", stream=stream)
    assert on.outcome == "hit" and on.reused > 300, (on.status, on.outcome, on.reused)
    assert on.token_ids == chat(router, history, reuse=False).token_ids


def test_turns_past_the_device_share_are_read_back_from_the_host_tier(stack):
    router, decode, prefill, model_dir = stack["router"], stack["decode-0"], stack["prefill-0"], stack["model_dir"]
    placed = metric(decode, "vllm:turnkv_retention_placed_total", tier="host")
    moves = metric(decode, "vllm:turnkv_host_moves_total")
    pulls = metric(prefill, "vllm:turnkv_pulls_total", tier="host")
    histories = {seed: _first_turn(router, model_dir, seed) for seed in (1201, 1202, 1203)}
    # the workers report their pools with their first step's output: known once decode has run a request
    pool = metric(decode, "vllm:turnkv_host_pool_bytes")
    assert pool == TUNABLES["host_kv_budget_mib"] * 1024 * 1024
    assert metric(decode, "vllm:turnkv_retention_placed_total", tier="host") - placed == 3
    assert metric(decode, "vllm:turnkv_host_moves_total") - moves == 3
    assert 0 < metric(decode, "vllm:turnkv_host_retained_bytes") <= pool
    for i, (seed, history) in enumerate(histories.items()):
        _next_turn_reuses_from_host(stack, history, seed, stream=i == 0)
    assert metric(prefill, "vllm:turnkv_pulls_total", tier="host") - pulls == 3


def test_a_full_pool_refuses_newcomers_stays_within_its_size_and_reused_slots_hold_the_right_kv(stack):
    router, decode, model_dir = stack["router"], stack["decode-0"], stack["model_dir"]
    pool = metric(decode, "vllm:turnkv_host_pool_bytes")
    full = metric(decode, "vllm:turnkv_retention_refusals_total", reason="full")
    # ~5 slots a turn: 20 first turns are more than 64 slots hold (slots freed by the reads above are reused)
    histories = {seed: _first_turn(router, model_dir, seed) for seed in range(1301, 1321)}
    assert metric(decode, "vllm:turnkv_retention_refusals_total", reason="full") - full >= 4
    held = metric(decode, "vllm:turnkv_host_retained_bytes")
    assert 0 < held <= pool, (held, pool)
    # the earliest ones found room: read back from reused slots, the same answers as reuse off
    for seed in (1301, 1302):
        _next_turn_reuses_from_host(stack, histories[seed], seed)
    # the last ones found the pool full: not retained, recomputed, the same answers
    last = chat(router, histories[1320], conversation="host-1320")
    assert last.outcome == "miss" and last.token_ids == chat(router, histories[1320], reuse=False).token_ids
