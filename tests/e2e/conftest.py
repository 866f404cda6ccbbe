"""One real local stack for the whole package: 1 prefill + 1 decode vLLM CPU engine and three routers over them.

An engine boot is the costly part of the suite (~25 s of CPU each on the 2-core machine); a router starts in a
second. So the package boots the engines once and serves each router configuration its modules need (a module
names its router in ``ROUTER``; ``stack["router"]`` is that one):
- ``router`` (18000): open (no API keys), the stack's tunables: the connector's pull path, token proofs, signed
  offers, engine controls, the planner's calibration;
- ``router-keyed`` (18010): two tenants' API keys (``ACME``, ``GLOBEX``): the unmodified openai and anthropic
  SDKs;
- ``router-evict`` (18020): a short replay window and a fast evictions feed: decode's retention eviction.

The engines take the union of what the modules need: request chat templates (the token-proof tests render past
turns differently; a template that renders tool calls, one that drops reasoning) and a tool parser (vLLM serves
a forced tool choice only with one enabled; any parser: the forced call is structured output). 1 GiB of KV
cache: 1,024 blocks, which the retention test's share is computed from. The modules' conversations never share
content (distinct word seeds per module). Ports below Linux's ephemeral range (32768+).

Package scope: the stack stops when tests/e2e is done, before tests/e2e_push starts its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from connector import seals
from tests.e2e import ACME, GLOBEX, TUNABLES
from tests.e2e.client import engine_stack
from turnkv.local.stack import ExtraRouter, StackConfig

ROOT = Path(__file__).resolve().parents[2]
STATE_DIR = ROOT / ".turnkv" / "e2e"  # models stay cached between runs; logs are kept for failures
#: Where tests/e2e/test_kv_seals.py switches a READ fault on in the running engines (connector.seals; empty: none).
READ_FAULT = STATE_DIR / "read-fault"
#: The retention test's router: it must see decode's evictions within its replay window (the catalog's rule:
#: retention_eviction_grace >= replay_window + 2 x evictions_interval + 1 + expiry_skew_margin).
EVICT_ROUTER = {"replay_window": 3, "evictions_interval": 0.2}


@pytest.fixture(scope="package")
def shared_stack():
    """The engines and the three routers; modules take ``stack``."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    keys = STATE_DIR / "api-keys"
    keys.write_text(f"acme:{ACME}\nglobex:{GLOBEX}\n")
    (STATE_DIR / "tunables.json").unlink(missing_ok=True)  # what a test of an earlier run left hot-reloaded
    READ_FAULT.write_text("")
    faults = pytest.MonkeyPatch()
    faults.setenv(seals.FAULT_FILE_ENV, str(READ_FAULT))  # the engines inherit it
    config = StackConfig(
        prefill_prefix_caching=False,  # the seeds' setting: reuse is measured against prefill recomputing
        state_dir=STATE_DIR, router_port=18000, prefill_port=18100, decode_port=18200, side_channel_base=15600,
        kv_cache_gib=1,
        tunables=TUNABLES,
        engine_extra_args=("--trust-request-chat-template", "--enable-auto-tool-choice",
                           "--tool-call-parser", "pythonic"),
        extra_routers=(ExtraRouter("router-keyed", 18010, ("--api-keys-file", str(keys))),
                       ExtraRouter("router-evict", 18020, tunables=EVICT_ROUTER)),
    )
    try:
        with engine_stack(config) as running:
            yield running
    finally:
        faults.undo()


@pytest.fixture(scope="module")
def stack(request, shared_stack):
    """The package stack as a module sees it: ``router`` is the router its ``ROUTER`` names (the open one if none)."""
    return {**shared_stack, "router": shared_stack[getattr(request.module, "ROUTER", "router")]}


#: Modules that run before every other module of the package, in this order (pytest's is by file name otherwise).
FIRST = ("test_retention_eviction.py", "test_host_tier.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Move FIRST's tests ahead of the package's other tests (not of the session's: the stack would boot twice).
    The retention test needs a decode engine that holds no other module's turns: with a 1% share, turns other
    modules left would take the room its own turns are tested in until their eviction grace is over."""
    here = Path(__file__).parent
    first = sorted((item for item in items if item.path.parent == here and item.path.name in FIRST),
                   key=lambda item: FIRST.index(item.path.name))  # FIRST's order, not the file names'
    rest = [item for item in items if item not in first]
    ours = [i for i, item in enumerate(rest) if item.path.parent == here]
    if first and ours:
        items[:] = rest[:ours[0]] + first + rest[ours[0]:]
