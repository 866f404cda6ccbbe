"""`turnkv local up | down | status | logs`: the local stack on real vLLM CPU engines."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from turnkv import router_env
from turnkv.engine_args import Mode
from turnkv.engine_settings import SettingError
from turnkv.local.settings import engine_settings_for
from turnkv.local.stack import Accelerator, state_folder
from turnkv.local.start import start_stack

app = typer.Typer(help="Run prefill + decode vLLM engines and the router on 127.0.0.1.", no_args_is_help=True)
console = Console(stderr=True)

StateDir = Annotated[Path | None, typer.Option(
    "--state-dir", show_default=False,
    help="Where logs, state, model and caches live (default: $TURNKV_STATE_DIR, else .turnkv in the turnkv "
         "checkout, else ~/.turnkv: the same from every working directory).")]


def parse_sets(items: list[str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"{item!r}: expected NAME=VALUE", param_hint="--set")
        out[name.strip()] = value.strip()
    return out


@app.command()
def up(
    port: Annotated[int, typer.Option(help="Router port.")] = router_env.PORT,
    engine_port_base: Annotated[int, typer.Option(
        help=f"Prefill engine port; decode gets +{router_env.DECODE_PORT_OFFSET}.")] = router_env.LOCAL_PREFILL_PORT,
    side_channel_base: Annotated[int, typer.Option(
        help="First NIXL side-channel port.")] = router_env.LOCAL_SIDE_CHANNEL_BASE,
    mode: Annotated[Mode, typer.Option(help="Connector mode of every engine, both bi-directional: pull (decode "
                                            "READs prefill's KV) or push (prefill WRITEs into decode).")] = Mode.PULL,
    prefill_prefix_caching: Annotated[bool, typer.Option(
        help="Prefix caching on the prefill engine: on, as the deployment runs it; --no-prefill-prefix-caching: "
             "prefill recomputes what it does not pull (a fleet whose prefill caches lost the conversation), the "
             "setting the project's first measurements ran.")] = True,
    best_case: Annotated[bool, typer.Option(
        help="Also start a prefix-caching prefill engine and a second router on --port+1 (benchmark best case).")]
    = False,
    peer: Annotated[bool, typer.Option(
        help="Also start the peer-best arm: a prefix-caching prefill engine of its own (with the offload tier's "
             "memory as more prefix cache) and a router on --port+2 over the same decode; send it "
             "X-TurnKV-Reuse: off (docs/benchmarks.md, the three arms).")] = False,
    target_ratios: Annotated[bool, typer.Option(
        help="Hold the engines at a 1P5D p5en Qwen3-32B fleet's memory ratios (turnkv.plan.ratios): exact KV block "
             "counts, decode's retention share and host tier.")] = False,
    prefill_blocks: Annotated[int, typer.Option(
        min=2, help="With --target-ratios: the prefill HBM's KV blocks (128 tokens each); the other pools scale "
                    "from it.")] = 16,
    prefill_offload: Annotated[bool, typer.Option(
        "--prefill-offload/--no-prefill-offload", help="With --target-ratios: turnkv's prefill also holds what vLLM's "
        "CPU offloading tier would (as deployed with engines.prefill_offload_gib; the peer always does).")] = True,
    tunable: Annotated[list[str] | None, typer.Option(
        "--set", help="Tunable NAME=VALUE, e.g. decoder_kv_blocks_ttl=120 (see `turnkv params catalog`).")] = None,
    model_config: Annotated[Path | None, typer.Option(
        "--model-config", help="A deploy config (YAML/JSON): its model section's engine settings (kv_cache_dtype, "
                               "tool_call_parser, ...) on both engines, as its nodes run them; the flags below win.")]
    = None,
    kv_cache_dtype: Annotated[str | None, typer.Option(help="vllm serve --kv-cache-dtype (model.kv_cache_dtype).")]
    = None,
    tool_call_parser: Annotated[str | None, typer.Option(
        help="vllm serve --tool-call-parser, with --enable-auto-tool-choice (model.tool_call_parser).")] = None,
    reasoning_parser: Annotated[str | None, typer.Option(help="(model.reasoning_parser)")] = None,
    trust_remote_code: Annotated[bool | None, typer.Option(
        "--trust-remote-code/--no-trust-remote-code", help="(model.trust_remote_code)")] = None,
    max_num_seqs: Annotated[int | None, typer.Option(help="(model.max_num_seqs)")] = None,
    engine_arg: Annotated[list[str] | None, typer.Option(
        "--engine-arg", help="An allow-listed vllm serve flag, --flag or --flag=value (model.extra_args).")] = None,
    accelerator: Annotated[Accelerator, typer.Option(
        help="cpu: vLLM's CPU build (this venv); cuda: both engines on one GPU, from a venv with vLLM's CUDA wheel "
             "(`make gpu-smoke` builds .venv-gpu).")] = Accelerator.CPU,
    state_dir: StateDir = None,
) -> None:
    """Start one prefill and one decode real vLLM engine and the router; wait until all are healthy."""
    from turnkv import params
    from turnkv.local.stack import StackConfig

    state_dir = state_folder(state_dir)
    changes = params.fit_router_ttl(parse_sets(tunable))
    try:
        tunables = params.validate(changes)
    except params.ParamError as exc:
        raise typer.BadParameter(str(exc), param_hint="--set") from None
    try:
        settings = engine_settings_for(model_config, kv_cache_dtype=kv_cache_dtype,
                                       tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser,
                                       trust_remote_code=trust_remote_code, max_num_seqs=max_num_seqs,
                                       extra_args=None if engine_arg is None else tuple(engine_arg))
    except SettingError as exc:
        raise typer.BadParameter(str(exc)) from None
    config = StackConfig(state_dir=state_dir, router_port=port, prefill_port=engine_port_base,
                         decode_port=engine_port_base + router_env.DECODE_PORT_OFFSET,
                         side_channel_base=side_channel_base, mode=mode,
                         prefill_prefix_caching=prefill_prefix_caching, best_case=best_case, tunables=tunables,
                         accelerator=accelerator, engine_settings=settings, peer=peer)
    if target_ratios:
        from turnkv.local.stack import at_ratios
        from turnkv.plan import ratios

        config = at_ratios(config, ratios.scale(prefill_blocks=prefill_blocks, prefill_offload=prefill_offload))
    state = start_stack(config, console)
    router = state["components"]["router"]["url"]
    console.print(f"[green]local stack up[/green]: router {router} (OpenAI API: {router}/v1), "
                  f"logs in {state_dir / 'logs'}; stop with `turnkv local down`")


@app.command()
def down(state_dir: StateDir = None) -> None:
    """Stop every process the stack started (whole process groups) and remove its hot-reloaded tunables file."""
    from turnkv.local.stack import TUNABLES_FILE, Supervisor

    state_dir = state_folder(state_dir)
    stopped = Supervisor(state_dir).down(lambda name, event: console.print(f"{name}: {event}")
                                         if event == "stopping" else None)
    # The next `local up` writes its own; left behind, it read as the stack's settings (issue #49).
    (state_dir / TUNABLES_FILE).unlink(missing_ok=True)
    console.print(f"stopped {len(stopped)} process group(s)" if stopped else f"nothing was running ({state_dir})")


@app.command()
def status(state_dir: StateDir = None,
           as_json: Annotated[bool, typer.Option("--json", help="Print the components as a JSON list.")] = False,
           ) -> None:
    """Show each component: process, health, URL and log file (exit 1 when one is unhealthy or none runs)."""
    import json

    from turnkv.local.stack import Supervisor

    state_dir = state_folder(state_dir)
    rows = list(Supervisor(state_dir).status())
    if as_json:
        typer.echo(json.dumps([{"name": r["name"], "pid": r["pid"], "alive": bool(r["alive"]),
                                "healthy": bool(r["healthy"]), "url": r["url"], "log": str(r["log"])}
                               for r in rows], indent=2))
        if not rows or not all(r["healthy"] for r in rows):
            raise typer.Exit(1)
        return
    if not rows:
        console.print(f"no local stack in {state_dir} (start one with `turnkv local up`, or pass its --state-dir)")
        raise typer.Exit(1)
    # Four narrow columns (80 fit): the logs' common folder once below, not a path per row.
    table = Table("component", "pid", "state", "url")
    for r in rows:
        table.add_row(r["name"], str(r["pid"]), ("running" if r["alive"] else "[red]exited[/red]") + ", " +
                      ("[green]healthy[/green]" if r["healthy"] else "[red]unhealthy[/red]"), r["url"])
    out = Console()
    out.print(table)
    folders = {str(Path(r["log"]).parent) for r in rows}
    out.print(f"logs: {folders.pop()}/<component>.log" if len(folders) == 1 else
              "logs: " + ", ".join(str(r["log"]) for r in rows), soft_wrap=True)
    if not all(r["healthy"] for r in rows):
        raise typer.Exit(1)


@app.command()
def logs(
    component: Annotated[str | None, typer.Argument(help="router, prefill-0, decode-0, ... (default: all)")] = None,
    lines: Annotated[int, typer.Option("-n", "--lines", help="Lines to show per log.")] = 40,
    follow: Annotated[bool, typer.Option("-f", "--follow", help="Keep printing new lines.")] = False,
    emf: Annotated[bool, typer.Option("--emf", help="Also the router's CloudWatch EMF lines (one JSON object per "
                                                    "request; hidden by default).")] = False,
    state_dir: StateDir = None,
) -> None:
    """Print the logs of the stack's components."""
    log_dir = state_folder(state_dir) / "logs"
    files = sorted(log_dir.glob("*.log")) if log_dir.exists() else []
    if component:
        files = [f for f in files if f.stem == component]
        if not files:
            known = ", ".join(f.stem for f in sorted(log_dir.glob("*.log"))) if log_dir.exists() else "none"
            console.print(f"no log for {component!r}; known: {known}")
            raise typer.Exit(1)
    if not files:
        console.print(f"no logs under {log_dir}")
        raise typer.Exit(1)
    from turnkv.local.stack import EMF_MARK, tail

    if follow:
        tailing = subprocess.Popen(["tail", "-n", str(lines), "-F", *map(str, files)],
                                   stdout=None if emf else subprocess.PIPE)
        if not emf:  # the EMF lines are for CloudWatch: a person reads the rest
            subprocess.run(["grep", "--line-buffered", "-vF", EMF_MARK], stdin=tailing.stdout, check=False)
        tailing.wait()
        return
    for f in files:
        Console().rule(str(f))
        print(tail(f, lines, keep_emf=emf))
