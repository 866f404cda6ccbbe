"""A catalog default is written once, in ``turnkv/params.py``: nowhere else is it retyped as a literal.

For every tunable whose default is distinctive (not 0 or 1, which are everywhere), the source of router/,
connector/, infra/, bench/, turnkv/ and ami/ is parsed and these spellings of that tunable's name with that default
fail the test, naming file:line:

- ``name=<literal>`` (a keyword argument or a parameter default), ``name: type = <literal>``, ``name = <literal>``;
- ``"name": <literal>`` (a dict entry);
- ``f("name", <literal>)`` (``tunables.get("slow_start", 30)``: a fallback retyped at the call site);
- a parameter whose annotation names the tunable (``ttl: Annotated[float, typer.Option(help="decoder_kv_blocks_ttl
  (s).")] = 480``).

Literals are numbers, including constant arithmetic such as ``256 * 1024 * 1024``. Read the value instead:
``params.get(name).default`` or ``params.value(tunables, name)``. A copy under another name with no mention of the
tunable (``expiry_ttl: float = 480.0``) is out of this test's reach.
"""

from __future__ import annotations

import ast

import pytest

from tests.sources import python_files, relative
from turnkv import params

CATALOG_FILE = "turnkv/params.py"
#: Values too common to mean the tunable.
TRIVIAL = (0, 1)
DISTINCTIVE = {t.name: t.default for t in params.CATALOG if t.default not in TRIVIAL}


def number(node: ast.AST | None) -> int | float | None:
    """The value of a numeric literal (or constant arithmetic of them); None for anything else."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = number(node.operand)
        return None if inner is None else -inner
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
        left, right = number(node.left), number(node.right)
        if left is None or right is None:
            return None
        return left + right if isinstance(node.op, ast.Add) else left - right if isinstance(node.op, ast.Sub) \
            else left * right
    return None


def _named_values(node: ast.AST, source: str):
    """(name, value node) pairs a node binds or passes, in the spellings the module docstring lists."""
    if isinstance(node, ast.keyword) and node.arg:
        yield node.arg, node.value
    elif isinstance(node, ast.Dict):
        for key, value in zip(node.keys, node.values, strict=True):
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                yield key.value, value
    elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
        for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
            if isinstance(target, (ast.Name, ast.Attribute)):
                yield (target.id if isinstance(target, ast.Name) else target.attr), node.value
    elif isinstance(node, ast.Call) and len(node.args) >= 2:
        if isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            yield node.args[0].value, node.args[1]
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        args = node.args
        positional = [*args.posonlyargs, *args.args]
        pairs = [*zip(positional[len(positional) - len(args.defaults):], args.defaults, strict=True),
                 *((a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None)]
        for arg, default in pairs:
            yield arg.arg, default
            if arg.annotation is not None:  # the tunable named in the annotation (a typer option's help)
                text = ast.get_source_segment(source, arg.annotation) or ""
                yield from ((name, default) for name in DISTINCTIVE if name in text and name != arg.arg)


def retyped_defaults(source: str, rel: str) -> list[str]:
    """``file:line: name = value`` for every catalog default retyped in the source of the file at ``rel``."""
    found = []
    for node in ast.walk(ast.parse(source, filename=rel)):
        for name, value in _named_values(node, source):
            key = name.lstrip("_").lower()
            if key in DISTINCTIVE and number(value) is not None and number(value) == DISTINCTIVE[key]:
                found.append(f"{rel}:{value.lineno}: {name} = {ast.get_source_segment(source, value)} "
                             f"(the catalog's default of {key})")
    return found


def test_no_catalog_default_is_retyped():
    assert len(DISTINCTIVE) > 30, "the catalog lost most of its distinctive defaults: is TRIVIAL too wide?"
    found = []
    for path in python_files():
        rel = relative(path)
        if rel != CATALOG_FILE:
            found += retyped_defaults(path.read_text(), rel)
    assert not found, ("catalog defaults retyped as literals; read them from turnkv.params (params.get(name).default "
                       "or params.value(tunables, name)):\n" + "\n".join(found))


@pytest.mark.parametrize("source", [
    "def f(slow_start=30): ...\n",
    "def f(*, tokens_per_request: int = 2048): ...\n",
    "f(decoder_kv_blocks_ttl=480)\n",
    "x = {'conversation_ttl': 450}\n",
    "class C:\n    max_store_bytes: int = 256 * 1024 * 1024\n",
    "MAX_INFLIGHT = 4096\n",
    "self.affinity_slack = 4\n",
    "per = float(tunables.get('tokens_per_request', 2048))\n",
    "ok = engine.failures >= self._t('return_successes', 2)\n",
    "def plan(ttl: Annotated[float, typer.Option(help='decoder_kv_blocks_ttl (s).')] = 480): ...\n",
    "share = {'retained_kv_share': 0.5}\n",
    "router_request_rate = 5000\n",  # an int for a float default: the same value
])
def test_the_rule_sees_each_spelling(source):
    assert retyped_defaults(source, "x.py"), source


@pytest.mark.parametrize("source", [
    "def f(slow_start=params.get('slow_start').default): ...\n",
    "f(decoder_kv_blocks_ttl=60)\n",  # another value: a deliberate choice, not a copy
    "x = {'conversation_ttl': ttl - margin}\n",
    "per = float(params.value(tunables, 'tokens_per_request'))\n",
    "eject_failures = 1\n",  # trivial: 0 and 1 are not checked
    "retries = 2\n",  # another name
    "f('slow_start', '30')\n",  # a string, not a number
    "flag = {'affinity_slack': True}\n",
])
def test_the_rule_passes_other_code(source):
    assert not retyped_defaults(source, "x.py"), source


def test_every_reloadable_tunable_has_one_place_on_the_scheduler_and_nothing_else_is_reloaded():
    """The catalog's ``reloadable`` flag drives the connector's reload: the tunables file reads exactly those, and the
    scheduler applies each to one attribute (a new reloadable tunable without a home fails here)."""
    pytest.importorskip("vllm")
    from connector import tunables
    from connector.scheduler import RELOADED_INTO

    assert set(tunables.RELOADABLE) == set(RELOADED_INTO)
    assert all(params.BY_NAME[name].scope is params.Scope.ENGINE for name in tunables.RELOADABLE)
