"""Which cross-stack exports a change of the deployment would break (pure: synthesized templates in, problems out).

CloudFormation refuses to change or delete an output another stack imports ("Export ... cannot be updated as it
is in use by ..."; https://docs.aws.amazon.com/AWSCloudFormation/latest/UserGuide/using-cfn-stack-exports.html).
So between the templates of a deployed config and of the config after a change, every export some stack imports
now must still exist with the same value, and every resource that value names must keep its type and properties
(a changed property may replace the resource, which changes its id, ARN or name under the same expression).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

Templates = Mapping[str, Mapping[str, Any]]  # stack name -> template


def _walk(node: Any) -> Iterator[Mapping[str, Any]]:
    if isinstance(node, Mapping):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def imported(templates: Templates) -> dict[str, set[str]]:
    """Export name -> the stacks that import it (``Fn::ImportValue`` of a literal name, as CDK writes it)."""
    out: dict[str, set[str]] = {}
    for stack, template in templates.items():
        for node in _walk(template):
            name = node.get("Fn::ImportValue")
            if isinstance(name, str):
                out.setdefault(name, set()).add(stack)
    return out


def exported(templates: Templates) -> dict[str, tuple[str, Any]]:
    """Export name -> (the exporting stack, the output's value expression)."""
    return {output["Export"]["Name"]: (stack, output["Value"])
            for stack, template in templates.items()
            for output in template.get("Outputs", {}).values() if "Export" in output}


def referenced(value: Any) -> set[str]:
    """Logical ids an output's value names (``Ref`` and ``Fn::GetAtt``; pseudo parameters left out)."""
    ids: set[str] = set()
    for node in _walk(value):
        ref = node.get("Ref")
        if isinstance(ref, str) and not ref.startswith("AWS::"):
            ids.add(ref)
        att = node.get("Fn::GetAtt")
        if isinstance(att, list) and att and isinstance(att[0], str):
            ids.add(att[0])
        elif isinstance(att, str):
            ids.add(att.split(".", 1)[0])
    return ids


def broken_imports(before: Templates, after: Templates) -> list[str]:
    """What the change from ``before`` to ``after`` does to an export that a ``before`` stack imports, one line
    each (empty: CloudFormation takes the change as far as exports go)."""
    problems: list[str] = []
    old, new = exported(before), exported(after)
    for name, importers in sorted(imported(before).items()):
        if name not in old:
            continue  # imported from outside the app
        stack, value = old[name]
        who = ", ".join(sorted(importers))
        if name not in new:
            problems.append(f"{name} (from {stack}, imported by {who}): removed")
            continue
        if new[name] != (stack, value):
            problems.append(f"{name} (from {stack}, imported by {who}): value {value} -> {new[name][1]}")
            continue
        resources_before = before[stack].get("Resources", {})
        resources_after = after[stack].get("Resources", {})
        for logical in sorted(referenced(value)):
            was, now = resources_before.get(logical), resources_after.get(logical)
            if was is None:
                continue  # a parameter
            if now is None or (was.get("Type"), was.get("Properties")) != (now.get("Type"), now.get("Properties")):
                problems.append(f"{name} (from {stack}, imported by {who}): {logical} ({was.get('Type')}) changes, "
                                "and a replaced resource changes the exported value")
    return problems
