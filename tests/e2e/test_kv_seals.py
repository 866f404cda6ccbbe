"""KV seals on real vLLM CPU engines (issue 50): decode digests every retained turn's KV bytes, the router carries the
seal to prefill, and prefill checks each block a READ brought before computing with it. READs misaddressed on
purpose in the running prefill engine (``connector.seals``, switched through ``conftest.READ_FAULT``): a wrong
decode block, two layers written into each other's place, a stale host-tier slot. Each is caught, its blocks are
recomputed, and the answer equals reuse off. And READs that fail (a failed transfer, a decode engine invalidated as
after a transport error): recomputed, the same answer, and the next pull from that engine handshakes again."""

from __future__ import annotations

import json
import time
from importlib.metadata import version

import pytest
from packaging.version import Version

from tests.e2e import STACK_RETENTION, TUNABLES
from tests.e2e.client import chat, metric, words
from tests.e2e.conftest import READ_FAULT

pytestmark = [pytest.mark.engines,
              pytest.mark.skipif(Version(version("vllm")).release < (0, 32),
                                 reason="KV seals and the READ faults are run on vLLM 0.32's NIXL worker (the GPU "
                                        "image's); the Neuron image's 0.29 is not checked")]

CHECKS = "vllm:turnkv_fingerprint_checks_total"
MISMATCHES = "vllm:turnkv_fingerprint_mismatches_total"


@pytest.fixture(autouse=True)
def no_fault_after():
    yield
    READ_FAULT.write_text("")


def _history(router: str, model_dir, seed: int) -> list[dict]:
    messages = [{"role": "user", "content": words(model_dir, 400, seed)}]
    reply = chat(router, messages, conversation=f"seal-{seed}")
    assert reply.status == 200, reply.body
    return [*messages, {"role": "assistant", "content": reply.text},
            {"role": "user", "content": words(model_dir, 40, seed + 500)}]


def _turn(stack, history: list[dict], seed: int, fault: str = ""):
    """The next turn with ``fault`` switched on in prefill, its reuse-off answer, and what prefill's checks counted."""
    prefill = stack["prefill-0"]
    before = {r: metric(prefill, CHECKS, result=r) for r in ("ok", "mismatch", "unverifiable")}
    READ_FAULT.write_text(fault)
    on = chat(stack["router"], history, conversation=f"seal-{seed}")
    READ_FAULT.write_text("")
    off = chat(stack["router"], history, reuse=False)
    assert on.status == 200 and off.status == 200, (on.body, off.body)
    counted = {r: metric(prefill, CHECKS, result=r) - v for r, v in before.items()}
    return on, off, counted


def test_every_pull_is_checked_against_decodes_seal(stack):
    history = _history(stack["router"], stack["model_dir"], 1401)
    on, off, counted = _turn(stack, history, 1401)
    assert on.outcome == "hit" and on.reused > 300, (on.outcome, on.reused)
    assert counted == {"ok": 1, "mismatch": 0, "unverifiable": 0}
    assert on.token_ids == off.token_ids


@pytest.mark.parametrize(("fault", "seed"), [("block", 1411), ("layer", 1421)])
def test_a_misaddressed_read_is_caught_and_its_blocks_recomputed(stack, fault, seed):
    prefill = stack["prefill-0"]

    def device_reads():  # a device-tier pull is read inline once the engine is handshaken and timed, else async
        return metric(prefill, MISMATCHES, path="device") + metric(prefill, MISMATCHES, path="inline")

    before = device_reads()
    history = _history(stack["router"], stack["model_dir"], seed)
    on, off, counted = _turn(stack, history, seed, fault)
    assert counted == {"ok": 0, "mismatch": 1, "unverifiable": 0}
    assert device_reads() > before
    assert on.token_ids == off.token_ids  # recomputed: the same answer as reuse off


@pytest.mark.parametrize(("fault", "seed"), [("fail", 1441), ("invalidate", 1451)])
def test_a_read_that_fails_is_recomputed_and_the_next_pull_reads_again(stack, fault, seed):
    history = _history(stack["router"], stack["model_dir"], seed)
    on, off, counted = _turn(stack, history, seed, fault)
    assert counted == {"ok": 0, "mismatch": 0, "unverifiable": 0}  # nothing landed to check
    assert on.token_ids == off.token_ids
    history = _history(stack["router"], stack["model_dir"], seed + 1)
    again, off, counted = _turn(stack, history, seed + 1)  # no fault: decode's next turn is read and checked
    assert again.outcome == "hit" and counted["ok"] == 1, (again.outcome, counted)
    assert again.token_ids == off.token_ids


def test_a_read_of_a_stale_host_slot_is_caught(stack):
    tunables = stack["state_dir"] / "tunables.json"
    tunables.write_text(json.dumps({"retained_kv_share": 0.0, "host_kv_budget_mib": TUNABLES["host_kv_budget_mib"],
                                    "decoder_kv_blocks_ttl": TUNABLES["decoder_kv_blocks_ttl"]}))
    time.sleep(1.2)
    try:
        prefill = stack["prefill-0"]
        host = metric(prefill, MISMATCHES, path="host")
        pulls = metric(prefill, "vllm:turnkv_pulls_total", tier="host")
        history = _history(stack["router"], stack["model_dir"], 1431)
        on, off, counted = _turn(stack, history, 1431, "block")  # the host slot next to the turn's
        assert metric(prefill, "vllm:turnkv_pulls_total", tier="host") > pulls
        assert counted["mismatch"] == 1 and metric(prefill, MISMATCHES, path="host") > host
        assert on.token_ids == off.token_ids
    finally:
        tunables.write_text(json.dumps(STACK_RETENTION))
        time.sleep(1.2)
