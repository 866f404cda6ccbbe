"""What `turnkv engine run` does short of exec: engine.env -> EngineSpec -> `vllm serve` argv and environment.

The variables become an :class:`turnkv.engine_args.EngineSpec` (through :mod:`turnkv.node_env`, the one reader of
engine.env); :func:`prepare` loads the synced tunables, syncs the model from S3 when asked, refuses what is
unverified on this AMI's flavor and returns the argv and environment of :func:`turnkv.engine_args.serve_args` /
:func:`~turnkv.engine_args.serve_env`. Every missing or invalid variable is named in the error.
``turnkv/commands/engine.py`` is the CLI over it (flags, printing, exec); infra reads the paths from node_env.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from turnkv import neuron, node_env, params, platforms
from turnkv.engine_args import EngineSpec, serve_args, serve_env
from turnkv.node_env import (
    FLAVOR_FILE,
    HF_TOKEN_SECRET,
    MODEL,
    MODEL_S3_URI,
    MODELS_DIR,
    NODE_ENV_FILE,
    REGION,
    SERVED_MODEL_NAME,
)
from turnkv.node_env import TUNABLES_FILE_VAR as TUNABLES_FILE

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
                  model_path: str | None = None, flavor: str = "", source: str = node_env.ENGINE_ENV_FILE,
                  ) -> EngineSpec:
    """The EngineSpec for engine.env variables (defaults filled in) on an AMI of ``flavor``; raises EngineEnvError
    naming every problem and ``source``, where the variables came from."""
    return node_env.EngineEnv.from_variables(env, source).spec(tunables, model_path, flavor)


def model_dir(env: Mapping[str, str]) -> str:
    """Where TURNKV_MODEL_S3_URI is synced: /opt/turnkv/models/<served name, made path-safe>."""
    name = env.get(SERVED_MODEL_NAME) or env.get(MODEL) or "model"
    return f"{MODELS_DIR}/{re.sub(r'[^A-Za-z0-9._-]+', '--', name).strip('.-') or 'model'}"


#: One weight sync at a time on a node: its engines (``engines_per_node``) share one model folder, and each would
#: otherwise download the same files at once. The next engine's sync then only compares (nothing to copy).
MODEL_SYNC_LOCK = "/run/lock/turnkv-model-sync.lock"


def sync_model(uri: str, dest: str, run: Callable[[Sequence[str]], int]) -> None:
    if not uri.startswith("s3://"):
        raise EngineEnvError(f"{MODEL_S3_URI}={uri!r} must be an s3:// URL")
    code = run(["flock", MODEL_SYNC_LOCK, "aws", "s3", "sync", "--only-show-errors", uri, dest])
    if code != 0:
        raise EngineEnvError(f"{MODEL_S3_URI}: 'aws s3 sync {uri} {dest}' failed with exit code {code}")


def vllm_executable() -> str:
    beside = Path(sys.executable).with_name("vllm")
    return str(beside) if beside.exists() else "vllm"


def read_text(path: str) -> str | None:
    """The file's text, or None when it does not exist (the reader :func:`prepare` takes on a node)."""
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        return None


#: The variable the Hugging Face hub reads a token from (downloads of gated models).
HF_TOKEN = "HF_TOKEN"
#: What a dry run shows instead of the token.
REDACTED = "<redacted>"


def secret_region(secret: str, variables: Mapping[str, str], read_text: Callable[[str], str | None]) -> str | None:
    """The region to ask Secrets Manager in: the ARN's, else the node's (node.env's AWS_REGION)."""
    if secret.startswith("arn:"):
        return secret.split(":")[3]
    node = node_env.parse(read_text(NODE_ENV_FILE) or "")
    return variables.get(REGION) or node.get(REGION) or None


def fetch_secret(secret: str, region: str | None) -> str:
    """The secret's string, through the AWS CLI the AMI ships (the instance role's credentials). Raises
    EngineEnvError naming the secret (never its value)."""
    import subprocess

    cmd = ["aws", "secretsmanager", "get-secret-value", "--secret-id", secret, "--query", "SecretString",
           "--output", "text", *(["--region", region] if region else [])]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EngineEnvError(f"{HF_TOKEN_SECRET}={secret}: cannot read it ({exc})") from None
    if done.returncode != 0:
        raise EngineEnvError(f"{HF_TOKEN_SECRET}={secret}: Secrets Manager refused ({done.stderr.strip()[:300]}); "
                             "check the secret exists and the engine role may read it (model.hf_token_secret)")
    return done.stdout


def hf_token(text: str, secret: str) -> str:
    """The token in the secret's string: the string itself, or the ``HF_TOKEN`` key of a JSON object."""
    text = text.strip()
    if text.startswith("{"):
        try:
            text = str(json.loads(text)[HF_TOKEN]).strip()
        except (json.JSONDecodeError, KeyError, TypeError):
            raise EngineEnvError(f"{HF_TOKEN_SECRET}={secret}: a JSON secret must hold an {HF_TOKEN} key; store "
                                 "the token as plain text or as {\"HF_TOKEN\": \"hf_...\"}") from None
    if not text:
        raise EngineEnvError(f"{HF_TOKEN_SECRET}={secret}: the secret is empty; store the Hugging Face token in it")
    return text


def prepare(variables: Mapping[str, str], read_text: Callable[[str], str | None],
            run: Callable[[Sequence[str]], int], sync: bool = True,
            flavor: str | None = None, get_secret: Callable[[str, str | None], str] = fetch_secret,
            source: str = node_env.ENGINE_ENV_FILE) -> tuple[list[str], dict[str, str], list[str]]:
    """Everything `run` does short of exec: argv, the environment added to the node's, and notes for the log.
    ``flavor`` stands in for the AMI's record (a dry run off the node). ``sync`` False (a dry run): no weight sync
    and no secret read; a token shows as :data:`REDACTED`."""
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
    flavor = (read_text(FLAVOR_FILE) or "").strip() if flavor is None else flavor
    spec = spec_from_env(variables, tunables, model_path, flavor, source)
    refusal = platforms.refusal(flavor, variables) if flavor else None
    if refusal:
        # Exit status 2 (the unit's RestartPreventExitStatus): a configuration error, not a crash to retry.
        raise EngineEnvError(refusal)
    try:
        argv = [vllm_executable(), *serve_args(spec)]
    except ValueError as exc:  # a setting the platform refuses (push on Neuron): also a configuration error
        raise EngineEnvError(str(exc)) from None
    env = serve_env(spec)
    secret = variables.get(HF_TOKEN_SECRET)
    if secret:
        # The token goes to the engine's process environment only (exec), never to a file or the argv.
        env[HF_TOKEN] = hf_token(get_secret(secret, secret_region(secret, variables, read_text)), secret) \
            if sync else REDACTED
        notes.append(f"{HF_TOKEN} from Secrets Manager {secret}" + ("" if sync else " (not read: dry run)"))
    notes.append(f"{spec.role.value} engine {spec.engine_id}: {spec.mode.value}, backends {','.join(spec.backends)}")
    devices = node_env.visible_devices(variables)
    if devices is not None:
        notes.append(f"devices {devices[0]}..{devices[-1]} ({len(devices)}, from the slot's env)")
    if spec.on_neuron:
        notes.append(compile_note(env.get(neuron.CACHE_ROOT_ENV, neuron.CACHE_ROOT)))
        if not sync:  # a dry run: each Neuron setting with the upstream source it follows (docs/trainium.md)
            notes += [f"neuron setting {name}: {source}" for name, source in neuron.setting_sources().items()]
    return argv, env, notes


#: How long the node's register unit waits for a first /health before it gives the node up (infra.bootstrap: 720
#: polls 10 s apart): a Neuron engine that compiles is not replaced before then.
HEALTH_WAIT_S = 7200


def cache_filled(path: str) -> bool:
    """Whether the compile cache folder holds anything (compiled graphs from the bake or an earlier start)."""
    folder = Path(path)
    return folder.is_dir() and any(folder.iterdir())


def compile_note(cache_root: str, filled: Callable[[str], bool] = cache_filled) -> str:
    """What a Neuron engine says at start about compilation: graphs found in the cache, or it compiles first (the
    vllm-neuron tutorials: 15-20 minutes for a 70B model) and the node waits for it."""
    if filled(cache_root):
        return f"compile cache {cache_root}: graphs present; graphs of this configuration are reused, others compile"
    budget = int(neuron.TIMEOUTS["VLLM_NEURON_COMPILATION_TIMEOUT"]) // 60
    return (f"compile cache {cache_root} is empty: this engine compiles its graphs before it serves (15-20 min for a "
            f"70B model; up to {budget} min a graph allowed), and the node waits {HEALTH_WAIT_S // 3600} h for "
            "its first /health before it is replaced")
