"""The README's "Where to look" table names files and functions that exist (a renamed one fails here, not a
newcomer's search)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: `path/to/file.py` or `path/to/file.py:Name` or `path/to/file.py:Class.method`, in backticks.
PLACE = re.compile(r"`((?:[\w-]+/)*[\w-]+\.py)(?::([\w.]+))?`")
#: `infra/stacks/`: a folder, in backticks.
FOLDER = re.compile(r"`((?:[\w-]+/)+)`")


def _section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Where to look")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def _names(node: ast.stmt) -> set[str]:
    """The names a top-level or class-level statement defines (def, class, assignment)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return {t.id for t in targets if isinstance(t, ast.Name)}


def _defined(tree: ast.Module, dotted: str) -> bool:
    """Whether ``dotted`` (``f``, ``Class``, ``Class.method``, ``CONSTANT``) is defined at that nesting in the file."""
    scope: list[ast.stmt] = tree.body
    for part in dotted.split("."):
        found = next((node for node in scope if part in _names(node)), None)
        if found is None:
            return False
        scope = found.body if isinstance(found, ast.ClassDef) else []
    return True


def test_the_table_answers_eight_questions():
    rows = [line for line in _section().splitlines() if line.startswith("| where ")]
    assert len(rows) == 8, rows
    for row in rows:
        assert PLACE.search(row), f"no file:function in {row!r}"


def test_every_file_and_function_in_the_table_exists():
    section = _section()
    places = PLACE.findall(section)
    assert len(places) >= 16
    for path, name in places:
        file = ROOT / path
        assert file.is_file(), f"{path} (README 'Where to look') does not exist"
        if name:
            assert _defined(ast.parse(file.read_text()), name), f"{path} defines no {name} (README 'Where to look')"
    for folder in FOLDER.findall(section):
        assert (ROOT / folder).is_dir(), f"{folder} (README 'Where to look') does not exist"
