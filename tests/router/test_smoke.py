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


def _turn(index: int, outcome: str, pulled: int, cached: int) -> smoke.PlayedTurn:
    off = smoke.TimedReply("same", 10.0, "disabled", 0)
    return smoke.PlayedTurn(index, off, smoke.TimedReply("same", 5.0, outcome, pulled, cached))


def test_a_turn_reuses_by_a_pull_or_by_prefills_prefix_cache_after_a_replay():
    """Issue #49: with prefill's prefix cache on (as deployed), a healthy turn 2+ may find the history there and
    recompute only the previous answer (`recompute`, prefill-cached tokens > 0): reuse, said as such, not a failure.
    `recompute` with nothing cached is a refused or failed pull; `miss` is nothing retained: each names what it saw."""
    assert smoke.check_turn(_turn(2, "hit", 120, 300)) is None and _turn(2, "hit", 120, 300).reuse == smoke.PULLED
    assert smoke.check_turn(_turn(2, "recompute", 0, 300)) is None
    assert _turn(2, "recompute", 0, 300).reuse == smoke.CACHED
    refused = smoke.check_turn(_turn(2, "recompute", 0, 0))
    assert refused.startswith("turn 2: no KV reuse (0 tokens pulled from decode, 0 found in prefill's prefix cache)")
    assert "offer secret" in refused
    missed = smoke.check_turn(_turn(3, "miss", 0, 250))
    assert "250 found in prefill's prefix cache); router outcome 'miss'" in missed and "retained_kv_share" in missed
    assert smoke.check_turn(_turn(1, "none", 0, 0)) is None  # turn 1 has nothing to reuse
    both = smoke.SmokeResult("u", turns=[_turn(1, "none", 0, 0), _turn(2, "hit", 120, 10), _turn(3, "recompute", 0, 9)])
    assert smoke.passed_line(both).startswith("turns 2-3 reused KV: 1 pulled decode's retained KV (120 tokens); 1 "
                                              "replayed decode's turn")
    cached = smoke.SmokeResult("u", turns=[_turn(1, "none", 0, 0), _turn(2, "recompute", 0, 9)])
    assert "No turn pulled from decode here" in smoke.passed_line(cached)


async def test_the_reuse_off_requests_carry_a_salt_of_their_own(monkeypatch):
    """The reuse-off request of a turn must not fill the prefix cache its reuse-on request reads (issue #49)."""
    bodies = []
    async with router_over(engines(1, "prefill", **GREEDY), engines(1, "decode", **GREEDY)) as (s, _):
        real = smoke._chat

        async def spy(*args, **kw):
            bodies.append((args[5], kw.get("salt")))
            return await real(*args, **kw)

        monkeypatch.setattr(smoke, "_chat", spy)
        result = await _run(s, model="tiny", turns=2)
    assert result.ok, result.failure
    assert [reuse for reuse, _ in bodies] == [False, True, False, True]
    salts = [salt for reuse, salt in bodies if not reuse]
    assert salts[0] and salts[0] == salts[1] and all(salt is None for reuse, salt in bodies if reuse)


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
    from tests.conftest import free_port

    done = CliRunner().invoke(app, ["smoke", "--url", f"http://127.0.0.1:{free_port()}", "--timeout", "5"])
    assert done.exit_code == 1 and "cannot reach" in done.output


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


def test_bad_arguments_exit_2_before_any_request():
    """Like every other command: a refused argument is exit 2 with the fix (it was exit 1, and --turns 0 played all
    four turns); the help names the real range."""
    runner = CliRunner()
    for args, reason in ((["--url", "http://127.0.0.1:9", "--turns", "0"], "--turns 0: play 2 .. 4"),
                         (["--url", "http://127.0.0.1:9", "--turns", "9"], "--turns 9: play 2 .. 4"),
                         (["--url", "my-alb"], "is not an http(s) URL")):
        done = runner.invoke(app, ["smoke", *args])
        assert done.exit_code == 2 and reason in " ".join(done.output.split()), (args, done.output)
    import re

    help_text = re.sub(r"[│╭╮╰╯─]", " ", runner.invoke(app, ["smoke", "--help"]).output)
    assert f"2 .. {len(smoke.PROMPTS)}" in " ".join(help_text.split())


async def test_a_certificate_for_another_name_is_explained(tmp_path):
    """`turnkv smoke --url https://<ALB DNS name>`: the ALB serves a certificate for the user's domain, so the check
    fails; the failure says why and what to pass. --insecure skips the check knowingly."""
    import asyncio
    import ssl
    import subprocess

    from aiohttp import web

    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=llm.example.com", "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    app_ = web.Application()
    app_.router.add_get("/v1/models", lambda request: web.json_response({"data": []}))
    runner = web.AppRunner(app_)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        checked = await smoke.run(f"https://127.0.0.1:{port}", timeout_s=10)
        assert "the TLS certificate does not match" in checked.failure and "--insecure" in checked.failure
        unchecked = await smoke.run(f"https://127.0.0.1:{port}", timeout_s=10, verify_tls=False)
        assert "certificate" not in unchecked.failure  # it got through TLS (and then found no model)
    finally:
        await runner.cleanup()
        await asyncio.sleep(0)
