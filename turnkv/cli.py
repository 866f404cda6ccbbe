"""The ``turnkv`` command line: one typer app, one sub-app per responsibility.

Sub-apps live in ``turnkv/commands/`` and import their heavy dependencies (vLLM, aiohttp, boto3)
lazily, so ``turnkv --help`` stays fast.
"""

from __future__ import annotations

from typing import Annotated

import typer

from turnkv.commands import bench, config, demo, doctor, engine, local, params, plan, router, smoke

app = typer.Typer(
    name="turnkv",
    help="Multi-turn KV reuse for P/D-disaggregated vLLM: local stack, router, benchmark, AWS tuning.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)


def _version() -> str:
    """turnkv's installed version (the package metadata), with the vLLM and NIXL it is pinned to."""
    from importlib.metadata import PackageNotFoundError, version

    from turnkv import versions

    try:
        mine = version("turnkv")
    except PackageNotFoundError:  # run from a source tree that was never installed
        mine = "unknown (not installed)"
    return f"turnkv {mine} (vLLM {versions.VLLM_GPU}, NIXL {versions.NIXL})"


def _show_version(value: bool) -> None:
    if value:
        typer.echo(_version())
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[bool, typer.Option("--version", "-V", callback=_show_version, is_eager=True,
                                          help="Print turnkv's version (and the vLLM and NIXL it pins) and exit.")]
    = False,
) -> None:
    """Multi-turn KV reuse for P/D-disaggregated vLLM: local stack, router, benchmark, AWS tuning."""


app.add_typer(local.app, name="local")
app.add_typer(router.app, name="router")
app.add_typer(bench.app, name="bench")
app.add_typer(params.app, name="params")
app.add_typer(engine.app, name="engine")
app.add_typer(plan.app, name="plan")
app.add_typer(config.app, name="config")
app.command(name="doctor")(doctor.doctor)
app.command(name="demo")(demo.demo)
app.command(name="smoke")(smoke.smoke)


if __name__ == "__main__":
    app()
