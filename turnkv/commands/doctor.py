"""`turnkv doctor`: check an engine node (or an image being baked) for the EFA / NIXL / driver field failures."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from turnkv import doctor as checks

_STYLE = {"pass": "green", "fail": "bold red", "skip": "yellow"}


def doctor(
    flavor: Annotated[str | None, typer.Option(
        "--flavor", help="gpu or neuron (default: what the AMI recorded, else gpu).")] = None,
    image: Annotated[bool, typer.Option(
        "--image", help="Image Builder instance: no EFA interface, so no EFA device is required.")] = False,
    retry_seconds: Annotated[float, typer.Option(
        "--retry-seconds", min=0, help="How long to wait for late EFA devices.")] = 60.0,
    vram_mib: Annotated[int, typer.Option(
        "--vram-mib", min=1, help="CUDA memory to register with LIBFABRIC (gpu-memory-registration).")] = 1024,
    host_tier_mib: Annotated[int | None, typer.Option(
        "--host-tier-mib", min=1, help="Host tier to plan, pin, register and READ (host-tier-registration; default: "
        "the decode engine's host_kv_budget_mib).")] = None,
    python: Annotated[str | None, typer.Option(
        "--python", help="Interpreter whose vLLM / NIXL / torch to check (default /opt/turnkv/venv).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
) -> None:
    """Check EFA, NIXL (LIBFABRIC), GPUDirect RDMA, driver/CUDA, CUDA memory registration with LIBFABRIC, the
    pinned versions, every engine's env file, devices and ports, and decode's host tier (its per-rank pools
    registered and READ by a second NIXL agent) on this node."""
    node = checks.real_node(python)
    chosen = flavor or checks.detect_flavor(node)
    if chosen not in checks.FLAVORS:
        raise typer.BadParameter(f"{chosen!r} is not one of {', '.join(checks.FLAVORS)}", param_hint="--flavor")
    opts = checks.Options(flavor=chosen, image=image, retry_seconds=retry_seconds, vram_mib=vram_mib,
                          host_tier_mib=host_tier_mib)
    results = checks.run_checks(node, opts)
    bad = checks.failed(results)
    if as_json:
        typer.echo(json.dumps({"flavor": chosen, "image": image, "ok": not bad,
                               "checks": [r.as_dict() for r in results]}, indent=2))
    else:
        print_table(results, chosen, image)
    if bad:
        raise typer.Exit(1)


def print_table(results: list[checks.CheckResult], flavor: str, image: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"turnkv doctor ({flavor}{', image build' if image else ''})", show_lines=True)
    for column in ("check", "status", "detail", "fix"):
        table.add_column(column, overflow="fold")
    for r in results:
        table.add_row(r.name, f"[{_STYLE[r.status.value]}]{r.status.value}[/]", r.detail, r.fix)
    console = Console()
    console.print(table)
    failed = [r.name for r in results if r.status is checks.Status.FAIL]
    summary = f"[bold red]{len(failed)} failed: {', '.join(failed)}[/]" if failed else "[green]all checks passed[/]"
    console.print(summary)
