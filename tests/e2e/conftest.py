"""One real local stack (prefill + decode vLLM CPU engines and the router) for the tests of this package.

Package scope: the stack stops when tests/e2e is done, before tests/e2e_router starts its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.client import engine_stack
from turnkv.local.stack import StackConfig

ROOT = Path(__file__).resolve().parents[2]
STATE_DIR = ROOT / ".turnkv" / "e2e"  # models stay cached between runs; logs are kept for failures


@pytest.fixture(scope="package")
def stack():
    config = StackConfig(
        state_dir=STATE_DIR, router_port=18000, prefill_port=18100, decode_port=18200, side_channel_base=15600,
        # A short TTL: a decode engine holding retained blocks keeps a core busy until they expire.
        tunables={"decoder_kv_blocks_ttl": 60, "conversation_ttl": 45},
        # The token-proof tests send a chat template that renders past assistant turns differently.
        engine_extra_args=("--trust-request-chat-template",),
    )
    with engine_stack(config) as running:
        yield running
