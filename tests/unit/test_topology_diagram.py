"""docs/deploy-aws.md's AWS topology picture (Mermaid) is read the way Mermaid reads it, closely enough to catch
what breaks it: an unbalanced ``subgraph``/``end``, a box whose brackets or quotes do not close, an edge to a box
that was never declared (Mermaid draws a stray, unlabelled box for a typo), a line Mermaid would not parse, and a
stack the app builds with no group in the picture (or a group for a stack it does not build).

No renderer here (mermaid-cli needs a browser): a small reader of the flowchart subset the picture uses.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "deploy-aws.md"

#: Box shapes the picture uses: rectangle, rounded (stadium), cylinder, round, rhombus.
_SHAPES = {"[": "]", "([": "])", "[(": ")]", "(": ")", "{": "}"}
_NODE = re.compile(r'^(?P<id>[A-Za-z_]\w*)(?P<open>\(\[|\[\(|\[|\(|\{)"(?P<label>[^"]*)"(?P<close>\]\)|\)\]|\]|\)|\})$')
_SUBGRAPH = re.compile(r'^subgraph (?P<id>[A-Za-z_]\w*)(?:\["(?P<label>[^"]*)"\])?$')
#: Solid, thick and dotted arrows, each with an optional ``|label|``.
_EDGE = re.compile(r"\s*(?:-->|==>|-\.->)(?:\|[^|\"]+\|)?\s*")
_ID = re.compile(r"^[A-Za-z_]\w*$")


class DiagramError(AssertionError):
    pass


@dataclass
class Flowchart:
    nodes: dict[str, str] = field(default_factory=dict)  # id -> label
    groups: dict[str, str] = field(default_factory=dict)  # id -> label
    parent: dict[str, str] = field(default_factory=dict)  # node or group id -> enclosing group id
    edges: list[tuple[str, str]] = field(default_factory=list)


def mermaid_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```mermaid\n(.*?)^```$", markdown, re.M | re.S)


def parse(block: str) -> Flowchart:
    """The flowchart, or DiagramError naming the first line Mermaid would misread."""
    lines = [(n, ln.strip()) for n, ln in enumerate(block.splitlines(), 1) if ln.strip() and
             not ln.strip().startswith("%%")]
    if not lines or not re.match(r"^flowchart (LR|RL|TB|TD|BT)$", lines[0][1]):
        raise DiagramError(f"the block does not start with 'flowchart <direction>': {lines[:1]}")
    chart, stack = Flowchart(), []
    for number, line in lines[1:]:
        where = f"line {number}: {line!r}"
        if m := _SUBGRAPH.match(line):
            gid = m["id"]
            if gid in chart.groups or gid in chart.nodes:
                raise DiagramError(f"{where}: {gid} is declared twice")
            chart.groups[gid] = m["label"] or gid
            if stack:
                chart.parent[gid] = stack[-1]
            stack.append(gid)
        elif line == "end":
            if not stack:
                raise DiagramError(f"{where}: 'end' without a subgraph")
            stack.pop()
        elif re.match(r"^direction (LR|RL|TB|TD|BT)$", line):
            if not stack:
                raise DiagramError(f"{where}: 'direction' outside a subgraph")
        elif m := _NODE.match(line):
            if _SHAPES[m["open"]] != m["close"]:
                raise DiagramError(f"{where}: the box opens with {m['open']} but closes with {m['close']}")
            if m["id"] in chart.nodes or m["id"] in chart.groups:
                raise DiagramError(f"{where}: {m['id']} is declared twice")
            chart.nodes[m["id"]] = m["label"]
            if stack:
                chart.parent[m["id"]] = stack[-1]
        elif _EDGE.search(line):
            ends = _EDGE.split(line)
            for end in ends:
                if not _ID.match(end):
                    raise DiagramError(f"{where}: {end!r} is not a box id (declare boxes on their own lines)")
                if end not in chart.nodes:
                    raise DiagramError(f"{where}: {end} is not declared (Mermaid would draw a stray box)")
            chart.edges += list(pairwise(ends))
        else:
            raise DiagramError(f"{where}: not a box, group, direction or edge")
    if stack:
        raise DiagramError(f"subgraph {stack[-1]} is never closed with 'end'")
    return chart


def _stacks_the_app_builds() -> set[str]:
    """The stack ids infra/app.py builds (``f"{prefix}-<stack>"``), read from its source (no CDK import)."""
    return set(re.findall(r'f"\{prefix\}-(\w+)"', (ROOT / "infra" / "app.py").read_text()))


def _picture() -> str:
    blocks = mermaid_blocks(DOC.read_text())
    assert len(blocks) == 1, "docs/deploy-aws.md holds one topology picture"
    return blocks[0]


def test_the_topology_picture_parses_with_every_edge_between_declared_boxes():
    chart = parse(_picture())
    assert len(chart.nodes) >= 20 and len(chart.edges) >= 20
    connected = {n for edge in chart.edges for n in edge}
    assert {"client", "alb", "router", "prefill", "decode", "cloudmap", "valkey", "ssm"} <= connected
    # Every box but the client lives in a stack's group.
    assert [n for n in chart.nodes if n not in chart.parent] == ["client"]


def test_each_stack_the_app_builds_is_one_group_and_no_other_stack_is_drawn():
    chart = parse(_picture())
    stacks = _stacks_the_app_builds()
    assert stacks == {"network", "params", "image", "serving", "router", "observability"}
    top = {label.split(" ")[0] for gid, label in chart.groups.items() if gid not in chart.parent}
    assert top == {f"turnkv-&lt;name&gt;-{s}" for s in stacks}
    # the engine pools sit in the serving stack's placement group
    for pool in ("prefill", "decode"):
        group = chart.parent[pool]
        assert chart.parent[group] == next(g for g, lbl in chart.groups.items() if lbl.endswith("-serving"))


def test_the_cloud_map_service_named_in_the_picture_is_the_stacks():
    serving = (ROOT / "infra" / "stacks" / "serving.py").read_text()
    service = re.search(r'^CLOUDMAP_SERVICE = "([^"]+)"', serving, re.M).group(1)
    assert f"service {service}" in parse(_picture()).nodes["cloudmap"]


@pytest.mark.parametrize(("broken", "why"), [
    (lambda s: s.replace("  end\n", "", 1), "never closed"),
    (lambda s: s.replace("alb --> router", "alb --> routr"), "routr is not declared"),
    (lambda s: s.replace('valkey[("', 'valkey[(', 1), "not a box"),
    (lambda s: s.replace('as Bearer)"])', 'as Bearer)])', 1), "not a box"),
    (lambda s: s.replace('dash["', 'dash("', 1), "opens with ( but closes with ]"),
    (lambda s: s + "  end\n", "'end' without a subgraph"),
    (lambda s: s.replace("flowchart LR", "flowchart"), "does not start"),
    (lambda s: s.replace('  subgraph obs["', '  subgraph dash["', 1), "declared twice"),
])
def test_a_broken_picture_is_caught(broken, why):
    with pytest.raises(DiagramError, match=re.escape(why)):
        parse(broken(_picture()))
