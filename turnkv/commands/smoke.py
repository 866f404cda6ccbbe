"""`turnkv smoke`: the last step of a deploy. The logic is ``turnkv.smoke``; this renders it and sets the exit code
(0 passed, 1 failed, 2 bad arguments: the reason is printed)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Annotated

import typer

from turnkv import node_env


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
    via_ssm: Annotated[bool, typer.Option(
        "--via-ssm", help="Reach an internal ALB from outside the VPC: Session Manager port forwarding through one "
                          "of the deployment's engine nodes (needs --deployment, --region, the AWS CLI and its "
                          "Session Manager plugin). Prints the command it runs.")] = False,
    deployment: Annotated[str | None, typer.Option("--deployment", "-d", envvar=node_env.DEPLOYMENT,
                                                   help="With --via-ssm: the deployment's name.")] = None,
    region: Annotated[str | None, typer.Option("--region", envvar=node_env.REGION,
                                               help="With --via-ssm: the deployment's region.")] = None,
    local_port: Annotated[int, typer.Option("--local-port", help="With --via-ssm: the tunnel's local port.")
                          ] = 18080,
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
    if via_ssm:
        with _ssm_tunnel(url, deployment, region, local_port) as tunneled:
            # an internal ALB's certificate names your domain, never 127.0.0.1: TLS is checked by the ALB's DNS
            # name only without the tunnel
            result = asyncio.run(lib.run(tunneled, api_key=api_key, model=model, turns=turns, timeout_s=timeout,
                                         verify_tls=False))
    else:
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


@contextlib.contextmanager
def _ssm_tunnel(url: str, deployment: str | None, region: str | None, local_port: int):
    """Start ``aws ssm start-session`` port forwarding to the ALB through an engine node, yield the local URL, stop
    the session afterwards."""
    import shlex
    import socket
    import subprocess
    import time

    from rich.console import Console

    from turnkv import tunnel

    err = Console(stderr=True, highlight=False)
    if not deployment or not region:
        err.print("[red]refused:[/red] --via-ssm needs --deployment NAME and --region REGION (the node it tunnels "
                  "through is one of the deployment's engine nodes)")
        raise typer.Exit(2)
    try:
        host, port = tunnel.remote(url)
        import boto3

        ec2 = boto3.client("ec2", region_name=region)
        node = tunnel.pick_node(ec2.describe_instances(Filters=tunnel.describe_filters(deployment))["Reservations"])
    except tunnel.TunnelError as exc:
        err.print(f"[red]refused:[/red] {exc}")
        raise typer.Exit(2) from None
    except Exception as exc:  # credentials, region, permissions
        err.print(f"[red]AWS error:[/red] {exc}")
        raise typer.Exit(1) from None
    command = tunnel.start_session_command(region, node, host, port, local_port)
    typer.echo(f"tunnel: {shlex.join(command)}")
    session = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if session.poll() is not None:
                err.print(f"[red]the tunnel did not start[/red] (exit {session.returncode}): "
                          f"{session.stderr.read().decode(errors='replace')[-800:] if session.stderr else ''}")
                raise typer.Exit(1)
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", local_port), timeout=1):
                break
            time.sleep(1)
        yield tunnel.local_url(url, local_port)
    finally:
        session.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            session.wait(timeout=10)
