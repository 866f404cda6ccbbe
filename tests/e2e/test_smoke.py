"""`turnkv smoke` against the real local stack (1 prefill + 1 decode vLLM CPU engine, the package's open router):
what a deploy's last step runs against the ALB. Written for the lead engineer's e2e run; not run in CI time."""

from __future__ import annotations

import asyncio

import pytest
from typer.testing import CliRunner

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
    assert "TTFT reuse on (ms)" in done.output and "smoke test passed" in done.output
