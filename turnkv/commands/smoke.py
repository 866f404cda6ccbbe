"""`turnkv smoke`: the last step of a deploy. The logic is ``turnkv.smoke``; this renders it and sets the exit code
(0 passed, 1 failed, 2 bad arguments: the reason is printed)."""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer


def smoke(
    url: Annotated[str, typer.Option("--url", help="The router's base URL, e.g. https://<ALB DNS name>.")],
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="TURNKV_API_KEY",
                                                help="An API key (Authorization: Bearer).")] = None,
    model: Annotated[str | None, typer.Option("--model", help="Model name; default: the first /v1/models lists.")
                     ] = None,
    turns: Annotated[int | None, typer.Option(
        "--turns", help="Conversation turns to play, 2 .. 4 (default: 4).")] = None,
    timeout: Annotated[float, typer.Option("--timeout", min=1, help="Seconds for the whole test.")] = 300.0,
    insecure: Annotated[bool, typer.Option(
        "--insecure", help="Skip the TLS certificate check (the ALB's own DNS name with a certificate for your "
                           "domain); better: --url https://<your domain>.")] = False,
) -> None:
    """Play a short multi-turn conversation through the endpoint: turns 2+ must reuse KV and answer exactly as
    with reuse off. Prints TTFT per turn."""
    from rich.console import Console
    from rich.table import Table

    from turnkv import smoke as lib

    turns = len(lib.PROMPTS) if turns is None else turns
    if problem := lib.argument_problem(url.rstrip("/"), turns):
        Console(stderr=True, highlight=False).print(f"[red]refused:[/red] {problem}")
        raise typer.Exit(2)
    result = asyncio.run(lib.run(url, api_key=api_key, model=model, turns=turns, timeout_s=timeout,
                                 verify_tls=not insecure))
    console = Console(highlight=False)
    if result.turns:
        table = Table(title=f"turnkv smoke: {result.url} ({result.model})")
        for column in ("turn", "TTFT reuse off (ms)", "TTFT reuse on (ms)", "reuse outcome", "reused tokens",
                       "same answer"):
            table.add_column(column, justify="right")
        for row in lib.summary_rows(result):
            table.add_row(str(row["turn"]), f"{row['ttft_off_ms']:,.1f}", f"{row['ttft_on_ms']:,.1f}", row["outcome"],
                          f"{row['reused_tokens']:,}", "yes" if row["same_answer"] else "NO")
        console.print(table)
    if not result.ok:
        Console(stderr=True, highlight=False).print(f"[red]smoke test failed:[/red] {result.failure}")
        raise typer.Exit(1)
    console.print(f"[green]smoke test passed:[/green] turns 2-{len(result.turns)} reused KV and every answer matched "
                  "reuse off")
