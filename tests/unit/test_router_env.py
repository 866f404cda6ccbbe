"""The router's ports and environment variable names are written once, in ``turnkv/router_env.py``.

The router reads them, the CDK stack and the local stack give them, bench and the CLI default to them: a second
spelling drifts (a renamed variable the container still sets under the old name, a port the health check misses).
"""

from __future__ import annotations

import ast
import dataclasses
import re

from router.config import API_KEYS_ENV, DEPLOYMENT_ENV, KEY_SECRET_ENV, RouterConfig
from router.state import valkey
from tests.sources import REPO, python_files, relative
from turnkv import node_env, router_env
from turnkv.local.stack import StackConfig

#: Where the names and numbers are defined (router_env reuses node_env's deployment and wire's offer secret).
DEFINED_IN = {"turnkv/router_env.py", "turnkv/node_env.py", "turnkv/wire.py"}
NAMES = {v for k, v in vars(router_env).items() if k.isupper() and isinstance(v, str) and v.startswith("TURNKV_")}
PORTS = {router_env.PORT, router_env.LOCAL_PREFILL_PORT, router_env.LOCAL_DECODE_PORT,
         router_env.LOCAL_SIDE_CHANNEL_BASE}


def _sources():
    for path in python_files():
        rel = relative(path)
        if rel not in DEFINED_IN:
            yield rel, ast.parse(path.read_text(), filename=rel)


def _defaults(tree: ast.AST):
    """The values a module sets or defaults to: assignments, parameter defaults, ``default=`` keywords."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            yield node.value
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from (d for d in [*node.args.defaults, *node.args.kw_defaults] if d is not None)
        elif isinstance(node, ast.keyword) and node.arg in ("default", "port", "envvar"):
            yield node.value


def test_the_router_reads_the_names_the_stack_sets():
    assert (valkey.USERNAME_ENV, valkey.PASSWORD_ENV) == (router_env.STORE_USERNAME, router_env.STORE_PASSWORD)
    assert (API_KEYS_ENV, KEY_SECRET_ENV, DEPLOYMENT_ENV) == (router_env.API_KEYS, router_env.KEY_SECRET,
                                                              router_env.DEPLOYMENT)
    assert router_env.DEPLOYMENT == node_env.DEPLOYMENT == "TURNKV_DEPLOYMENT"
    port = next(f.default for f in dataclasses.fields(RouterConfig) if f.name == "port")
    assert port == StackConfig().router_port == router_env.PORT
    stack = StackConfig()
    assert (stack.prefill_port, stack.decode_port, stack.side_channel_base) == (
        router_env.LOCAL_PREFILL_PORT, router_env.LOCAL_DECODE_PORT, router_env.LOCAL_SIDE_CHANNEL_BASE)


def test_each_variable_name_is_spelled_once():
    assert {"TURNKV_STORE_USERNAME", "TURNKV_STORE_PASSWORD", "TURNKV_DEPLOYMENT", "TURNKV_API_KEYS"} <= NAMES
    found = [f"{rel}:{node.lineno}: {node.value!r}" for rel, tree in _sources() for node in ast.walk(tree)
             if isinstance(node, ast.Constant) and node.value in NAMES]
    assert not found, "import the name from turnkv.router_env instead:\n" + "\n".join(found)


def test_each_port_default_is_written_once():
    found = []
    for rel, tree in _sources():
        for value in _defaults(tree):
            if isinstance(value, ast.Constant) and type(value.value) is int and value.value in PORTS:
                found.append(f"{rel}:{value.lineno}: {value.value}")
            elif isinstance(value, ast.Constant) and value.value == router_env.LOCAL_URL:
                found.append(f"{rel}:{value.lineno}: {value.value!r}")
    assert not found, "default to the constant of turnkv.router_env instead:\n" + "\n".join(found)


def test_the_image_listens_and_checks_health_on_the_router_port():
    dockerfile = (REPO / "router/Dockerfile").read_text()
    ports = re.findall(r"EXPOSE (\d+)|127\.0\.0\.1:(\d+)/health|\"--port\", \"(\d+)\"", dockerfile)
    assert len(ports) == 3 and {int("".join(p)) for p in ports} == {router_env.PORT}
