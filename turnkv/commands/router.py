"""`turnkv router`."""

from __future__ import annotations

import typer

app = typer.Typer(help="router", no_args_is_help=True)
