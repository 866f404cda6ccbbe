"""Start the local stack with a progress display (``turnkv local up``, ``turnkv plan calibrate``, bench).

A library function, not a command: the CLI, the planner's calibration and ``bench/plan_accuracy.py`` all call
:func:`start_stack`; ``turnkv/commands/local.py`` is the CLI over it.
"""

from __future__ import annotations

import time

import typer
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

console = Console(stderr=True)


def start_stack(config, console: Console = console) -> dict:
    """Start the stack with a progress display; raise typer.Exit(1) with the reason on failure."""
    from turnkv.local.stack import StackError, Supervisor

    supervisor = Supervisor(config.state_dir)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                  transient=False) as progress:
        tasks: dict[str, int] = {}
        started: dict[str, float] = {}

        def on_event(name: str, event: str) -> None:
            if name not in tasks:
                tasks[name] = progress.add_task(f"{name}: {event}", total=1)
                started[name] = time.monotonic()
            elif event in ("healthy", "ready"):
                took = time.monotonic() - started[name]
                progress.update(tasks[name], description=f"{name}: {event} ({took:.0f} s)", completed=1)
            else:
                progress.update(tasks[name], description=f"{name}: {event}")

        try:
            return supervisor.up(config, on_event)
        except StackError as exc:
            progress.stop()
            console.print(f"[red]turnkv local up failed:[/red] {exc}")
            raise typer.Exit(1) from None
