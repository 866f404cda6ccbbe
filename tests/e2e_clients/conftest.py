"""One real stack (1 prefill + 1 decode vLLM CPU engine and the router, two tenants' API keys) for both modules
of this package: each boot costs ~30-60 s of the suite, and the modules' conversations never share content.
The engines take the union of what the modules need: request chat templates (a template that renders tool
calls, one that drops reasoning) and a tool parser (vLLM 0.32 serves a forced tool choice only with one
enabled; any parser: the forced call is structured output, the parser reads nothing). Ports 21000 (router),
21100/21200 (engines), 22600+ (NIXL), below Linux's ephemeral range (32768+)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.client import engine_stack
from tests.e2e_clients import ACME, GLOBEX
from turnkv.local.stack import StackConfig

STATE = Path(__file__).resolve().parents[2] / ".turnkv" / "e2e-clients"


@pytest.fixture(scope="package")
def stack():
    STATE.mkdir(parents=True, exist_ok=True)
    keys = STATE / "api-keys"
    keys.write_text(f"acme:{ACME}\nglobex:{GLOBEX}\n")
    config = StackConfig(state_dir=STATE, router_port=21000, prefill_port=21100, decode_port=21200,
                         side_channel_base=22600, kv_cache_gib=1,
                         tunables={"decoder_kv_blocks_ttl": 60, "conversation_ttl": 45},
                         engine_extra_args=("--trust-request-chat-template", "--enable-auto-tool-choice",
                                            "--tool-call-parser", "pythonic"),
                         router_args=("--api-keys-file", str(keys)))
    with engine_stack(config) as running:
        yield running
