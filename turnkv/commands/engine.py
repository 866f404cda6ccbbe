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

from turnkv import params, wire
from turnkv.engine_args import EngineSpec, Mode, Role, serve_args, serve_env

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
REQUIRED = (ROLE, ENGINE_ID, MODEL, SIDE_CHANNEL_HOST)
DEFAULTS: dict[str, str] = {
    MODE: Mode.PULL.value,
    BIDIRECTIONAL: "true",
    TP_SIZE: "1",
    MAX_MODEL_LEN: "8192",
    PORT: "8000",
    SIDE_CHANNEL_PORT: "5600",
    BACKENDS: "LIBFABRIC",
    TUNABLES_FILE: params.DEFAULT_TUNABLES_FILE,
}
#: NIXL backend plugins a spec may name.
KNOWN_BACKENDS = frozenset({"LIBFABRIC", "UCX", "UCCL", "GDS", "GDS_MT", "POSIX", "OBJ", "MOONCAKE", "GPUNETIO"})
_NOT_ROUTABLE = re.compile(r"^(localhost|127\.\d+\.\d+\.\d+|0\.0\.0\.0|::1?|\[::1?\])$", re.I)
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")


class EngineEnvError(ValueError):
    """One or more variables are missing or invalid; the message names each and says what is allowed."""


def parse_env_file(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        if not sep:
            raise EngineEnvError(f"line {number}: expected NAME=value, got {line!r}")
        out[name.strip()] = value.strip().strip('"').strip("'")
    return out


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


def _int(env: Mapping[str, str], name: str, low: int, high: int, errors: list[str]) -> int:
    raw = env.get(name, "")
    try:
        value = int(raw)
    except ValueError:
        errors.append(f"{name}={raw!r} is not an integer ({low}..{high})")
        return low
    if not low <= value <= high:
        errors.append(f"{name}={value} is out of range ({low}..{high})")
    return value


def spec_from_env(env: Mapping[str, str], tunables: Mapping[str, int | float] | None = None,
                  model_path: str | None = None) -> EngineSpec:
    """The EngineSpec for engine.env variables (defaults filled in); raises EngineEnvError naming every problem."""
    env = {**DEFAULTS, **{k: v for k, v in env.items() if v != ""}}
    errors = [f"{name} is missing" for name in REQUIRED if not env.get(name)]
    role = env.get(ROLE, "")
    if role and role not in {r.value for r in Role}:
        errors.append(f"{ROLE}={role!r} must be prefill or decode")
    engine_id = env.get(ENGINE_ID, "")
    if engine_id and not _ID.match(engine_id):
        errors.append(f"{ENGINE_ID}={engine_id!r}: use letters, digits and ._:@- (at most 128)")
    mode = env[MODE]
    if mode not in {m.value for m in Mode}:
        errors.append(f"{MODE}={mode!r} must be pull or push")
    bidi = env[BIDIRECTIONAL].lower()
    if bidi not in {"true", "false"}:
        errors.append(f"{BIDIRECTIONAL}={env[BIDIRECTIONAL]!r} must be true or false")
    tp = _int(env, TP_SIZE, 1, 64, errors)
    max_len = _int(env, MAX_MODEL_LEN, 16, 10_000_000, errors)
    port = _int(env, PORT, 1, 65535, errors)
    side_port = _int(env, SIDE_CHANNEL_PORT, 1, 65535, errors)
    if port == side_port:
        errors.append(f"{PORT} and {SIDE_CHANNEL_PORT} are both {port}")
    host = env.get(SIDE_CHANNEL_HOST, "")
    if host and _NOT_ROUTABLE.match(host):
        errors.append(f"{SIDE_CHANNEL_HOST}={host!r} is not routable: engines on other nodes must reach the NIXL "
                      "side channel there (use this node's private IP)")
    backends = tuple(b.strip().upper() for b in env[BACKENDS].split(",") if b.strip())
    unknown = [b for b in backends if b not in KNOWN_BACKENDS]
    if not backends or unknown:
        errors.append(f"{BACKENDS}={env[BACKENDS]!r}: give NIXL backends from {', '.join(sorted(KNOWN_BACKENDS))}")
    if errors:
        raise EngineEnvError(f"{ENGINE_ENV_FILE}: " + "; ".join(errors))
    engine_tunables = params.defaults(params.Scope.ENGINE)
    engine_tunables.update(tunables or {})
    return EngineSpec(
        role=Role(role),
        engine_id=engine_id,
        model=model_path or env[MODEL],
        served_model_name=env.get(SERVED_MODEL_NAME) or env[MODEL],
        host="0.0.0.0",
        port=port,
        side_channel_host=host,
        side_channel_port=side_port,
        mode=Mode(mode),
        bidirectional=bidi == "true",
        tensor_parallel_size=tp,
        max_model_len=max_len,
        backends=backends,
        tunables=engine_tunables,
        offer_secret_file=env.get(wire.OFFER_SECRET_FILE_ENV) or wire.DEFAULT_OFFER_SECRET_FILE,
    )


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
    env_file: Annotated[Path | None, typer.Option(
        "--env-file", help=f"Read the variables from this file (systemd already loads {ENGINE_ENV_FILE}).")] = None,
    role: Annotated[str | None, typer.Option(help=f"prefill|decode ({ROLE})")] = None,
    engine_id: Annotated[str | None, typer.Option(help=f"({ENGINE_ID})")] = None,
    model: Annotated[str | None, typer.Option(help=f"({MODEL})")] = None,
    served_model_name: Annotated[str | None, typer.Option(help=f"({SERVED_MODEL_NAME})")] = None,
    mode: Annotated[str | None, typer.Option(help=f"pull|push ({MODE})")] = None,
    bidirectional: Annotated[bool | None, typer.Option(
        "--bidirectional/--no-bidirectional", help=f"({BIDIRECTIONAL})")] = None,
    tp_size: Annotated[int | None, typer.Option(help=f"({TP_SIZE})")] = None,
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
             TP_SIZE: tp_size, MAX_MODEL_LEN: max_model_len, PORT: port, SIDE_CHANNEL_HOST: side_channel_host,
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
    argv = [vllm_executable(), *serve_args(spec)]
    env = serve_env(spec)
    notes.append(f"{spec.role.value} engine {spec.engine_id}: {spec.mode.value}, backends {','.join(spec.backends)}")
    return argv, env, notes
