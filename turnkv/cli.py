"""The ``turnkv`` command line: one typer app, one sub-app per responsibility.

Sub-apps live in ``turnkv/commands/`` and import their heavy dependencies (vLLM, aiohttp, boto3)
lazily, so ``turnkv --help`` stays fast.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from turnkv.commands import bench, config, demo, doctor, engine, local, params, plan, router, smoke


def _fold_option_names() -> None:
    """typer's help cuts an option's name to its column's width ("--engine-port-ba…" at 80 columns): its option
    cells (and a help cell's long default) fold instead, so the whole name shows, over two lines where it must.
    typer offers no setting for it: the module's functions that build those cells are wrapped."""
    from typer import rich_utils

    def folding(highlighter: Any) -> Any:
        class Folding(type(highlighter)):  # type: ignore[misc]
            def __call__(self, text: Any) -> Any:
                out = super().__call__(text)
                out.overflow = "fold"
                return out

        return Folding()

    rich_utils.highlighter = folding(rich_utils.highlighter)
    rich_utils.negative_highlighter = folding(rich_utils.negative_highlighter)
    help_cell = rich_utils._get_parameter_help  # the help column's cell: a long default ends in "…" too

    def folded_help(*args: Any, **kwargs: Any) -> Any:
        out = help_cell(*args, **kwargs)  # rich Columns of Text pieces (help, default, env var)
        for piece in out.renderables:
            piece.overflow = "fold"
        return out

    rich_utils._get_parameter_help = folded_help


_fold_option_names()

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
