"""Engine tunables: start-up values from the engine's KV-transfer config, hot reloads from the file the node's SSM
sync writes.

The file (``TURNKV_TUNABLES_FILE``, default ``/etc/turnkv/tunables.json``) holds engine-scope
tunables of ``turnkv.params`` as JSON. It is re-read when its modification time changes (checked at
most once a second). A bad value is refused with a log line and the last good value stays.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from turnkv import params

logger = logging.getLogger("vllm.turnkv.tunables")

#: The catalog's reloadable tunables (``turnkv.params``: one source).
RELOADABLE = tuple(t.name for t in params.CATALOG if t.reloadable)


def start_values(vllm_config: Any) -> dict[str, int | float]:
    """The reloadable tunables the engine was started with: ``kv_connector_extra_config`` carries every engine
    tunable (``turnkv.engine_args``), so ``turnkv local up --set`` and the node's engine.env reach the connector
    before any tunables file exists. Bad values are refused with a log line (the catalog default stays)."""
    config = getattr(getattr(vllm_config, "kv_transfer_config", None), "kv_connector_extra_config", None) or {}
    values, errors = parse(json.dumps({k: v for k, v in dict(config).items() if k in RELOADABLE}, default=str))
    for error in errors:
        logger.error("turnkv: kv_connector_extra_config: refused %s", error)
    return values


def parse(text: str) -> tuple[dict[str, int | float], list[str]]:
    """Valid reloadable values and the errors for the rest (pure)."""
    try:
        raw = json.loads(text)
    except ValueError as exc:
        return {}, [f"not JSON: {exc}"]
    if not isinstance(raw, dict):
        return {}, ["not a JSON object"]
    values: dict[str, int | float] = {}
    errors = []
    for name in RELOADABLE:
        if name in raw:
            try:
                values[name] = params.get(name).parse(raw[name])
            except params.ParamError as exc:
                errors.append(str(exc))
    return values, errors


class TunablesFile:
    def __init__(self, apply: Callable[[dict[str, int | float]], None], path: str | None = None,
                 clock: Callable[[], float] = time.monotonic, min_interval: float = 1.0) -> None:
        self.path = Path(path or os.environ.get(params.TUNABLES_FILE_ENV, params.DEFAULT_TUNABLES_FILE))
        self._apply = apply
        self._clock = clock
        self._min_interval = min_interval
        self._checked = float("-inf")
        self._mtime: float | None = None
        self.current: dict[str, int | float] = {}

    def poll(self) -> bool:
        """Re-read the file if it changed; True when new values were applied."""
        now = self._clock()
        if now - self._checked < self._min_interval:
            return False
        self._checked = now
        try:
            mtime = self.path.stat().st_mtime_ns
            if mtime == self._mtime:
                return False
            text = self.path.read_text()
        except OSError:
            return False
        self._mtime = mtime
        values, errors = parse(text)
        for error in errors:
            logger.error("turnkv: %s: refused %s; keeping %s", self.path, error, self.current or "the start-up values")
        changed = {k: v for k, v in values.items() if self.current.get(k) != v}
        if not changed:
            return False
        self.current.update(changed)
        self._apply(changed)
        logger.info("turnkv: reloaded %s from %s", changed, self.path)
        return True
