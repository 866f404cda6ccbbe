"""Every `turnkv ...` command line in the README, and in the code blocks of docs/*.md, parses as written (issue #28):
the sub-commands exist, the flags exist and take the values given, required options are there, no `[option]` or
`a|b` grammar. Parsed only (click's make_context, which checks all
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


def command_lines(markdown: str, prose: bool = True) -> list[str]:
    """`turnkv ...` lines of the fenced blocks that are not code in a language (shell blocks), comments cut, lines
    ending in `\\` joined with the next. In a block with `$ ` prompts (a console transcript) only the prompted lines
    are commands, the rest is output. With ``prose``, also the commands quoted in the text."""
    lines: list[str] = []
    blocks: list[list[str]] = []
    fence = None
    for raw in markdown.splitlines():
        stripped = raw.strip()
        if stripped.startswith("```"):
            if fence is None:
                fence = stripped[3:].strip()
                blocks.append([])
            else:
                fence = None
            continue
        if fence in ("", "bash", "sh", "console", "shell"):
            blocks[-1].append(stripped)
    for block in blocks:
        transcript = any(line.startswith("$ ") for line in block)
        joined, pending = [], ""
        for line in block:
            line = pending + line
            if line.endswith("\\"):
                pending = line[:-1].rstrip() + " "
                continue
            pending = ""
            joined.append(line)
        for line in joined:
            if transcript and not line.startswith("$ "):
                continue
            if re.match(r"^\$?\s*turnkv\s", line):
                line = line.lstrip("$ ").strip()
                lines.append(re.sub(r"\s+#.*$", "", line))
    if prose:  # the commands quoted in the prose
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
DOCS_LINES = [
    pytest.param(line, id=f"{path.name}: {line}")
    for path in sorted((ROOT / "docs").glob("*.md"))
    for line in command_lines(path.read_text(), prose=False)
]


def check(line: str, monkeypatch) -> None:
    for var in ("TURNKV_DEPLOYMENT", "AWS_REGION"):  # the docs must not lean on the reader's environment
        monkeypatch.delenv(var, raising=False)
    argv = shlex.split(line)[1:]
    try:
        parse(argv)
    except typer.Exit:
        pass
    except cx.UsageError as exc:
        pytest.fail(f"{line!r}: {exc.format_message()}")


def test_the_readme_has_command_lines():
    assert len(README_LINES) >= 10, README_LINES


def test_the_docs_have_command_lines():
    assert len(DOCS_LINES) >= 20, DOCS_LINES


@pytest.mark.parametrize("line", README_LINES)
def test_readme_command_parses_as_written(line, monkeypatch):
    check(line, monkeypatch)


@pytest.mark.parametrize("line", DOCS_LINES)
def test_docs_command_parses_as_written(line, monkeypatch):
    check(line, monkeypatch)


def test_blocks_are_read_as_commands():
    text = (
        "```\n$ turnkv plan --model m \\\n    --tp 1\nturnkv plan \u2014 output\n```\n"
        "```python\nturnkv x\n```\n`turnkv y`\n"
    )
    assert command_lines(text, prose=False) == ["turnkv plan --model m --tp 1"]
    assert command_lines(text) == ["turnkv plan --model m --tp 1", "turnkv y"]


def test_a_broken_line_is_caught():
    with pytest.raises(cx.UsageError):
        parse(["params", "list"])  # --deployment is required
    with pytest.raises(cx.UsageError):
        parse(["local", "up", "--nope"])
