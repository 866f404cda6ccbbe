"""`turnkv smoke` against the real local stack (1 prefill + 1 decode vLLM CPU engine, the package's open router):
what a deploy's last step runs against the ALB. Written for the lead engineer's e2e run; not run in CI time."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from typer.testing import CliRunner

from tests.e2e import STACK_RETENTION, TUNABLES
from tests.e2e.client import metric
from turnkv import smoke
from turnkv.cli import app

pytestmark = pytest.mark.engines


def test_smoke_passes_against_the_local_stack(stack):
    result = asyncio.run(smoke.run(stack["router"], timeout_s=600))
    assert result.ok, result.failure
    assert len(result.turns) == len(smoke.PROMPTS)
    assert all(t.on.outcome == smoke.HIT and t.on.reused_tokens > 0 for t in result.turns[1:])
    assert all(t.matches for t in result.turns)


def test_the_smoke_command_prints_ttft_per_turn_and_exits_0(stack):
    done = CliRunner().invoke(app, ["smoke", "--url", stack["router"], "--turns", "2", "--timeout", "600"],
                             env={"COLUMNS": "200"})  # rich wraps the table's headers at 80 columns
    assert done.exit_code == 0, done.output
    assert "TTFT on ms" in done.output and "smoke test passed" in done.output


def test_the_smoke_command_fails_naming_decodes_room_when_decode_retains_nothing(stack):
    """A stack that cannot reuse (decode retains no turn: no device share, no host budget, hot-reloaded) fails
    the smoke test at turn 2 with exit 1 and a reason that names where to look, and decode counts its refusals."""
    tunables = stack["state_dir"] / "tunables.json"
    refused = metric(stack["decode-0"], "vllm:turnkv_retention_refusals_total")
    tunables.write_text(json.dumps({"retained_kv_share": 0.0, "host_kv_budget_mib": 0,
                                    "decoder_kv_blocks_ttl": TUNABLES["decoder_kv_blocks_ttl"]}))
    time.sleep(1.2)  # the connector re-reads the file at most once a second
    try:
        done = CliRunner().invoke(app, ["smoke", "--url", stack["router"], "--turns", "2", "--timeout", "600"],
                                  env={"COLUMNS": "200"})
    finally:  # the stack's values again (a removed file would leave the engines at the last values they read)
        tunables.write_text(json.dumps(STACK_RETENTION))
        time.sleep(1.2)
    assert done.exit_code == 1, done.output
    assert "turn 2: no KV reuse" in done.output and "retained_kv_share" in done.output, done.output
    assert metric(stack["decode-0"], "vllm:turnkv_retention_refusals_total") > refused
