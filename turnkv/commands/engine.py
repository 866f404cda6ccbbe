"""`turnkv engine run`: start this node's vLLM engine from /etc/turnkv/engine.env (what turnkv-engine.service runs).

The variables (or the matching flags) go to :func:`turnkv.engine_run.prepare`, which builds the
:class:`turnkv.engine_args.EngineSpec` and the ``vllm serve`` argv and environment; this command then execs
``vllm``, so the engine runs with the same flags as everywhere else. Every missing or invalid variable is named.

The variable names are those of ``turnkv/node_env.py`` (branch infra, the user-data side of the contract);
``tests/unit/test_engine_run.py`` checks that both spell them the same way and build the same spec.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Annotated

import typer

from turnkv import node_env
from turnkv.commands import renamed
from turnkv.doctor import FLAVORS
from turnkv.engine_run import EngineEnvError, parse_env_file, prepare, read_text

# engine.env variable names and paths: defined once in turnkv/node_env.py.
from turnkv.node_env import (
    BACKENDS,
    BIDIRECTIONAL,
    ENGINE_ENV_FILE,
    ENGINE_ID,
    INSTANCE_PLACEHOLDERS,
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
    flavor: Annotated[str | None, typer.Option(
        help="gpu|neuron: the node image's accelerator family (default: what the AMI recorded; none off a node)")]
    = None,
) -> None:
    """Build the engine spec from engine.env (or flags) and exec `vllm serve`."""
    flags = {ROLE: role, ENGINE_ID: engine_id, MODEL: model, SERVED_MODEL_NAME: served_model_name, MODE: mode,
             BIDIRECTIONAL: None if bidirectional is None else str(bidirectional).lower(),
             TP_SIZE: renamed(ctx, "tensor_parallel_size", "tp_size"), MAX_MODEL_LEN: max_model_len, PORT: port,
             SIDE_CHANNEL_HOST: side_channel_host,
             SIDE_CHANNEL_PORT: side_channel_port, BACKENDS: backends, TUNABLES_FILE: tunables_file,
             MODEL_S3_URI: model_s3_uri}
    try:
        if flavor is not None and flavor not in FLAVORS:
            raise EngineEnvError(f"--flavor {flavor!r}: use one of {', '.join(FLAVORS)}")
        variables = parse_env_file(env_file.read_text()) if env_file else {}
        variables.update({k: v for k, v in os.environ.items() if k.startswith("TURNKV_")})
        variables.update({k: str(v) for k, v in flags.items() if v is not None})
        # A dry run of a file (`turnkv config engine-env`'s, off the node) shows the instance's own values as
        # stand-ins; on the node (no --env-file: systemd's environment) a missing one stays an error.
        stand_ins = ({k: v for k, v in INSTANCE_PLACEHOLDERS.items() if not variables.get(k)}
                     if dry_run and env_file else {})
        variables.update(stand_ins)
        argv, env, notes = prepare(variables, read_text=read_text,
                                   run=lambda cmd: subprocess.run(list(cmd)).returncode, sync=not dry_run,
                                   flavor=flavor, source=str(env_file) if env_file else ENGINE_ENV_FILE)
        if stand_ins:
            notes.append(f"{', '.join(stand_ins)}: the instance's own (its user data writes them at boot); "
                         f"stand-ins here: {', '.join(stand_ins.values())}")
    except (EngineEnvError, OSError) as exc:
        typer.secho(f"turnkv engine run: {exc}", err=True, fg=typer.colors.RED)
        raise typer.Exit(2) from None
    for note in notes:
        typer.echo(f"turnkv engine run: {note}", err=True)
    if dry_run:
        typer.echo(json.dumps({"argv": argv, "env": env}, indent=2))
        return
    os.execvpe(argv[0], argv, {**os.environ, **env})



@app.command("drain")
def drain_(
    group: Annotated[str, typer.Option(help="This node's Auto Scaling group (its user data names it).")],
    region: Annotated[str, typer.Option(envvar=node_env.REGION, help="AWS region.")],
    timeout: Annotated[float, typer.Option(help="Drain bound in seconds (the pool's drain_timeout_s).")] = 900,
    engines: Annotated[int, typer.Option(help="Engines this node runs (their HTTP ports follow node_env).")] = 1,
    deployment: Annotated[str | None, typer.Option(
        envvar=node_env.DEPLOYMENT, help="Reads the routers' discovery_interval from SSM (settle time).")] = None,
) -> None:
    """Wait for the terminate lifecycle hook, then drain: routers drop the node, in-flight streams finish, and the
    lifecycle action completes (what turnkv-drain.service runs; turnkv/drain.py)."""
    import time
    import urllib.request

    import boto3

    from turnkv import drain, params
    from turnkv.node_env import DRAIN_HOOK

    def imds(path: str) -> str | None:
        try:
            token = urllib.request.urlopen(urllib.request.Request(
                "http://169.254.169.254/latest/api/token", method="PUT",
                headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}), timeout=2).read().decode()
            return urllib.request.urlopen(urllib.request.Request(
                f"http://169.254.169.254/latest/meta-data/{path}", headers={"X-aws-ec2-metadata-token": token}),
                timeout=2).read().decode().strip()
        except OSError:
            return None

    instance_id = imds("instance-id")
    interval = params.get("discovery_interval").default
    if deployment:
        try:
            from turnkv.aws_params import ParamStore

            interval = ParamStore(boto3.client("ssm", region_name=region), deployment).entries()[
                "discovery_interval"].value
        except Exception as exc:  # the default is a sound settle time; say which one is used
            typer.echo(f"discovery_interval from SSM failed ({exc}); using {interval} s")

    class NodeProbe:
        def lifecycle_state(self) -> str | None:
            return imds("autoscaling/target-lifecycle-state")

        def running(self) -> int | None:
            counts = []
            first, last = node_env.http_ports(engines)
            for port in range(first, last + 1):
                try:
                    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
                    counts.append(drain.running_requests(text))
                except OSError:
                    continue  # an engine that is gone runs nothing
            return sum(counts) if counts else None

        def complete(self) -> None:
            boto3.client("autoscaling", region_name=region).complete_lifecycle_action(
                LifecycleHookName=DRAIN_HOOK, AutoScalingGroupName=group, InstanceId=instance_id,
                LifecycleActionResult="CONTINUE")

        now = staticmethod(time.monotonic)
        sleep = staticmethod(time.sleep)

    done = drain.watch(NodeProbe(), timeout_s=timeout, settle_s=2 * float(interval))
    typer.echo(f"drained {instance_id} in {done.waited_s:.0f} s; {done.running} request(s) still running"
               + (" (timed out)" if done.timed_out else ""))
