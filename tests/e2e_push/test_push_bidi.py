"""Push + bi-directional on real vLLM CPU engines (``connector.push``): two prefill and two decode engines,
the router in push mode with round-robin choice, so every turn is prefilled and decoded by other engines
than the previous turn's. Each turn after the first, prefill READs the previous turn back from the decode
engine that holds it and WRITEs the whole KV into the new decode engine; the answers equal reuse off.
Ports 19000 (router), 19100/19101 (prefill), 19200/19201 (decode), 16600+ (side channels): below the
ephemeral range (32768+), where an outgoing connection could take one first."""

from __future__ import annotations

import itertools
import os
import signal
import time
from pathlib import Path

import pytest
import requests

from tests.e2e.client import chat, engine_stack, metric, wait_for, words
from turnkv import params, wire
from turnkv.engine_args import Mode
from turnkv.local.stack import StackConfig

pytestmark = pytest.mark.engines

STATE = Path(__file__).resolve().parents[2] / ".turnkv" / "e2e-push"
EXTERNAL = ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"})
PREFILLS = ("prefill-0", "prefill-1")
DECODES = ("decode-0", "decode-1")


@pytest.fixture(scope="module")
def push_stack():
    config = StackConfig(state_dir=STATE, router_port=19000, prefill_port=19100, decode_port=19200,
                         side_channel_base=16600, kv_cache_gib=1, mode=Mode.PUSH, prefill_engines=2,
                         decode_engines=2,
                         router_args=("--policy", "round_robin"),
                         tunables={"decoder_kv_blocks_ttl": 60, "conversation_ttl": 45})
    with engine_stack(config) as stack:
        yield stack


def external(url: str) -> float:
    return metric(url, EXTERNAL[0], **EXTERNAL[1])


def prefill_side(stack, measure) -> float:
    """``measure(url)`` summed over both prefill engines."""
    return sum(measure(stack[p]) for p in PREFILLS)


def counter(name: str):
    return lambda url: metric(url, name)


def prefill_grew(stack, name: str, before: float, timeout: float = 10) -> bool:
    """Whether the prefill engines' counter ``name`` rises above ``before`` within ``timeout``. Prefill counts a
    transfer when a step of its own polls it done, which can come after decode has finished a short reply (read
    at once, the WRITE's bytes were missing once in a fresh-clone run)."""
    return wait_for(lambda: prefill_side(stack, counter(name)) > before, timeout)


def finished(url: str) -> float:
    return metric(url, "vllm:request_success_total")


def prompt_len(stack, messages) -> int:
    return len(requests.post(f"{stack['prefill-0']}/tokenize", json={
        "model": "tiny", "messages": messages, "add_generation_prompt": True}, timeout=30).json()["tokens"])


def test_one_shot_requests_retain_nothing_in_push_mode(push_stack):
    stack, router, model_dir = push_stack, push_stack["router"], push_stack["model_dir"]
    for seed in (60, 61):
        reply = chat(router, [{"role": "user", "content": words(model_dir, 300, seed)}], reuse=False)
        assert reply.status == 200 and reply.outcome == "disabled"
    # reuse off: decode keeps nothing for these (KV usage drops back to 0 once they finish)
    assert wait_for(lambda: all(metric(stack[n], "vllm:kv_cache_usage_perc") == 0 for n in DECODES), 20)


def test_push_turns_read_back_from_one_decode_and_write_into_the_other(push_stack):
    stack, router, model_dir = push_stack, push_stack["router"], push_stack["model_dir"]
    messages = [{"role": "system", "content": words(model_dir, 200, 41)},
                {"role": "user", "content": words(model_dir, 500, 42)}]
    turns, answered_by, prefilled_by, previous, sources = [], [], [], None, []
    for turn in range(4):
        before = {name: (external(stack[name]), finished(stack[name])) for name in (*PREFILLS, *DECODES)}
        pulled_before, read_before, written_before = (
            prefill_side(stack, external), prefill_side(stack, counter("vllm:turnkv_read_bytes_total")),
            prefill_side(stack, counter("vllm:turnkv_write_bytes_total")))
        on = chat(router, messages, conversation="push-bidi", stream=turn % 2 == 1)
        assert on.status == 200 and on.token_ids, on.body
        decode = next(n for n in DECODES if finished(stack[n]) > before[n][1])
        answered_by.append(decode)
        prefilled_by.append(next(n for n in PREFILLS if finished(stack[n]) > before[n][1]))
        # the answering decode engine received its KV by prefill's WRITE: all of it, or what its own prefix
        # cache lacked (a turn back on an engine that decoded an earlier one)
        assert external(stack[decode]) > before[decode][0]
        assert prefill_grew(stack, "vllm:turnkv_write_bytes_total", written_before)
        if turn == 0:
            assert on.outcome == "none" and on.reused == 0 and prefill_side(stack, external) == pulled_before
        elif on.outcome == "recompute":
            # prefill's own prefix cache (prefix caching on, as deployed) held most of what decode held: too little
            # left to pull (below kv_recompute_threshold, or slower than computing it), so prefill computed it
            assert on.reused == 0 and 0 < on.prefill_cached < previous, (on.reused, on.prefill_cached, previous)
            sources.append((on.prefill_cached, 0))
        else:
            # prefill computed nothing decode held (but the unsent last token): what its own prefix cache lacked
            # it READ back from the previous turn's decode engine
            assert on.outcome == "hit" and on.reused + on.prefill_cached == previous - 1, \
                (on.outcome, on.reused, on.prefill_cached, previous)
            assert prefill_side(stack, external) - pulled_before == on.reused > 0
            assert prefill_grew(stack, "vllm:turnkv_read_bytes_total", read_before)
            sources.append((on.prefill_cached, on.reused))
        previous = prompt_len(stack, messages) + len(on.token_ids)
        turns.append((list(messages), on))
        messages = [*messages, {"role": "assistant", "content": on.text},
                    {"role": "user", "content": words(model_dir, 150, 50 + turn)}]
    # round robin: every turn went to the other decode engine than the previous turn's; prefill stays on the home
    # engine of the conversation's system prompt (the cache-aware prefill choice, router/engines/prefix.py)
    assert all(a != b for a, b in itertools.pairwise(answered_by)), answered_by
    assert len(set(prefilled_by)) == 1, prefilled_by
    # from the second turn on, prefill holds the previous turn's prompt (it prefilled it): a local prefix hit, and
    # (at least once) the blocks after it READ from decode
    assert all(local > 0 for local, _ in sources), sources
    assert any(local > 0 and pulled > 0 for local, pulled in sources), sources
    print(f"push, prefix caching on: (local hit, pulled) per later turn {sources}")
    # the last turn's KV is retained (and reported) on the engine that decoded it, for the next turn
    assert wait_for(lambda: metric(stack[answered_by[-1]], "vllm:turnkv_retained_bytes") > 0, 15)
    # greedy answers with reuse equal the answers without it (replayed afterwards: the alternation above
    # must not be disturbed)
    for turn, (history, on) in enumerate(turns):
        off = chat(router, history, conversation="push-bidi-off", reuse=False, stream=turn % 2 == 1)
        assert off.status == 200 and off.outcome == "disabled" and off.reused == 0
        assert off.token_ids == on.token_ids, f"turn {turn + 1}: reuse changed the answer"


def test_a_push_mode_lease_renewal_reaches_the_decode_engine_and_the_turn_still_reuses(push_stack):
    router, model_dir = push_stack["router"], push_stack["model_dir"]
    messages = [{"role": "user", "content": words(model_dir, 400, 70)}]
    first = chat(router, messages, conversation="push-lease")
    assert first.status == 200
    renewed = requests.post(f"{router}/v1/conversations/lease", timeout=30,
                            json={"messages": [*messages, {"role": "assistant", "content": first.text}],
                                  "model": "tiny", "ttl": 120})
    # 200 only when the decode engine found the retained request in its push worker's lease table
    assert renewed.status_code == 200, renewed.text
    assert 105 < renewed.json()["expires_in"] <= 110  # 120 s minus the router's expiry margin
    second = chat(router, [*messages, {"role": "assistant", "content": first.text},
                           {"role": "user", "content": "go on"}], conversation="push-lease")
    assert second.outcome == "hit" and second.reused > 400


def test_a_turn_decoded_by_the_engine_that_holds_it_reads_and_writes_back_into_it(push_stack):
    """The usual case with decode affinity: the same decode engine serves the READ of the previous turn
    and receives the WRITE of the new one (round robin is steered there with one request in between)."""
    stack, router, model_dir = push_stack, push_stack["router"], push_stack["model_dir"]
    messages = [{"role": "user", "content": words(model_dir, 600, 80)}]
    before = {name: finished(stack[name]) for name in DECODES}
    first = chat(router, messages, conversation="push-same")
    holder = next(n for n in DECODES if finished(stack[n]) > before[n])
    assert chat(router, [{"role": "user", "content": words(model_dir, 50, 81)}]).status == 200  # the other one
    history = [*messages, {"role": "assistant", "content": first.text}, {"role": "user", "content": "go on"}]
    before = {name: (finished(stack[name]), external(stack[name])) for name in DECODES}
    second = chat(router, history, conversation="push-same")
    assert finished(stack[holder]) > before[holder][0], "round robin did not come back to the holder"
    # prefill computed nothing decode held (but the unsent last token): its own prefix cache (prefix caching on, as
    # deployed) and the READ from decode together
    assert second.outcome == "hit" and second.reused > 0
    assert second.reused + second.prefill_cached == prompt_len(stack, messages) + len(first.token_ids) - 1
    # its prefix cache still holds the previous turn's full blocks: only the rest is written into it
    pushed = external(stack[holder]) - before[holder][1]
    assert 0 < pushed < prompt_len(stack, history) - 128, pushed
    assert second.token_ids == chat(router, history, conversation="push-same-off", reuse=False).token_ids


def test_last_a_dead_decode_engine_costs_a_recompute_not_a_stall(push_stack):
    """Runs last (it kills an engine). Decode dies after a turn; before the router notices, the next turn
    replays params naming it: prefill's READ fails at once and it recomputes, on the other decode engine. The
    router has read decode's seal of the turn first (else it would not replay the turn at all: ``refused``)."""
    stack, router, model_dir = push_stack, push_stack["router"], push_stack["model_dir"]
    messages = [{"role": "user", "content": words(model_dir, 500, 90)}]
    before = {name: finished(stack[name]) for name in DECODES}
    first = chat(router, messages, conversation="push-dead")
    holder = next(n for n in DECODES if finished(stack[n]) > before[n])
    feed = f"{stack[holder]}{wire.EVICTIONS_ROUTE}?since=0"
    if requests.get(feed, timeout=10).json().get("seals"):  # decode seals its turns (vLLM 0.32's layout)
        assert wait_for(lambda: requests.get(feed, timeout=10).json()["sealed"], 10), "no seal on decode's feed"
        time.sleep(2 * params.BY_NAME["evictions_interval"].default + 0.5)  # the router's next periodic read
    failed_before = prefill_side(stack, counter("vllm:nixl_num_failed_transfers_total"))
    os.killpg(stack["pgids"][holder], signal.SIGKILL)
    history = [*messages, {"role": "assistant", "content": first.text}, {"role": "user", "content": "go on"}]
    started = time.monotonic()
    second = chat(router, history, conversation="push-dead")
    elapsed = time.monotonic() - started
    assert second.status == 200 and second.outcome == "recompute" and second.reused == 0
    # upstream re-awaits the failed READ forever; the router's prefill timeout (120 s) used to end it
    assert elapsed < 30, f"turn after the decode died took {elapsed:.1f} s"
    assert prefill_side(stack, counter("vllm:nixl_num_failed_transfers_total")) > failed_before
    assert second.token_ids == chat(router, history, conversation="push-dead-off", reuse=False).token_ids
