"""Tunables in SSM Parameter Store: read, validate, change (recorded) and sync to the node's JSON file.

The logic behind ``turnkv params``; the CDK params stack uses :func:`allowed_pattern` and
:func:`description` so that the parameters it creates and the ones this module writes look the same.
Takes a boto3 SSM client (any endpoint: AWS, or moto in tests); prints nothing.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from turnkv import params

#: SSM limits.
DESCRIPTION_MAX = 1024
LABEL_MAX = 100


def allowed_pattern(tunable: params.Tunable) -> str:
    """A regex SSM enforces on every write: digits of the right length (the catalog checks the exact bounds)."""
    digits = len(str(int(tunable.maximum)))
    if tunable.kind is int:
        return rf"^[0-9]{{1,{digits}}}$"
    return rf"^[0-9]{{1,{digits}}}(\.[0-9]+)?$"


def description(tunable: params.Tunable, note: str | None = None) -> str:
    text = f"{tunable.help} Allowed {tunable.allowed}; default {tunable.default}."
    if note:
        text = f"{text} [{note}]"
    return text[:DESCRIPTION_MAX]


def change_label(who: str, when: datetime) -> str:
    """A parameter-version label naming who changed it and when (SSM: letters, digits, ._- ; not aws/ssm first)."""
    safe_who = re.sub(r"[^A-Za-z0-9_.-]+", "-", who).strip("-.") or "unknown"
    return f"by-{safe_who}-{when.strftime('%Y%m%dT%H%M%SZ')}"[:LABEL_MAX]


@dataclass(frozen=True)
class StoredTunable:
    """One tunable as stored (or not) in SSM."""

    tunable: params.Tunable
    raw: str | None
    version: int | None = None
    modified: datetime | None = None
    error: str | None = None

    @property
    def value(self) -> int | float:
        """The parsed value, the default when the parameter is missing or invalid."""
        if self.raw is None or self.error:
            return self.tunable.default
        return self.tunable.parse(self.raw)


@dataclass(frozen=True)
class Difference:
    """A tunable whose stored value is not what this kit (and the deploy config) would create it with."""

    name: str
    stored: str | None
    default: int | float

    @property
    def reason(self) -> str:
        if self.stored is None:
            return "missing: the next deploy of the params stack creates it with the default"
        return "kept: deploys never overwrite a stored value; `turnkv params set` applies the default"


def differences(entries: Mapping[str, StoredTunable], defaults: Mapping[str, int | float]) -> list[Difference]:
    """The tunables whose stored value differs from ``defaults`` (the deployment's: ``infra.stacks.params.
    deployment_defaults``, or the catalog's), in catalog order. The params stack keeps stored values across
    upgrades (``infra/lambdas/keep_tunables.py``), so a default that changed shows here, never in SSM."""
    out = []
    for name, entry in entries.items():
        default = defaults[name]
        if entry.raw is None or entry.error or entry.value != default:
            out.append(Difference(name, entry.raw, default))
    return out


@dataclass(frozen=True)
class Change:
    name: str
    old: int | float
    new: int | float
    version: int
    label: str


class ParamStore:
    def __init__(self, ssm: Any, deployment: str):
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", deployment):
            raise params.ParamError(f"deployment name {deployment!r}: use letters, digits, '_', '.', '-'")
        self.ssm = ssm
        self.deployment = deployment

    @property
    def prefix(self) -> str:
        return f"{params.SSM_PREFIX}/{self.deployment}"

    def exists(self) -> bool:
        """Whether the deployment has any parameter (its params stack creates every tunable): a typo in the
        deployment name must not silently create a second, unused set of parameters."""
        page = self.ssm.get_parameters_by_path(Path=self.prefix, Recursive=True, MaxResults=10)["Parameters"]
        return any(p["Name"].startswith(f"{self.prefix}/") for p in page)

    def known_deployments(self, limit: int = 50) -> list[str]:
        """Deployments with parameters in this region (from the parameter names), for the refusal message."""
        found: set[str] = set()
        paginator = self.ssm.get_paginator("describe_parameters")
        filters = [{"Key": "Path", "Option": "Recursive", "Values": [params.SSM_PREFIX]}]
        for page in paginator.paginate(ParameterFilters=filters, PaginationConfig={"MaxItems": 500}):
            for p in page["Parameters"]:
                parts = p["Name"].split("/")
                if len(parts) > 2:
                    found.add(parts[2])
            if len(found) >= limit:
                break
        return sorted(found)[:limit]

    def entries(self) -> dict[str, StoredTunable]:
        """Every catalog tunable with its stored value; missing ones carry ``raw=None``."""
        by_path = {t.ssm_path(self.deployment): t for t in params.CATALOG}
        found: dict[str, StoredTunable] = {}
        paginator = self.ssm.get_paginator("get_parameters_by_path")
        for page in paginator.paginate(Path=self.prefix, Recursive=True):
            for p in page["Parameters"]:
                tunable = by_path.get(p["Name"])
                if tunable is None:
                    continue  # e.g. /turnkv/<deployment>/ami/gpu
                error = None
                try:
                    tunable.parse(p["Value"])
                except params.ParamError as exc:
                    error = str(exc)
                found[tunable.name] = StoredTunable(tunable, p["Value"], p.get("Version"), p.get("LastModifiedDate"),
                                                    error)
        return {t.name: found.get(t.name, StoredTunable(t, None)) for t in params.CATALOG}

    def values(self, entries: Mapping[str, StoredTunable] | None = None) -> dict[str, int | float]:
        entries = self.entries() if entries is None else entries
        bad = [e.error for e in entries.values() if e.error]
        if bad:
            raise params.ParamError("; ".join(bad))
        merged = {name: e.value for name, e in entries.items()}
        params.cross_check(merged)
        return merged

    def plan(self, changes: Mapping[str, str]) -> tuple[dict[str, StoredTunable], dict[str, int | float],
                                                         dict[str, object]]:
        """Validate ``changes`` over what is stored; raise ParamError naming the reason. Writes nothing. Returns the
        stored entries, the values after the change, and the changes to write: ``changes`` with conversation_ttl
        lowered to fit a new decoder_kv_blocks_ttl when that is all that changes (``params.fit_router_ttl``)."""
        entries = self.entries()
        current = {name: e.value for name, e in entries.items() if not e.error}
        fitted = params.fit_router_ttl(changes, current)
        return entries, params.validate(fitted, current), fitted

    def set(self, changes: Mapping[str, str], who: str, when: datetime | None = None) -> list[Change]:
        entries, merged, changes = self.plan(changes)
        when = when or datetime.now(UTC)
        label = change_label(who, when)
        done = []
        for name in changes:
            tunable = params.get(name)
            new = merged[name]
            old = entries[name].value
            note = f"set by {who} at {when.strftime('%Y-%m-%dT%H:%M:%SZ')}, was {entries[name].raw or 'unset'}"
            answer = self.ssm.put_parameter(
                Name=tunable.ssm_path(self.deployment), Value=str(new), Type="String", Overwrite=True,
                Description=description(tunable, note), AllowedPattern=allowed_pattern(tunable), Tier="Standard")
            version = int(answer["Version"])
            self.ssm.label_parameter_version(Name=tunable.ssm_path(self.deployment), ParameterVersion=version,
                                             Labels=[label])
            done.append(Change(name, old, new, version, label))
        return done

    def history(self, name: str) -> list[dict[str, Any]]:
        tunable = params.get(name)
        out: list[dict[str, Any]] = []
        paginator = self.ssm.get_paginator("get_parameter_history")
        for page in paginator.paginate(Name=tunable.ssm_path(self.deployment)):
            out.extend(page["Parameters"])
        return out


def engine_file_content(values: Mapping[str, int | float]) -> str:
    """What the connector hot-reloads: engine-scope tunables as sorted JSON."""
    engine = {t.name: values[t.name] for t in params.CATALOG if t.scope is params.Scope.ENGINE}
    return json.dumps(engine, indent=2, sort_keys=True) + "\n"


def write_if_changed(path: Path, text: str) -> bool:
    """Atomic replace (the connector never reads half a file); returns whether the content changed."""
    if path.exists() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def sync(store: ParamStore, out: Path) -> tuple[bool, dict[str, int | float]]:
    """SSM -> JSON file. A bad stored value or cross-check failure raises and leaves the file as it was."""
    values = store.values()
    return write_if_changed(out, engine_file_content(values)), values


def parse_assignments(args: Iterable[str]) -> dict[str, str]:
    """``NAME VALUE`` or ``NAME=VALUE ...`` into a mapping; unknown names raise ParamError."""
    args = list(args)
    if len(args) == 2 and "=" not in args[0]:
        pairs = [(args[0], args[1])]
    else:
        pairs = []
        for arg in args:
            name, sep, value = arg.partition("=")
            if not sep or not value:
                raise params.ParamError(f"{arg!r}: expected NAME=VALUE (or exactly NAME VALUE)")
            pairs.append((name, value))
    if not pairs:
        raise params.ParamError("nothing to set: give NAME VALUE or NAME=VALUE ...")
    out: dict[str, str] = {}
    for name, value in pairs:
        params.get(name)
        out[name] = value
    return out
