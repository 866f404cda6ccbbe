"""`turnkv config validate FILE`: every problem of a deploy config in one pass, without a synth.

The rules are the CDK app's own (``infra.config.check``, which synth calls too). Exit 0 valid, 2 invalid: one
line per problem, ``field: what is wrong; how to fix it``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(help="Check a deployment config (the file `cdk deploy -c turnkv:config=FILE` reads).",
                  no_args_is_help=True)


@app.command()
def validate(file: Annotated[Path, typer.Argument(help="The deploy config, YAML or JSON.")]) -> None:
    """Report every per-field and cross-field problem of FILE at once; exit 2 if there is any."""
    from rich.console import Console

    from infra.config import validate_file

    config, problems = validate_file(file)
    if problems or config is None:
        err = Console(stderr=True, highlight=False, soft_wrap=True)
        err.print(f"[red]{file}: {len(problems)} problem{'s' if len(problems) != 1 else ''}[/red]")
        for field, message in problems:
            err.print(f"{field}: {message}", markup=False)
        raise typer.Exit(2)
    pools = ", ".join(f"{p.name} ({p.role.value}, {p.count} x {p.instance_type})" for p in config.pools)
    Console(highlight=False, soft_wrap=True).print(
        f"{file}: valid. Deployment {config.name!r} in {config.availability_zone}; pools {pools}; router "
        f"{config.router.replicas}..{config.router.max_replicas} replicas, Valkey "
        f"{'yes' if config.router.uses_valkey else 'no'}; AMI "
        f"{config.image.ami_id or 'baked by the deploy'}.", markup=False)
    from infra import host_tier, roll

    budget, why = host_tier.default_mib(config)
    out = Console(highlight=False, soft_wrap=True)
    out.print(f"Host tier: {budget} MiB per decode engine by default ({why})." if budget else
              f"Host tier: off by default ({why}).", markup=False)
    # What a new image or user data costs before the deploy that rolls it (infra.roll): groups roll one at a time.
    out.print(f"A roll (new image or user data), one group at a time; P/Trn vCPUs at its peak: "
              f"{roll.peak_vcpus(config)}:", markup=False)
    for line in roll.plan(config):
        out.print(f"  {line}", markup=False)


@app.command("engine-env")
def engine_env(
    file: Annotated[Path, typer.Argument(help="The deploy config, YAML or JSON.")],
    pool: Annotated[str | None, typer.Option(help="The pool whose nodes to show (default: the first).")] = None,
) -> None:
    """Print the engine.env a node of POOL gets from FILE (what its user data writes, short of the instance's id
    and address); `turnkv engine run --env-file F --dry-run` shows the engine it starts."""
    from rich.console import Console

    from infra.bootstrap import pool_bootstrap, static_engine_env
    from infra.config import validate_file

    config, problems = validate_file(file)
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    if problems or config is None:
        err.print(f"{file}: invalid; run `turnkv config validate {file}`", markup=False)
        raise typer.Exit(2)
    names = [p.name for p in config.pools]
    if pool is not None and pool not in names:
        err.print(f"--pool {pool!r}: no such pool; use one of {', '.join(names)}", markup=False)
        raise typer.Exit(2)
    chosen = next(p for p in config.pools if pool in (None, p.name))
    typer.echo(static_engine_env(pool_bootstrap(config, chosen)), nl=False)
