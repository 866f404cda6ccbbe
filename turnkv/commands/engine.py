"""`turnkv engine run`: start this node's vLLM engine from /etc/turnkv/engine.env (what turnkv-engine.service runs).

The variables (or the matching flags) become an :class:`turnkv.engine_args.EngineSpec`; the process then
execs ``vllm`` with :func:`turnkv.engine_args.serve_args` / :func:`~turnkv.engine_args.serve_env`, so the
engine runs with the same flags as everywhere else. Every missing or invalid variable is named in the error.

The variable names are those of ``turnkv/node_env.py`` (branch infra, the user-data side of the contract);
``tests/unit/test_engine_run.py`` checks that both spell them the same way and build the same spec.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated

import typer

from turnkv import node_env, params, platforms
from turnkv.commands import renamed
from turnkv.engine_args import EngineSpec, serve_args, serve_env

# engine.env variable names and paths: defined once in turnkv/node_env.py.
from turnkv.node_env import (
    BACKENDS,
    BIDIRECTIONAL,
    ENGINE_ENV_FILE,
    ENGINE_ID,
    MAX_MODEL_LEN,
    MODE,
    MODEL,
    MODEL_S3_URI,
    PORT,
    ROLE,
    SERVED_MODEL_NAME,
    SIDE_CHANNEL_HOST,
    SIDE_CHANNEL_PORT,
    TP_SIZE,
)
from turnkv.node_env import TUNABLES_FILE_VAR as TUNABLES_FILE

MODELS_DIR = "/opt/turnkv/models"
#: The AMI records its flavor here (gpu or neuron); what is unverified on a flavor stops the engine at start.
FLAVOR_FILE = "/var/lib/turnkv/ami/flavor"
REQUIRED = node_env.REQUIRED
DEFAULTS = node_env.ENGINE_DEFAULTS
KNOWN_BACKENDS = node_env.KNOWN_BACKENDS
#: One error type and one parser for engine.env (turnkv.node_env).
EngineEnvError = node_env.NodeEnvError
parse_env_file = node_env.parse


def load_tunables(path: str, read_text: Callable[[str], str | None]) -> tuple[dict[str, int | float], str]:
    """Engine tunables: catalog defaults, overlaid with the synced file when it exists (values bound-checked)."""
    values = params.defaults(params.Scope.ENGINE)
    text = read_text(path)
    if text is None:
        return values, f"{path} not found (turnkv-params-sync has not run yet): catalog defaults"
    try:
        stored = json.loads(text)
    except json.JSONDecodeError as exc:
        raise EngineEnvError(f"{TUNABLES_FILE}={path}: not JSON ({exc})") from None
    if not isinstance(stored, dict):
        raise EngineEnvError(f"{TUNABLES_FILE}={path}: expected a JSON object of tunables")
    for name, raw in stored.items():
        try:
            tunable = params.get(name)
            if tunable.scope is params.Scope.ENGINE:
                values[name] = tunable.parse(raw)
        except params.ParamError as exc:
            raise EngineEnvError(f"{TUNABLES_FILE}={path}: {exc}") from None
    return values, f"tunables from {path}"


def spec_from_env(env: Mapping[str, str], tunables: Mapping[str, int | float] | None = None,
                  model_path: str | None = None) -> EngineSpec:
    """The EngineSpec for engine.env variables (defaults filled in); raises EngineEnvError naming every problem."""
    return node_env.EngineEnv.from_variables(env).spec(tunables, model_path)


def model_dir(env: Mapping[str, str]) -> str:
    """Where TURNKV_MODEL_S3_URI is synced: /opt/turnkv/models/<served name, made path-safe>."""
    name = env.get(SERVED_MODEL_NAME) or env.get(MODEL) or "model"
    return f"{MODELS_DIR}/{re.sub(r'[^A-Za-z0-9._-]+', '--', name).strip('.-') or 'model'}"


def sync_model(uri: str, dest: str, run: Callable[[Sequence[str]], int]) -> None:
    if not uri.startswith("s3://"):
        raise EngineEnvError(f"{MODEL_S3_URI}={uri!r} must be an s3:// URL")
    code = run(["aws", "s3", "sync", "--only-show-errors", uri, dest])
    if code != 0:
        raise EngineEnvError(f"{MODEL_S3_URI}: 'aws s3 sync {uri} {dest}' failed with exit code {code}")


def vllm_executable() -> str:
    beside = Path(sys.executable).with_name("vllm")
    return str(beside) if beside.exists() else "vllm"


def _read_text(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        return None


app = typer.Typer(help="Run this node's vLLM engine (what turnkv-engine.service starts).", no_args_is_help=True)


@app.callback()
def _engine() -> None:
    """Engine node commands."""


@app.command("run")
def run(
    ctx: typer.Context,
    env_file: Annotated[Path | None, typer.Option(
        "--env-file", help=f"Read the variables from this file (systemd already loads {ENGINE_ENV_FILE}).")] = None,
    role: Annotated[str | None, typer.Option(help=f"prefill|decode ({ROLE})")] = None,
    engine_id: Annotated[str | None, typer.Option(help=f"({ENGINE_ID})")] = None,
    model: Annotated[str | None, typer.Option(help=f"({MODEL})")] = None,
    served_model_name: Annotated[str | None, typer.Option(help=f"({SERVED_MODEL_NAME})")] = None,
    mode: Annotated[str | None, typer.Option(help=f"pull|push ({MODE})")] = None,
    bidirectional: Annotated[bool | None, typer.Option(
        "--bidirectional/--no-bidirectional", help=f"({BIDIRECTIONAL})")] = None,
    tensor_parallel_size: Annotated[int | None, typer.Option(
        "--tensor-parallel-size", "--tp", help=f"tensor parallel size ({TP_SIZE})")] = None,
    tp_size: Annotated[int | None, typer.Option("--tp-size", hidden=True)] = None,
    max_model_len: Annotated[int | None, typer.Option(help=f"({MAX_MODEL_LEN})")] = None,
    port: Annotated[int | None, typer.Option(help=f"({PORT})")] = None,
    side_channel_host: Annotated[str | None, typer.Option(help=f"routable address ({SIDE_CHANNEL_HOST})")] = None,
    side_channel_port: Annotated[int | None, typer.Option(help=f"({SIDE_CHANNEL_PORT})")] = None,
    backends: Annotated[str | None, typer.Option(help=f"comma-separated NIXL backends ({BACKENDS})")] = None,
    tunables_file: Annotated[str | None, typer.Option(help=f"({TUNABLES_FILE})")] = None,
    model_s3_uri: Annotated[str | None, typer.Option(help=f"s3:// prefix to sync the model from ({MODEL_S3_URI})")]
    = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the command and environment; do not exec.")]
    = False,
) -> None:
    """Build the engine spec from engine.env (or flags) and exec `vllm serve`."""
    flags = {ROLE: role, ENGINE_ID: engine_id, MODEL: model, SERVED_MODEL_NAME: served_model_name, MODE: mode,
             BIDIRECTIONAL: None if bidirectional is None else str(bidirectional).lower(),
             TP_SIZE: renamed(ctx, "tensor_parallel_size", "tp_size"), MAX_MODEL_LEN: max_model_len, PORT: port,
             SIDE_CHANNEL_HOST: side_channel_host,
             SIDE_CHANNEL_PORT: side_channel_port, BACKENDS: backends, TUNABLES_FILE: tunables_file,
             MODEL_S3_URI: model_s3_uri}
    try:
        variables = parse_env_file(env_file.read_text()) if env_file else {}
        variables.update({k: v for k, v in os.environ.items() if k.startswith("TURNKV_")})
        variables.update({k: str(v) for k, v in flags.items() if v is not None})
        argv, env, notes = prepare(variables, read_text=_read_text,
                                   run=lambda cmd: subprocess.run(list(cmd)).returncode, sync=not dry_run)
    except (EngineEnvError, OSError) as exc:
        typer.secho(f"turnkv engine run: {exc}", err=True, fg=typer.colors.RED)
        raise typer.Exit(2) from None
    for note in notes:
        typer.echo(f"turnkv engine run: {note}", err=True)
    if dry_run:
        typer.echo(json.dumps({"argv": argv, "env": env}, indent=2))
        return
    os.execvpe(argv[0], argv, {**os.environ, **env})


def prepare(variables: Mapping[str, str], read_text: Callable[[str], str | None],
            run: Callable[[Sequence[str]], int], sync: bool = True) -> tuple[list[str], dict[str, str], list[str]]:
    """Everything `run` does short of exec: argv, the environment added to the node's, and notes for the log."""
    notes = []
    tunables, note = load_tunables(variables.get(TUNABLES_FILE) or DEFAULTS[TUNABLES_FILE], read_text)
    notes.append(note)
    model_path = None
    uri = variables.get(MODEL_S3_URI)
    if uri:
        model_path = model_dir(variables)
        if sync:
            sync_model(uri, model_path, run)
        notes.append(f"model from {uri} in {model_path}")
    spec = spec_from_env(variables, tunables, model_path)
    flavor = (read_text(FLAVOR_FILE) or "").strip()
    refusal = platforms.refusal(flavor, variables) if flavor else None
    if refusal:
        # Exit status 2 (the unit's RestartPreventExitStatus): a configuration error, not a crash to retry.
        raise EngineEnvError(refusal)
    argv = [vllm_executable(), *serve_args(spec)]
    env = serve_env(spec)
    notes.append(f"{spec.role.value} engine {spec.engine_id}: {spec.mode.value}, backends {','.join(spec.backends)}")
    return argv, env, notes
