"""The local stack's engine settings, taken as a deployment's nodes take them: the deploy config's ``model`` section
(validated by the rules `turnkv config validate` applies), then any setting given on its own (`turnkv local up`'s
flags). One path for the CLI and the engine suites, so a local engine runs with the settings a node would."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from turnkv.engine_settings import EngineSettings, SettingError


def engine_settings_for(model_config: Path | None = None, **overrides: object) -> EngineSettings:
    """The deploy config's engine settings (vLLM's defaults without one), ``overrides`` that are not None on top.
    Raises SettingError naming the fix (an invalid config: its problems, each ``field: message``)."""
    base = EngineSettings()
    if model_config is not None:
        from infra.config import validate_file

        config, problems = validate_file(model_config)
        if problems or config is None:
            raise SettingError(f"{model_config}: " + "; ".join(f"{f}: {m}" for f, m in problems))
        base = config.model.engine_settings
    return dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None}).check()
