"""Push mode on real vLLM CPU engines with upstream's NixlPushConnector (not bi-directional): the router
learns the prefill engine's identity from its first push answer, then dispatches prefill and decode
concurrently with one X-Request-Id and transfer_id. Ports 28010 (router), 28110/28210, 25620+."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from tests.e2e.client import chat, engine_stack, metric, words
from turnkv.local.stack import StackConfig

pytestmark = pytest.mark.engines

STATE = Path(__file__).resolve().parents[2] / ".turnkv" / "e2e-router-push"


@pytest.fixture(scope="module")
def push_stack():
    config = StackConfig(state_dir=STATE, router_port=28010, prefill_port=28110, decode_port=28210,
                         prefill_prefix_caching=False,  # the seeds' setting: the A/B measures reuse
                         side_channel_base=25620, kv_cache_gib=1, connector="NixlPushConnector",
                         tunables={"decoder_kv_blocks_ttl": 60, "conversation_ttl": 45})
    with engine_stack(config) as stack:
        yield stack


def test_push_dispatch_learns_identity_then_runs_both_legs_at_once(push_stack):
    router, model_dir = push_stack["router"], push_stack["model_dir"]
    external = ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"})
    before = metric(push_stack["decode-0"], external[0], **external[1])
    replies = []
    for i, stream in enumerate((False, True, False, True)):
        reply = chat(router, [{"role": "user", "content": words(model_dir, 400, 200 + i % 2)}], stream=stream)
        assert reply.status == 200 and reply.token_ids, reply.body
        replies.append(reply)
    # the same prompt gives the same tokens, streamed or not, serial or concurrent
    assert replies[0].token_ids == replies[2].token_ids and replies[1].token_ids == replies[3].token_ids
    # the two distinct prompts' KV came from prefill (the repeats hit decode's own prefix cache)
    assert metric(push_stack["decode-0"], external[0], **external[1]) - before >= 2 * 390
    text = requests.get(router + "/metrics", timeout=10).text
    assert 'turnkv_router_push_dispatches_total{kind="serial"} 1.0' in text
    assert 'turnkv_router_push_dispatches_total{kind="concurrent"} 3.0' in text
