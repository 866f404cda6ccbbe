"""Clients of the router (``turnkv/smoke.py``, ``bench/``) read its protocol from ``turnkv.wire``.

Header names and reuse-outcome values are the router's public protocol; a client importing them from
``router.flow`` or ``router.outcomes`` depends on the router's internals, and a client spelling a header as a bare
string is a second definition of it. Every client file is parsed: imports of those modules, and string constants
equal to a header name, are offences (docstrings mention headers inside longer text, so they never match).
"""

from __future__ import annotations

import ast

import pytest

from tests.sources import python_files, relative
from turnkv import wire

CLIENTS = ("turnkv/smoke.py", "turnkv/commands", "bench")
ROUTER_INTERNALS = ("router.flow", "router.outcomes")
HEADERS = {wire.REUSE_HEADER, wire.REUSED_TOKENS_HEADER, wire.PREFILL_CACHED_HEADER, wire.REUSE_OUTCOME_HEADER,
           wire.CONVERSATION_HEADER}


def offences(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module in ROUTER_INTERNALS:
            found.append(f"{node.lineno}: from {node.module} import")
        elif isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if a.name in ROUTER_INTERNALS]
        elif isinstance(node, ast.Constant) and node.value in HEADERS:
            found.append(f"{node.lineno}: {node.value!r}")
    return found


def test_clients_take_the_protocol_from_turnkv_wire():
    files = python_files(CLIENTS)
    assert len(files) > 30, "the scan found too few files"
    bad = [f"{relative(p)}:{o}" for p in files for o in offences(p.read_text())]
    assert not bad, "clients of the router spell its protocol themselves (use turnkv.wire):\n" + "\n".join(bad)


@pytest.mark.parametrize("source", [
    "from router.flow import REUSE_HEADER\n",
    "from router.outcomes import ReuseOutcome\n",
    "import router.flow\n",
    'headers = {"X-TurnKV-Reuse": "off"}\n',
    'resp.headers.get("X-TurnKV-Reused-Tokens")\n',
])
def test_the_rule_sees_an_offence(source):
    assert offences(source)


def test_the_router_serves_the_same_names():
    from router import flow, legs, outcomes

    assert flow.REUSE_OUTCOME_HEADER == wire.REUSE_OUTCOME_HEADER and legs.REQUEST_ID_HEADER == wire.REQUEST_ID_HEADER
    assert outcomes.ReuseOutcome is wire.ReuseOutcome
