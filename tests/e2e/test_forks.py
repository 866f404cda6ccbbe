"""Forks that all pull (issue 30), on real vLLM CPU engines: three branches of one history sent at once, and a
retry, each pull the turn decode retained (decode keeps it for ``fork_window`` after its first read), with answers
equal to reuse off; past the window the router no longer replays it and decode evicts it (reason ``read``).
``fork_window`` is hot-reloaded to 4 s for this module (decode signs it into each offer)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e import STACK_RETENTION
from tests.e2e.client import chat, metric, pulled_tokens, words
from turnkv import params

pytestmark = pytest.mark.engines
WINDOW = 4


@pytest.fixture(scope="module", autouse=True)
def short_fork_window(stack):
    tunables = stack["state_dir"] / "tunables.json"
    tunables.write_text(json.dumps({**STACK_RETENTION, "fork_window": WINDOW}))
    time.sleep(1.2)  # the connector re-reads the file at most once a second
    try:
        yield
    finally:  # the stack's values again, the catalog's window included (a file without it keeps the last one read)
        tunables.write_text(json.dumps({**STACK_RETENTION, "fork_window": params.BY_NAME["fork_window"].default}))
        time.sleep(1.2)


def test_forks_of_one_history_all_pull_within_the_window_with_answers_equal_to_reuse_off(stack):
    router, prefill, decode, model_dir = stack["router"], stack["prefill-0"], stack["decode-0"], stack["model_dir"]
    history = [{"role": "system", "content": words(model_dir, 200, 901)},
               {"role": "user", "content": words(model_dir, 450, 902)}]
    first = chat(router, history)
    assert first.status == 200 and first.outcome == "none"
    said = [*history, {"role": "assistant", "content": first.text}]
    forks = [[*said, {"role": "user", "content": words(model_dir, 40, 910 + i)}] for i in range(4)]
    holds = metric(decode, "vllm:turnkv_fork_holds_total")
    replayed = metric(prefill, "vllm:turnkv_offers_replayed_total")
    read_evictions = metric(decode, "vllm:turnkv_retention_evictions_total", reason="read")
    pulled = pulled_tokens(stack)
    started = time.monotonic()
    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(lambda m: chat(router, m), forks[:3]))
    retry = chat(router, forks[0])  # a retry of the first branch, still within the window
    elapsed = time.monotonic() - started
    assert elapsed < WINDOW, f"the forks took {elapsed:.1f} s: longer than the window this test sets"
    on = [*replies, retry]
    assert [r.outcome for r in on] == ["hit"] * 4, [r.outcome for r in on]
    assert all(r.reused > 600 for r in on), [r.reused for r in on]
    assert pulled_tokens(stack) - pulled == sum(r.reused for r in on)  # prefill's own count: every fork READ
    assert metric(decode, "vllm:turnkv_fork_holds_total") - holds == 1  # one retained turn, kept after its read
    assert metric(prefill, "vllm:turnkv_offers_replayed_total") == replayed  # each reader's clearance read once
    for reply, messages in zip(on, [*forks[:3], forks[0]], strict=True):
        assert reply.token_ids == chat(router, messages, reuse=False).token_ids, "reuse changed a fork's answer"
    time.sleep(max(0.0, WINDOW + 0.5 - (time.monotonic() - started)))
    late = chat(router, forks[3])  # past the window: not replayed, computed, same answer
    assert late.outcome == "miss" and late.reused == 0
    assert late.token_ids == chat(router, forks[3], reuse=False).token_ids
    # decode announced the read turn once its window passed (freed after the grace)
    deadline = time.monotonic() + 5
    while metric(decode, "vllm:turnkv_retention_evictions_total", reason="read") == read_evictions:
        assert time.monotonic() < deadline, "decode did not evict the read turn after its fork window"
        chat(router, forks[3], reuse=False, max_tokens=2)  # decode's scheduler looks at each step
    print(f"fork reuse: {[r.reused for r in on]} tokens pulled by 3 forks and a retry in {elapsed:.1f} s")
