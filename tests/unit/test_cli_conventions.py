"""The command line's conventions (issue #28): one flag name per concept with the old names as hidden aliases,
--json output that json.loads reads, and help text that says what it means."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from turnkv.cli import app


def test_local_status_json_lists_every_component(monkeypatch, tmp_path):
    from turnkv.local import stack

    rows = [{"name": "router", "pid": 11, "url": "http://127.0.0.1:8000", "alive": True, "healthy": True,
             "log": tmp_path / "logs" / "router.log"},
            {"name": "decode-0", "pid": 12, "url": "http://127.0.0.1:8200", "alive": False, "healthy": False,
             "log": tmp_path / "logs" / "decode-0.log"}]
    monkeypatch.setattr(stack.Supervisor, "status", lambda self: iter(rows))
    result = CliRunner().invoke(app, ["local", "status", "--json", "--state-dir", str(tmp_path)])
    assert result.exit_code == 1  # decode-0 is down: the exit code says so, as without --json
    listed = json.loads(result.stdout)
    assert [c["name"] for c in listed] == ["router", "decode-0"]
    assert listed[1] == {"name": "decode-0", "pid": 12, "alive": False, "healthy": False,
                         "url": "http://127.0.0.1:8200", "log": str(tmp_path / "logs" / "decode-0.log")}

    monkeypatch.setattr(stack.Supervisor, "status", lambda self: iter(rows[:1]))
    result = CliRunner().invoke(app, ["local", "status", "--json", "--state-dir", str(tmp_path)])
    assert result.exit_code == 0 and json.loads(result.stdout)[0]["healthy"] is True

    monkeypatch.setattr(stack.Supervisor, "status", lambda self: iter(()))
    result = CliRunner().invoke(app, ["local", "status", "--json", "--state-dir", str(tmp_path)])
    assert result.exit_code == 1 and json.loads(result.stdout) == []


def _commands():
    """Every command of the CLI, with its path (``turnkv router serve``)."""
    import typer

    def walk(cmd, path):
        yield path, cmd
        for name, sub in (getattr(cmd, "commands", None) or {}).items():
            yield from walk(sub, f"{path} {name}")

    return list(walk(typer.main.get_command(app), "turnkv"))


def test_no_help_text_holds_what_rich_would_take_for_markup():
    """`[engines]` in a help string is a rich tag: the help printed "Cloud Map service ." without it."""
    import re

    tag = re.compile(r"(?<!\\)\[[a-zA-Z#/@][^\]]*\]")
    found = [(path, getattr(p, "name", "help"), m.group(0))
             for path, cmd in _commands() for p in [cmd, *cmd.params]
             for m in tag.finditer(getattr(p, "help", None) or "")]
    assert not found


def test_router_serve_help_names_every_route_the_router_serves():
    from router.app import build_app
    from router.config import RouterConfig

    routes = build_app(RouterConfig(prefill=["http://127.0.0.1:9"], decode=["http://127.0.0.1:9"],
                                    key_secret=b"k")).router.routes()
    paths = {r.resource.canonical for r in routes if r.method != "HEAD" and "{" not in r.resource.canonical}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/metrics"} <= paths
    serve = dict(_commands())["turnkv router serve"]
    words = set(serve.help.replace(",", " ").replace(")", " ").split())
    assert not paths - words, f"routes missing from `turnkv router serve --help`: {sorted(paths - words)}"
    result = CliRunner().invoke(app, ["router", "serve", "--help"], env={"COLUMNS": "300"})
    assert "Cloud Map service (default engines)." in result.stdout
    assert "every params_refresh seconds (default: on with --discovery cloudmap)" in result.stdout


def _capture_capacity(monkeypatch) -> dict:
    from bench import capacity

    seen: dict = {}

    async def sweep(url, workload, levels, stagger, on_result, **kw):
        seen.update(url=url, levels=levels, **kw)
        return []

    monkeypatch.setattr(capacity, "sweep", sweep)
    monkeypatch.setattr(capacity, "write", lambda levels, out, target, meta: {"levels": levels})
    monkeypatch.setattr(capacity, "markdown", lambda result: "")
    return seen


def test_bench_capacity_reaches_a_keyed_endpoint_with_api_key_and_model(monkeypatch, tmp_path):
    seen = _capture_capacity(monkeypatch)
    result = CliRunner().invoke(app, ["bench", "capacity", "--api-key", "sk-test", "--model", "qwen3",
                                      "--concurrency-levels", "1,2", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert seen["api_key"] == "sk-test" and seen["model"] == "qwen3" and seen["levels"] == [1, 2]
    monkeypatch.setenv("TURNKV_API_KEY", "sk-env")
    assert CliRunner().invoke(app, ["bench", "capacity", "--out", str(tmp_path)]).exit_code == 0
    assert seen["api_key"] == "sk-env" and seen["model"] is None and seen["levels"] == [1, 2, 4, 8, 16]


def test_bench_capacity_levels_is_a_hidden_alias_of_concurrency_levels(monkeypatch, tmp_path):
    seen = _capture_capacity(monkeypatch)
    assert CliRunner().invoke(app, ["bench", "capacity", "--levels", "2,4", "--out", str(tmp_path)]).exit_code == 0
    assert seen["levels"] == [2, 4]
    both = CliRunner().invoke(app, ["bench", "capacity", "--levels", "2,4", "--concurrency-levels", "1",
                                    "--out", str(tmp_path)])
    assert both.exit_code == 2 and "former name of --concurrency-levels" in both.output
    shown = CliRunner().invoke(app, ["bench", "capacity", "--help"], env={"COLUMNS": "300"}).stdout
    assert "--concurrency-levels" in shown and "--levels" not in shown.replace("--concurrency-levels", "")
    assert "--api-key" in shown and "--model" in shown


def test_bench_router_takes_its_list_as_concurrency_levels(monkeypatch):
    from bench import router_peers

    seen: list = []
    monkeypatch.setattr(router_peers, "run", lambda args: seen.append(args.concurrency))
    assert CliRunner().invoke(app, ["bench", "router", "--concurrency-levels", "1,8"]).exit_code == 0
    assert CliRunner().invoke(app, ["bench", "router", "--concurrency", "4,16"]).exit_code == 0  # the old name
    assert seen == ["1,8", "4,16"]
    # one flag, one meaning: --concurrency is an int wherever it shows (bench multiturn), a list is *-levels
    shown = CliRunner().invoke(app, ["bench", "router", "--help"], env={"COLUMNS": "300"}).stdout
    assert "--concurrency-levels" in shown and "--concurrency " not in shown


def _plan(tmp_path, *args: str) -> dict:
    result = CliRunner().invoke(app, ["plan", "--model", "Qwen3-8B", "--json", "--out", str(tmp_path), *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_plan_tensor_parallel_and_ttft_flags_keep_their_former_names(tmp_path):
    new = _plan(tmp_path, "--tensor-parallel-size", "2", "--prefill-tensor-parallel-size", "1",
                "--ttft-target-ms", "300")
    assert new["inputs"]["tp"] == {"prefill": 1, "decode": 2} and new["inputs"]["ttft_target_ms"] == 300
    old = _plan(tmp_path, "--tp", "2", "--tp-prefill", "1", "--ttft-target", "300")
    assert old["inputs"] == new["inputs"]
    assert _plan(tmp_path, "--tp", "2", "--tp-decode", "1")["inputs"]["tp"] == {"prefill": 2, "decode": 1}
    both = CliRunner().invoke(app, ["plan", "--ttft-target", "300", "--ttft-target-ms", "200", "--out",
                                    str(tmp_path)])
    assert both.exit_code == 2 and "former name of --ttft-target-ms" in both.output


def test_help_shows_one_name_per_concept():
    shown = {path: CliRunner().invoke(app, [*path.split()[1:], "--help"], env={"COLUMNS": "300"}).stdout
             for path in ("turnkv plan", "turnkv engine run", "turnkv bench capacity")}
    assert "--tensor-parallel-size" in shown["turnkv plan"] and "--ttft-target-ms" in shown["turnkv plan"]
    assert "--tp-prefill" not in shown["turnkv plan"] and "--ttft-target " not in shown["turnkv plan"]
    assert "--tensor-parallel-size" in shown["turnkv engine run"] and "--tp-size" not in shown["turnkv engine run"]
    assert "--ttft-target-ms" in shown["turnkv bench capacity"]


def test_engine_run_tensor_parallel_size_and_its_former_name(monkeypatch):
    from turnkv.commands import engine

    seen: list[dict] = []

    def prepare(variables, read_text, run, sync=True, flavor=None, source=None):
        seen.append(dict(variables))
        return ["vllm"], {}, []

    monkeypatch.setattr(engine, "prepare", prepare)
    monkeypatch.setattr(engine.os, "execvpe", lambda *a: None)
    for flag in ("--tensor-parallel-size", "--tp", "--tp-size"):
        result = CliRunner().invoke(app, ["engine", "run", flag, "4"])
        assert result.exit_code == 0, result.output
    assert [v["TURNKV_TP_SIZE"] for v in seen] == ["4", "4", "4"]


def test_no_help_cuts_a_name_at_80_columns():
    """Issue #49: at 80 columns typer's help cut option names and defaults ("--engine-port-ba…"); they fold."""
    import click
    import typer
    from typer.testing import CliRunner

    from turnkv.cli import app

    def paths(command: click.Command, prefix: tuple[str, ...] = ()):
        yield prefix
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                yield from paths(sub, (*prefix, name))

    runner = CliRunner()
    cut = {}
    for path in paths(typer.main.get_command(app)):
        done = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "80"})
        assert done.exit_code == 0, (path, done.output)
        if "…" in done.output:
            cut[" ".join(path)] = [line for line in done.output.splitlines() if "…" in line]
    assert cut == {}
