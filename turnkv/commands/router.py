"""`turnkv router serve`: the KV-cache-aware P/D router."""

from __future__ import annotations

from typing import Annotated

import typer

from turnkv import params

app = typer.Typer(help="The KV-cache-aware P/D router.", no_args_is_help=True)


@app.command()
def serve(
    prefill: Annotated[list[str], typer.Option("--prefill", help="Prefill engine URL (repeatable).")],
    decode: Annotated[list[str], typer.Option("--decode", help="Decode engine URL (repeatable).")],
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    tunable: Annotated[list[str] | None, typer.Option(
        "--set", help="Override a tunable, NAME=VALUE (see `turnkv params list`); repeatable.")] = None,
) -> None:
    """Serve OpenAI-compatible /v1/chat/completions and /v1/completions over prefill + decode engines."""
    from router.app import serve as run
    from router.config import RouterConfig

    changes: dict[str, str] = {}
    for item in tunable or []:
        name, sep, value = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"{item!r}: expected NAME=VALUE", param_hint="--set")
        changes[name.strip()] = value
    try:
        values = params.validate(changes)
        config = RouterConfig(prefill=prefill, decode=decode, host=host, port=port, tunables=values)
    except ValueError as exc:
        typer.echo(f"turnkv router: {exc}", err=True)
        raise typer.Exit(2) from None
    run(config)
