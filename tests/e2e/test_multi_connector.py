"""turnkv's connector as a ``MultiConnector`` child on a real prefill engine: the shape a prefill with vLLM's CPU
offloading tier runs (``connector.prefill_offload_gib``, ``turnkv.engine_args.kv_transfer_config``). The offloading
connector itself refuses vLLM's CPU build ("CPU Offloading is currently only supported on CUDA-alike and XPU
GPUs"), so here the MultiConnector wraps turnkv's connector alone: what is checked is that vLLM's wrapper (metadata
binding, the first-match choice of a loader, ``request_finished``'s params, stats) lets turnkv's pull run as
deployed: a later turn pulls what decode held and answers as with reuse off. Its own stack (ports
18050/18150/18250, side channels from 15900)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.client import OUTCOME, REUSED, chat, engine_stack, metric, pulled_tokens, words
from turnkv import engine_args
from turnkv.engine_args import Role
from turnkv.local.stack import StackConfig

pytestmark = pytest.mark.engines

ROOT = Path(__file__).resolve().parents[2]
STATE_DIR = ROOT / ".turnkv" / "e2e-multi"


@pytest.fixture(scope="module")
def multi_stack():
    own = engine_args.kv_transfer_config

    def wrapped(spec):
        config = own(spec)
        return engine_args.multi_connector(config, []) if spec.role is Role.PREFILL else config

    patch = pytest.MonkeyPatch()
    patch.setattr(engine_args, "kv_transfer_config", wrapped)
    config = StackConfig(state_dir=STATE_DIR, router_port=18050, prefill_port=18150, decode_port=18250,
                         side_channel_base=15900, kv_cache_gib=1, prefill_prefix_caching=True,
                         tunables={"decoder_kv_blocks_ttl": 60, "conversation_ttl": 45})
    try:
        with engine_stack(config) as running:
            yield running
    finally:
        patch.undo()


def _ask(router: str, messages: list[dict], conversation: str | None, reuse: bool = True):
    """An agent-sized turn: 96 tokens exactly (the pulled tail is the reply decode computed)."""
    return chat(router, messages, conversation=conversation, reuse=reuse, max_tokens=96, min_tokens=96)


def test_the_prefill_engine_runs_a_multiconnector(multi_stack):
    prefill = (STATE_DIR / "logs" / "prefill-0.log").read_text()
    assert "kv_connector='MultiConnector'" in prefill and "TurnkvPullConnector" in prefill
    assert "kv_connector='MultiConnector'" not in (STATE_DIR / "logs" / "decode-0.log").read_text()


def test_a_later_turn_pulls_decodes_tail_through_the_multiconnector(multi_stack):
    router, model_dir = multi_stack["router"], multi_stack["model_dir"]
    messages = [{"role": "system", "content": words(model_dir, 150, 301)},
                {"role": "user", "content": words(model_dir, 300, 302)}]
    first = _ask(router, messages, "multi-1")
    assert first.status == 200, first.body
    messages += [{"role": "assistant", "content": first.text},
                 {"role": "user", "content": words(model_dir, 60, 303)}]
    before = pulled_tokens(multi_stack)
    second = _ask(router, messages, "multi-1")
    assert second.status == 200 and second.headers[OUTCOME] == "hit", second.headers
    reused = int(second.headers[REUSED])
    # prefill's own prefix cache served the first prompt; the pull brought the reply decode computed (96 tokens)
    assert reused >= 96 and pulled_tokens(multi_stack) - before == reused
    off = _ask(router, messages, None, reuse=False)
    assert second.token_ids == off.token_ids


def test_once_a_read_is_timed_the_next_pull_is_read_inside_its_step(multi_stack):
    """connector.inline: the first pull from decode handshakes and is timed (asynchronous); a later short one is
    read before the forward of the step that computes it, and answers as with reuse off."""
    from connector import compat

    if not compat.reads_inline():
        pytest.skip(f"vLLM {'.'.join(map(str, compat.release()))} reads every pull asynchronously (connector.inline)")
    router, model_dir, prefill = multi_stack["router"], multi_stack["model_dir"], multi_stack["prefill-0"]
    messages = [{"role": "system", "content": words(model_dir, 150, 311)},
                {"role": "user", "content": words(model_dir, 300, 312)}]
    inline_before = metric(prefill, "vllm:turnkv_inline_plans_total", reason="inline")
    # new messages of 60-140 words: the pulled tail (decode's 96-token reply past prefill's last full cached block)
    # ends at a different offset in its block every turn, so a READ landing one block off shows in an answer
    for turn in range(5):
        reply = _ask(router, messages, "multi-inline")
        off = _ask(router, messages, None, reuse=False)
        assert reply.status == 200 and off.status == 200, reply.body
        assert reply.token_ids == off.token_ids, (turn, reply.headers[OUTCOME], reply.headers[REUSED])
        messages += [{"role": "assistant", "content": reply.text},
                     {"role": "user", "content": words(model_dir, 60 + 20 * turn, 313 + turn)}]
    assert reply.headers[OUTCOME] == "hit" and int(reply.headers[REUSED]) > 0
    assert metric(prefill, "vllm:turnkv_inline_plans_total", reason="inline") - inline_before >= 3
