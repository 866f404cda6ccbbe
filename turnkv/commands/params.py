"""`turnkv params`: list, get and set the tunables in SSM Parameter Store (infra issue)."""

from __future__ import annotations

import typer

app = typer.Typer(help="Read and change the tunables in SSM Parameter Store.", no_args_is_help=True)
