"""`turnkv smoke` (turnkv.smoke) against the router over fake engines: passing, and failing with its reason."""

from __future__ import annotations

from typer.testing import CliRunner

from tests.router.conftest import engines, router_over
from turnkv import smoke
from turnkv.cli import app

#: Greedy fakes: the same prompt always gets the same answer, as a real engine at temperature 0.
GREEDY = {"request_marker": False}


async def _run(session, **kw) -> smoke.SmokeResult:
    return await smoke.run(str(session._base_url), **kw)


async def test_smoke_passes_when_turns_reuse_kv_and_answers_match():
    async with router_over(engines(1, "prefill", **GREEDY), engines(1, "decode", **GREEDY)) as (s, _):
        result = await _run(s, model="tiny")
    assert result.ok, result.failure
    assert [t.index for t in result.turns] == [1, 2, 3, 4]
    assert all(t.on.outcome == "hit" and t.on.reused_tokens > 0 for t in result.turns[1:])
    assert all(t.off.outcome == "disabled" and t.matches for t in result.turns)
    assert all(t.on.ttft_ms > 0 and t.off.ttft_ms > 0 for t in result.turns)


async def test_smoke_fails_with_its_reason_when_reuse_never_happens():
    # decode keeps no KV for the next turn (bidirectional off): every turn 2+ recomputes
    async with router_over(engines(1, "prefill"), engines(1, "decode", bidirectional=False, **GREEDY)) as (s, _):
        result = await _run(s, model="tiny")
    assert not result.ok
    assert result.failure.startswith("turn 2: no KV reuse"), result.failure
    assert len(result.turns) == 2


async def test_smoke_fails_on_a_wrong_api_key_and_on_an_unreachable_endpoint():
    from router.auth import ApiKeys, parse_keys

    keys = ApiKeys(parse_keys('{"tenants": {"acme": "right-key"}}'))
    async with router_over(engines(1, "prefill"), engines(1, "decode"), keys=keys) as (s, _):
        result = await _run(s, model="tiny", api_key="wrong-key")
    assert result.failure and "HTTP 401" in result.failure and "--api-key" in result.failure
    unreachable = await smoke.run("http://127.0.0.1:9", model="tiny", timeout_s=5)
    assert unreachable.failure.startswith("cannot reach http://127.0.0.1:9")


def test_a_mismatch_names_the_turn_and_where_the_answers_differ():
    off = smoke.TimedReply("the same start, then A", 10.0, "disabled", 0)
    on = smoke.TimedReply("the same start, then B", 5.0, "hit", 120)
    reason = smoke.check_turn(smoke.PlayedTurn(3, off, on))
    assert reason.startswith("turn 3: the answer with reuse differs") and "character 21" in reason


async def test_smoke_fails_when_the_endpoint_is_not_greedy():
    """The default fakes start each reply with the request id: two sends of one prompt differ."""
    async with router_over(engines(1, "prefill"), engines(1, "decode")) as (s, _):
        result = await _run(s, model="tiny")
    assert result.failure.startswith("turn 1: the same request twice gave two answers"), result.failure


def test_the_command_exits_1_with_the_reason():
    done = CliRunner().invoke(app, ["smoke", "--url", "not-a-url"])
    assert done.exit_code == 1 and "is not an http(s) URL" in done.output


async def test_an_endpoint_that_never_answers_is_reported_as_slow_not_unreachable():
    """A timeout is an OSError too: it used to read 'cannot reach' (bench.shapes hit it on a hung engine pair)."""
    import asyncio

    async def hold(reader, writer):
        await asyncio.sleep(30)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        result = await smoke.run(f"http://127.0.0.1:{port}", model="tiny", timeout_s=1)
    finally:
        server.close()
    assert result.failure.startswith("turn 1: no complete answer from"), result.failure
    assert "within the test's 1 s" in result.failure and "--timeout" in result.failure
