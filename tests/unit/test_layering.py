"""The CLI sits on top: no module outside ``turnkv/cli.py`` and ``turnkv/commands/`` imports ``turnkv.commands``.

Libraries (``turnkv/local/``, ``turnkv/engine_run.py``, ``turnkv/plan/``, ...), the router, the connector, infra,
bench and the AMI recipes hold the logic; a command is a thin wrapper over them. An import from below makes the
library depend on typer options and on whatever the command imports, and hides logic where nothing else can reuse
it. Every ``.py`` file is parsed (imports inside functions count too, and ``importlib.import_module`` /
``__import__`` with a literal name).
"""

from __future__ import annotations

import ast

import pytest

from tests.sources import python_files, relative

CLI = "turnkv.commands"
#: The CLI itself: the entry point and the sub-apps.
ALLOWED = ("turnkv/cli.py", "turnkv/commands/")


def _module_name(rel: str) -> str:
    parts = rel.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a (possibly relative) ``from ... import`` names."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _is_cli(name: str) -> bool:
    return name == CLI or name.startswith(CLI + ".")


def cli_imports(source: str, rel: str) -> list[tuple[int, str]]:
    """(line, imported name) for every import of turnkv.commands in the source of the file at ``rel``."""
    module, is_package = _module_name(rel), rel.endswith("__init__.py")
    found = []
    for node in ast.walk(ast.parse(source, filename=rel)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if _is_cli(a.name)]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, module, is_package)
            names = [base] + [f"{base}.{a.name}" for a in node.names]
            found += [(node.lineno, n) for n in names if _is_cli(n)][:1]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            target = node.args[0].value
            if called in ("import_module", "__import__") and isinstance(target, str) and _is_cli(target):
                found.append((node.lineno, target))
    return found


def test_only_the_cli_imports_the_commands():
    files = python_files()
    assert len(files) > 100, "the scan found too few files: the package list or the repository root is off"
    offenders = []
    for path in files:
        rel = relative(path)
        if rel == ALLOWED[0] or rel.startswith(ALLOWED[1]):
            continue
        offenders += [f"{rel}:{line}: imports {name}" for line, name in cli_imports(path.read_text(), rel)]
    assert not offenders, ("modules below the CLI import turnkv.commands (move the logic into a library module "
                           "and import that):\n" + "\n".join(offenders))


@pytest.mark.parametrize(("source", "rel"), [
    ("from turnkv.commands.local import start_stack\n", "bench/x.py"),
    ("import turnkv.commands.engine\n", "infra/x.py"),
    ("from turnkv.commands import engine as engine_command\n", "infra/x.py"),
    ("from turnkv import commands\n", "router/x.py"),
    ("def f():\n    from turnkv.commands.plan import DEFAULT_WORKLOAD\n", "turnkv/plan/x.py"),
    ("from ..commands import local\n", "turnkv/plan/x.py"),
    ("from .commands.engine import run\n", "turnkv/x.py"),
    ("from . import commands\n", "turnkv/__init__.py"),
    ("import importlib\nimportlib.import_module('turnkv.commands.engine')\n", "ami/x.py"),
    ("__import__('turnkv.commands.engine', fromlist=['x'])\n", "bench/x.py"),
])
def test_the_rule_sees_every_spelling_of_the_import(source, rel):
    assert cli_imports(source, rel), source


@pytest.mark.parametrize(("source", "rel"), [
    ("from turnkv.local.start import start_stack\n", "bench/x.py"),
    ("import turnkv.commandsx\n", "bench/x.py"),
    ("from turnkv import engine_run, params\n", "infra/x.py"),
    ("from .local import commands\n", "turnkv/x.py"),  # turnkv.local.commands: not the CLI
    ("x = 'turnkv.commands.engine'\n", "bench/x.py"),  # a string that is not imported
])
def test_the_rule_passes_other_imports(source, rel):
    assert not cli_imports(source, rel), source
