"""`turnkv router serve`: the KV-cache-aware P/D router."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from turnkv import router_env

app = typer.Typer(help="The KV-cache-aware P/D router.", no_args_is_help=True)


@app.command()
def serve(
    prefill: Annotated[list[str] | None, typer.Option(
        "--prefill", help="Prefill engine URL (repeatable); identity for push mode as a query: "
                          "http://H:P?engine_id=ID&side_channel_port=N[&side_channel_host=H&tp_size=N].")] = None,
    decode: Annotated[list[str] | None, typer.Option("--decode", help="Decode engine URL (repeatable).")] = None,
    host: Annotated[str | None, typer.Option(help="Address to listen on (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(min=1, max=65535,
                                             help=f"Port to listen on (default {router_env.PORT}).")] = None,
    config_file: Annotated[Path | None, typer.Option(
        "--config", help="Settings file (JSON or TOML): the flags' names with _, and 'set' for tunables.")] = None,
    mode: Annotated[str | None, typer.Option(help="KV transfer mode: pull, or push (concurrent P and D).")] = None,
    discovery: Annotated[str | None, typer.Option(help="Engines from 'static' flags or 'cloudmap'.")] = None,
    namespace: Annotated[str | None, typer.Option(help="Cloud Map namespace (with --discovery cloudmap).")] = None,
    service: Annotated[str | None, typer.Option(help="Cloud Map service (default engines).")] = None,
    region: Annotated[str | None, typer.Option(help="AWS region (Cloud Map, SSM).", envvar=router_env.REGION)] = None,
    aws_endpoint_url: Annotated[str | None, typer.Option(help="AWS endpoint override (tests).")] = None,
    store: Annotated[str | None, typer.Option(
        help="Conversation store: 'memory' (one replica) or redis://HOST:PORT (rediss:// for TLS).")] = None,
    api_keys_file: Annotated[str | None, typer.Option(
        help="API keys file (JSON or lines KEY / TENANT:KEY); also TURNKV_API_KEYS. None: open.")] = None,
    key_secret_file: Annotated[Path | None, typer.Option(
        help="File with the conversation-key HMAC secret (else TURNKV_KEY_SECRET, else shared in the store).")
    ] = None,
    offer_secret_file: Annotated[Path | None, typer.Option(
        help="File with the engines' offer secret, to clear the offers the router replays (else "
             "TURNKV_OFFER_SECRET / TURNKV_OFFER_SECRET_FILE; without it prefill recomputes every turn).")] = None,
    deployment: Annotated[str | None, typer.Option(
        help="Deployment name (SSM paths, EMF dimension).", envvar=router_env.DEPLOYMENT)] = None,
    ssm: Annotated[bool | None, typer.Option(
        "--ssm/--no-ssm", help="Re-read tunables from SSM every params_refresh seconds (default: on with "
                               "--discovery cloudmap).")
    ] = None,
    side_channel_host: Annotated[list[str] | None, typer.Option(
        help="Extra NIXL side-channel address a replayed remote_host may name (repeatable).")] = None,
    policy: Annotated[str | None, typer.Option(help="Engine choice: least_load or round_robin.")] = None,
    session_hint: Annotated[list[str] | None, typer.Option(
        help="Where clients send session ids, header:NAME or body:FIELD (repeatable; replaces the default "
             "list). Hints steer decode affinity and label metrics; reuse never depends on them.")] = None,
    emf: Annotated[bool | None, typer.Option("--emf/--no-emf", help="One EMF log line per request (default on).")
                   ] = None,
    keepalive_timeout: Annotated[float | None, typer.Option(
        help="Seconds an idle client connection stays open (default 75); behind a load balancer, longer than its idle "
             "timeout.")] = None,
    tunable: Annotated[list[str] | None, typer.Option(
        "--set", help="Override a tunable, NAME=VALUE (see `turnkv params catalog`); repeatable.")] = None,
    allow_open: Annotated[bool, typer.Option(
        "--allow-open", help="Serve without API keys on a non-loopback address (anyone reaching it is served).")
    ] = False,
) -> None:
    """Serve the OpenAI-compatible POST /v1/chat/completions and /v1/completions, POST /v1/responses (OpenAI
    Responses) and /v1/messages (Anthropic Messages), translated to chat completions, over prefill + decode engines;
    with POST /v1/conversations/lease (extend a conversation's retained KV), GET /v1/models (decode's), and the ops
    routes GET /health, /ready and /metrics (Prometheus)."""
    from router import config as router_config
    from router.app import check_open_mode, load_keys
    from router.app import serve as run
    from router.engines import parse_engine

    changes: dict[str, str] = {}
    for item in tunable or []:
        name, sep, value = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"{item!r}: expected NAME=VALUE", param_hint="--set")
        changes[name.strip()] = value
    try:
        file_values = router_config.load_file(config_file) if config_file else {}
        flags = dict(prefill=prefill, decode=decode, host=host, port=port, mode=mode, discovery=discovery,
                     namespace=namespace, service=service, region=region, aws_endpoint_url=aws_endpoint_url,
                     store=store, api_keys_file=api_keys_file, deployment=deployment, ssm=ssm,
                     side_channel_hosts=side_channel_host, policy=policy, emf=emf,
                     keepalive_timeout=keepalive_timeout, allow_open=allow_open or None,
                     session_hints=session_hint)
        if key_secret_file:
            flags["key_secret"] = key_secret_file.read_text().strip().encode()
        if offer_secret_file:
            offer_secret = offer_secret_file.read_text().strip()
            if not offer_secret:
                raise ValueError(f"{offer_secret_file} is empty: it should hold the engines' offer secret")
            flags["offer_secret"] = offer_secret.encode()
        merged_discovery = flags["discovery"] or file_values.get("discovery")
        if flags["ssm"] is None and "ssm" not in file_values and merged_discovery == "cloudmap":
            flags["ssm"] = True
        config = router_config.build(file_values, flags, changes)
        for role, specs in (("prefill", config.prefill), ("decode", config.decode)):
            for spec in specs:  # refused here, not as a traceback from the app's start
                parse_engine(spec, role)
        check_open_mode(config, load_keys(config))
    except (ValueError, OSError) as exc:
        typer.echo(f"turnkv router: {exc}", err=True)
        raise typer.Exit(2) from None
    run(config)
