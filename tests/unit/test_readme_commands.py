"""Every `turnkv ...` command line in the README parses as written (issue #28): the sub-commands exist, the flags
exist and take the values given, required options are there. Parsed only (click's make_context, which checks all
of that without running the command), so nothing needs a server, an engine or AWS."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer

from turnkv.cli import app

try:  # typer >= 0.20 vendors click
    from typer._click import exceptions as cx
except ImportError:  # pragma: no cover
    from click import exceptions as cx

ROOT = Path(__file__).resolve().parents[2]


def command_lines(markdown: str) -> list[str]:
    """`turnkv ...` lines of the fenced blocks that are not code in a language (shell blocks), comments cut."""
    lines, fence = [], None
    for raw in markdown.splitlines():
        stripped = raw.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else stripped[3:].strip()
            continue
        if fence in ("", "bash", "sh", "console", "shell") and re.match(r"^\$?\s*turnkv\s", stripped):
            line = stripped.lstrip("$ ").strip()
            lines.append(re.sub(r"\s+#.*$", "", line))
    # and the commands quoted in the prose
    lines += [m.group(1) for m in re.finditer(r"`(turnkv [^`]+)`", markdown)]
    return list(dict.fromkeys(lines))


def parse(argv: list[str]) -> None:
    """Parse ``argv`` down to the leaf command like click does before invoking it; raise click's usage errors."""
    command = typer.main.get_command(app)
    name, args = "turnkv", argv
    while True:
        ctx = command.make_context(name, list(args))
        if not hasattr(command, "resolve_command"):  # a leaf command: parsed and checked
            return
        protected = getattr(ctx, "_protected_args", None) or getattr(ctx, "protected_args", None) or []
        rest = [*protected, *ctx.args]
        if not rest:
            return
        name, command, args = command.resolve_command(ctx, rest)
        if command is None:
            raise cx.UsageError(f"no command {rest[0]!r}")
        args = list(args)


README_LINES = command_lines((ROOT / "README.md").read_text())


def test_the_readme_has_command_lines():
    assert len(README_LINES) >= 10, README_LINES


@pytest.mark.parametrize("line", README_LINES)
def test_readme_command_parses_as_written(line, monkeypatch):
    for var in ("TURNKV_DEPLOYMENT", "AWS_REGION"):  # the README must not lean on the reader's environment
        monkeypatch.delenv(var, raising=False)
    argv = shlex.split(line)[1:]
    try:
        parse(argv)
    except typer.Exit:
        pass
    except cx.UsageError as exc:
        pytest.fail(f"{line!r}: {exc.format_message()}")


def test_a_broken_line_is_caught():
    with pytest.raises(cx.UsageError):
        parse(["params", "list"])  # --deployment is required
    with pytest.raises(cx.UsageError):
        parse(["local", "up", "--nope"])
