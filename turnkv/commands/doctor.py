"""`turnkv doctor`: check an engine node (AMI issue)."""

from __future__ import annotations

import typer


def doctor() -> None:
    """Check EFA, NIXL, GPUDirect RDMA, driver/CUDA and the pinned versions on this node."""
    typer.echo("turnkv doctor: not implemented yet (AMI issue)", err=True)
    raise typer.Exit(2)
