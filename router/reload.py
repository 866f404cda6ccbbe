"""Tunables from SSM Parameter Store, re-read while the router runs (``params_refresh``).

``merge`` is pure: each fetched value is parsed against the catalog; a bad one is refused and the
last good value kept; a set that breaks a cross-tunable rule is refused whole. ``SsmSource`` reads
``/turnkv/<deployment>/router/*`` plus the engines' ``decoder_kv_blocks_ttl`` (the router's entries
must expire before it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from turnkv import params

log = logging.getLogger("turnkv.router")

#: Engine-scope tunables the router must know.
ENGINE_NAMES = ("decoder_kv_blocks_ttl",)


def merge(current: Mapping[str, int | float], fetched: Mapping[str, str]) -> tuple[dict[str, int | float], list[str]]:
    """New tunables and the errors (one line per refused value). ``current`` is returned unchanged when
    nothing valid changed."""
    errors: list[str] = []
    changes: dict[str, int | float] = {}
    for name, raw in fetched.items():
        try:
            value = params.get(name).parse(raw)
        except params.ParamError as exc:
            errors.append(f"{exc} (kept {current.get(name)})")
            continue
        if current.get(name) != value:
            changes[name] = value
    if not changes:
        return dict(current), errors
    try:
        return params.validate(changes, current), errors
    except params.ParamError as exc:
        errors.append(f"{exc} (kept all current values)")
        return dict(current), errors


class SsmSource:
    def __init__(self, deployment: str, region: str | None = None, endpoint_url: str | None = None,
                 client: Any = None) -> None:
        if client is None:
            import boto3

            client = boto3.client("ssm", region_name=region, endpoint_url=endpoint_url)
        self.client = client
        self.deployment = deployment

    def _fetch(self) -> dict[str, str]:
        out: dict[str, str] = {}
        prefix = f"{params.SSM_PREFIX}/{self.deployment}/{params.Scope.ROUTER.value}/"
        paginator = self.client.get_paginator("get_parameters_by_path")
        for page in paginator.paginate(Path=prefix, Recursive=False):
            for p in page.get("Parameters", []):
                name = p["Name"].rsplit("/", 1)[-1]
                if name in params.BY_NAME:
                    out[name] = p["Value"]
        names = [params.BY_NAME[n].ssm_path(self.deployment) for n in ENGINE_NAMES]
        for p in self.client.get_parameters(Names=names).get("Parameters", []):
            out[p["Name"].rsplit("/", 1)[-1]] = p["Value"]
        return out

    async def fetch(self) -> dict[str, str]:
        return await asyncio.to_thread(self._fetch)


async def refresh_once(config, source: SsmSource, on_result: Callable[[str], None] = lambda r: None) -> list[str]:
    try:
        fetched = await source.fetch()
    except Exception as exc:
        log.warning("SSM re-read failed (%s); keeping the current tunables", exc)
        on_result("error")
        return [str(exc)]
    new, errors = merge(config.tunables, fetched)
    for e in errors:
        log.warning("SSM tunable refused: %s", e)
    changed = {k: v for k, v in new.items() if config.tunables.get(k) != v}
    if changed:
        log.info("SSM tunables applied: %s", changed)
        config.tunables.update(changed)  # in place: the pool and flow read the same dict
    on_result("refused" if errors else ("applied" if changed else "unchanged"))
    return errors


async def refresh_loop(config, source: SsmSource, on_result: Callable[[str], None] = lambda r: None) -> None:
    """Re-read every ``params_refresh`` seconds (the first read is done before the router serves)."""
    while True:
        await asyncio.sleep(float(config.tunables["params_refresh"]))
        await refresh_once(config, source, on_result)
