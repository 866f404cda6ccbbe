"""`turnkv params`: list, get, set, history and sync the tunables in SSM Parameter Store.

Exit codes: 0 done, 1 AWS error, 2 a value or name the catalog refuses, or a deployment without parameters
(a typo in ``--deployment`` must not create a second set; ``set --create`` does on purpose). The reason is printed.
boto3 honours ``AWS_ENDPOINT_URL`` (tests point it at moto).
"""

from __future__ import annotations

import getpass
import json
import re
from pathlib import Path
from typing import Annotated, Any

import typer

from turnkv import node_env
from turnkv import params as catalog

app = typer.Typer(help="Read and change the tunables in SSM Parameter Store.", no_args_is_help=True)

Deployment = Annotated[str, typer.Option("--deployment", "-d", envvar=node_env.DEPLOYMENT,
                                         help="Deployment name (the CDK config's name).")]
Region = Annotated[str | None, typer.Option("--region", envvar=node_env.REGION, help="AWS region.")]
OptionalDeployment = Annotated[str | None, typer.Option(
    "--deployment", "-d", envvar=node_env.DEPLOYMENT,
    help="Deployment name (the CDK config's name). Left out with --dry-run: checked offline against the catalog.")]
AsJson = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]


def _console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, highlight=False)


#: What boto3 accepts as a region name (it raises a traceback-shaped error on anything else).
REGION_NAME = re.compile(r"^[a-z]{2}(-[a-z]+)+-\d+$")


def _store(deployment: str, region: str | None, create: bool = False):
    """The deployment's store; refused (exit 2) when the deployment has no parameters, unless ``create``."""
    import boto3

    from turnkv.aws_params import ParamStore

    if region is not None and not REGION_NAME.match(region):
        _refuse(f"{region!r} is not an AWS region name; pass --region REGION, e.g. us-east-2")
    session = boto3.session.Session(region_name=region)
    if not session.region_name:
        _refuse("no AWS region: pass --region REGION (the deployment's, e.g. us-east-2), or set AWS_REGION, or "
                "`aws configure set region REGION`")
    try:
        store = ParamStore(session.client("ssm"), deployment)
    except catalog.ParamError as exc:
        _refuse(str(exc))
    except ValueError as exc:  # botocore's InvalidRegionError (a region from AWS_REGION or the profile)
        _refuse(f"{exc}; pass --region REGION, e.g. us-east-2")
    if not create:
        try:
            exists = store.exists()
            known = [] if exists else store.known_deployments()
        except _aws_errors() as exc:
            _aws_error(exc)
        if not exists:
            where = session.region_name or "the default region"
            others = f"deployments with parameters there: {', '.join(known)}" if known else "no deployment has any"
            _refuse(f"deployment {deployment!r} has no parameters under {store.prefix}/ in {where} ({others}); "
                    "check --deployment and --region, or pass --create to create its parameters")
    return store, session


def _store_for(name: str, deployment: str, region: str | None):
    """The store, once ``name`` is known to be a tunable (refused with the known names otherwise)."""
    try:
        catalog.get(name)
    except catalog.ParamError as exc:
        _refuse(str(exc))
    return _store(deployment, region)[0]


def _refuse(reason: str) -> None:
    _console(stderr=True).print(f"[red]refused:[/red] {reason}")
    raise typer.Exit(2)


def _aws_error(exc: Exception) -> None:
    from botocore.exceptions import NoCredentialsError

    hint = ("; give credentials: `aws configure`, AWS_PROFILE, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
            if isinstance(exc, NoCredentialsError) else "")
    _console(stderr=True).print(f"[red]AWS error:[/red] {exc}{hint}")
    raise typer.Exit(1)


def _aws_errors():
    from botocore.exceptions import BotoCoreError, ClientError

    return (BotoCoreError, ClientError)


@app.command("list")
def list_(deployment: Deployment, region: Region = None, as_json: AsJson = False) -> None:
    """Every tunable: stored value, default, allowed range, SSM version."""
    from rich.table import Table

    store, _ = _store(deployment, region)
    try:
        entries = store.entries()
    except _aws_errors() as exc:
        _aws_error(exc)
    if as_json:
        typer.echo(json.dumps({n: {"value": e.value, "stored": e.raw, "default": e.tunable.default,
                                   "allowed": e.tunable.allowed, "scope": e.tunable.scope.value,
                                   "version": e.version, "path": e.tunable.ssm_path(deployment),
                                   "error": e.error} for n, e in entries.items()}, indent=2))
        return
    table = Table(title=f"turnkv tunables — {deployment}")
    for column in ("name", "scope", "value", "default", "allowed", "version", "modified"):
        table.add_column(column, justify="right" if column in {"value", "default", "version"} else "left")
    for name, e in entries.items():
        if e.error:
            shown = f"[red]{e.raw} (invalid)[/red]"
        elif e.raw is None:
            shown = f"[dim]{e.value} (unset)[/dim]"
        elif e.value != e.tunable.default:
            shown = f"[bold yellow]{e.value}[/bold yellow]"
        else:
            shown = str(e.value)
        modified = e.modified.strftime("%Y-%m-%d %H:%M") if e.modified else ""
        table.add_row(name, e.tunable.scope.value, shown, str(e.tunable.default), e.tunable.allowed,
                      str(e.version or ""), modified)
    _console().print(table)
    bad = [e.error for e in entries.values() if e.error]
    try:
        if not bad:
            catalog.cross_check({n: e.value for n, e in entries.items()})
    except catalog.ParamError as exc:
        bad.append(str(exc))
    for reason in bad:
        _console(stderr=True).print(f"[red]warning:[/red] {reason}")


@app.command("get")
def get(name: Annotated[str, typer.Argument(help="Tunable name.")], deployment: Deployment,
        region: Region = None, as_json: AsJson = False) -> None:
    """One tunable's effective value (the default when unset)."""
    store = _store_for(name, deployment, region)
    try:
        entry = store.entries()[name]
    except _aws_errors() as exc:
        _aws_error(exc)
    if entry.error:
        _refuse(f"stored value is invalid: {entry.error}")
    if as_json:
        typer.echo(json.dumps({"name": name, "value": entry.value, "stored": entry.raw, "version": entry.version}))
    else:
        typer.echo(entry.value)


def _who(session, who: str | None) -> str:
    if who:
        return who
    try:
        arn = session.client("sts").get_caller_identity()["Arn"]
        return arn.rsplit("/", 1)[-1] or arn
    except Exception:  # no STS access: fall back to the local user
        return getpass.getuser()


@app.command("set")
def set_(assignments: Annotated[list[str], typer.Argument(help="NAME VALUE, or NAME=VALUE ...")],
         deployment: OptionalDeployment = None, region: Region = None,
         who: Annotated[str | None, typer.Option(help="Recorded as the author (default: caller identity).")] = None,
         dry_run: Annotated[bool, typer.Option(
             "--dry-run", help="Validate only, writing nothing: against the deployment's stored values with "
                               "--deployment, else offline against the catalog's defaults.")] = False,
         create: Annotated[bool, typer.Option(
             "--create", help="Create the parameters of a deployment that has none yet (normally its params stack "
                              "does).")] = False) -> None:
    """Change tunables: validated against the catalog and its cross-checks, recorded as a labelled version.
    decoder_kv_blocks_ttl alone lowers conversation_ttl to fit when the stored one no longer does."""
    from rich.table import Table

    from turnkv.aws_params import parse_assignments

    try:
        changes = parse_assignments(assignments)
    except catalog.ParamError as exc:
        _refuse(str(exc))
    for name, raw in changes.items():  # each value's range needs no AWS: refuse it before any call
        try:
            catalog.get(name).parse(raw)
        except catalog.ParamError as exc:
            _refuse(str(exc))
    if deployment is None:
        if not dry_run:
            _refuse("no deployment: pass --deployment NAME (or set TURNKV_DEPLOYMENT); --dry-run without one checks "
                    "the values offline")
        _dry_run_offline(changes)
        return
    store, session = _store(deployment, region, create=create)
    try:
        if dry_run:
            entries, merged, fitted = store.plan(changes)
            for name in fitted:
                typer.echo(f"{name}: {entries[name].value} -> {merged[name]} (dry run, nothing written)")
            return
        done = store.set(changes, _who(session, who))
    except catalog.ParamError as exc:
        _refuse(str(exc))
    except _aws_errors() as exc:
        _aws_error(exc)
    table = Table(title=f"changed — {deployment}")
    for column in ("name", "old", "new", "version", "label"):
        table.add_column(column)
    for c in done:
        table.add_row(c.name, str(c.old), f"[bold]{c.new}[/bold]", str(c.version), c.label)
    _console().print(table)
    if "conversation_ttl" in {c.name for c in done} and "conversation_ttl" not in changes:
        _console().print("conversation_ttl lowered to fit decoder_kv_blocks_ttl - expiry_margin (docs/parameters.md).")
    _console().print("Engines pick engine-scope changes up at the next `turnkv params sync` (timer, about a minute).")


def _dry_run_offline(changes: dict[str, str]) -> None:
    """``set --dry-run`` without a deployment: ranges and cross-checks over the catalog's defaults, no AWS call. The
    defaults stand in for the stored values, as ``set`` fits them (only lowering conversation_ttl where it no longer
    fits): the preview showed a raise the real command never makes (issue #49)."""
    try:
        fitted = catalog.fit_router_ttl(changes, catalog.defaults())
        merged = catalog.validate(fitted)
    except catalog.ParamError as exc:
        _refuse(str(exc))
    for name in fitted:
        typer.echo(f"{name}: {catalog.get(name).default} -> {merged[name]} (dry run, offline: over the catalog's "
                   "defaults, nothing written)")


@app.command("diff")
def diff(deployment: Deployment, region: Region = None, as_json: AsJson = False,
         config: Annotated[Path | None, typer.Option(
             "--config", help="The deploy config (YAML): compare with its defaults (the host tier sized from its "
                              "decode nodes, its `tunables`); left out: the catalog's defaults.")] = None) -> None:
    """Stored values that differ from this kit's defaults. Deploys never overwrite a stored value (an upgrade that
    changes a default reports it here); `params set NAME=DEFAULT` applies one."""
    from turnkv.aws_params import differences

    defaults = catalog.defaults()
    if config is not None:
        try:
            from infra.config import ConfigError, from_mapping, load_file
            from infra.stacks.params import deployment_defaults
        except ImportError as exc:
            _refuse(f"--config needs the infra extra ({exc}); pip install 'turnkv[infra]'")
        try:
            defaults = deployment_defaults(from_mapping(load_file(config)))
        except ConfigError as exc:
            _refuse(str(exc))
    store, _ = _store(deployment, region)
    try:
        found = differences(store.entries(), defaults)
    except _aws_errors() as exc:
        _aws_error(exc)
    if as_json:
        typer.echo(json.dumps({d.name: {"stored": d.stored, "default": d.default, "reason": d.reason}
                               for d in found}, indent=2))
        return
    if not found:
        typer.echo(f"{deployment}: every stored tunable equals this kit's default")
    for d in found:
        typer.echo(f"{d.name}: stored {d.stored if d.stored is not None else '(none)'}, default {d.default} "
                   f"({d.reason})")


@app.command("catalog")
def catalog_(as_json: AsJson = False) -> None:
    """Every tunable the catalog knows: default, allowed range, unit, scope and what it does. Offline (no AWS);
    `params list -d NAME` shows a deployment's stored values."""
    if as_json:
        typer.echo(json.dumps({t.name: {"default": t.default, "allowed": t.allowed, "unit": t.unit,
                                        "scope": t.scope.value, "description": t.help}
                               for t in catalog.CATALOG}, indent=2))
        return
    import textwrap

    width = max(len(t.name) for t in catalog.CATALOG)
    for t in catalog.CATALOG:
        typer.echo(f"{t.name:<{width}}  {t.scope.value:<6}  default {t.default}  allowed {t.allowed}")
        typer.echo(textwrap.fill(t.help, width=100, initial_indent="    ", subsequent_indent="    "))


@app.command("history")
def history(name: str, deployment: Deployment, region: Region = None, as_json: AsJson = False) -> None:
    """Who changed a tunable, when, and to what (SSM parameter versions)."""
    from rich.table import Table

    store = _store_for(name, deployment, region)
    try:
        versions = store.history(name)
    except _aws_errors() as exc:
        _aws_error(exc)
    if as_json:
        typer.echo(json.dumps([_version_json(v) for v in versions], indent=2))
        return
    table = Table(title=f"{name} — {deployment}")
    for column in ("version", "value", "modified", "labels", "by"):
        table.add_column(column)
    for v in versions:
        table.add_row(str(v.get("Version")), v.get("Value", ""), str(v.get("LastModifiedDate", "")),
                      ",".join(v.get("Labels", [])), v.get("LastModifiedUser", ""))
    _console().print(table)


def _version_json(version: dict[str, Any]) -> dict[str, Any]:
    """One SSM parameter version as `history --json` prints it (the time in ISO 8601)."""
    modified = version.get("LastModifiedDate")
    return {"version": version.get("Version"), "value": version.get("Value", ""),
            "modified": modified.isoformat() if hasattr(modified, "isoformat") else modified,
            "labels": list(version.get("Labels", [])), "by": version.get("LastModifiedUser", ""),
            "description": version.get("Description", "")}


@app.command("sync")
def sync(deployment: Deployment, region: Region = None,
         out: Annotated[Path, typer.Option(help="JSON file the connector hot-reloads.")] = Path(
             catalog.DEFAULT_TUNABLES_FILE),
         quiet: Annotated[bool, typer.Option("--quiet", "-q")] = False) -> None:
    """SSM -> the engine tunables file (atomic; left untouched when a stored value is refused)."""
    from turnkv import aws_params

    store, _ = _store(deployment, region)
    try:
        changed, values = aws_params.sync(store, out)
    except catalog.ParamError as exc:
        _refuse(f"{exc}; {out} left as it was")
    except _aws_errors() as exc:
        _aws_error(exc)
    if not quiet:
        engine = {k: v for k, v in values.items() if catalog.get(k).scope is catalog.Scope.ENGINE}
        typer.echo(f"{out}: {'updated' if changed else 'unchanged'} {json.dumps(engine, sort_keys=True)}")
