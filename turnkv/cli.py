"""The ``turnkv`` command line: one typer app, one sub-app per responsibility.

Sub-apps live in ``turnkv/commands/`` and import their heavy dependencies (vLLM, aiohttp, boto3)
lazily, so ``turnkv --help`` stays fast.
"""

from __future__ import annotations

import typer

from turnkv.commands import bench, config, demo, doctor, engine, local, params, plan, router, smoke

app = typer.Typer(
    name="turnkv",
    help="Multi-turn KV reuse for P/D-disaggregated vLLM: local stack, router, benchmark, AWS tuning.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
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
