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
    """Play a short multi-turn conversation through the endpoint: turns 2+ must reuse the previous turn (pulled
    from decode, or found in prefill's prefix cache after the router replayed decode's turn) and answer exactly as
    with reuse off. Prints TTFT and the tokens reused per turn."""
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
        # Short headers: the table fits 80 columns (each term is defined in the caption).
        for column in ("turn", "TTFT off ms", "TTFT on ms", "outcome", "pulled", "cached", "reuse", "same"):
            table.add_column(column, justify="right")
        for row in lib.summary_rows(result):
            table.add_row(str(row["turn"]), f"{row['ttft_off_ms']:,.1f}", f"{row['ttft_on_ms']:,.1f}", row["outcome"],
                          f"{row['reused_tokens']:,}", f"{row['prefill_cached']:,}", row["reuse"],
                          "yes" if row["same_answer"] else "NO")
        table.caption = ("off: reuse off, a cache salt of its own; on: as a client sends it. pulled: tokens read "
                         "from decode; cached: found in prefill's own prefix cache; same: answers equal")
        console.print(table)
    if not result.ok:
        Console(stderr=True, highlight=False).print(f"[red]smoke test failed:[/red] {result.failure}")
        raise typer.Exit(1)
    console.print(f"[green]smoke test passed:[/green] {lib.passed_line(result)}")
