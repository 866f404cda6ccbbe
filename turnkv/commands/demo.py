"""`turnkv demo`: local stack up, the multi-turn benchmark's three arms (no prefix cache, peer-best, turnkv as
deployed; ``bench.arms``) and the best case, stack down."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from turnkv import router_env

if TYPE_CHECKING:
    from turnkv.local.stack import StackConfig

console = Console(stderr=True)

#: The pressure row: a small device share, so that twice what fits is a handful of conversations, and a host tier
#: large enough for all of them.
PRESSURE_SHARE = 0.01
PRESSURE_HOST_MIB = 256


def demo(
    out: Annotated[Path, typer.Option(help="Where the benchmark writes its report.")] = Path("results/demo"),
    port: Annotated[int, typer.Option(help="Router port (the best-case router uses port+1).")] = router_env.PORT,
    conversations: Annotated[int, typer.Option(min=1)] = 3,
    turns: Annotated[int, typer.Option(min=2)] = 8,
    reply_tokens: Annotated[int, typer.Option(
        min=1, help="Tokens of each reply: agent-sized (tool calls, code), Mooncake's ~350-token replies scaled "
                    "by 1/4 as in bench.pressure --agent.")] = 96,
    state_dir: Annotated[Path | None, typer.Option(help="State folder of the local stack (default: `turnkv "
                                                      "local`'s).")] = None,
    load: Annotated[int, typer.Option(min=0, help="Then this many shorter conversations at once, reuse off "
                                                  "and on (0: skip).")] = 8,
    pressure: Annotated[bool, typer.Option(help="Then twice the conversations decode's retention room holds, "
                                                "device only and with the host tier (bench.pressure).")] = True,
) -> None:
    """Show the gain end to end: ~4,000-token agentic conversations, TTFT of turnkv as deployed against peer-best (a
    prefix-caching prefill, no reuse: what you would run instead), no prefix cache (reuse off, a fresh cache salt
    per request) and the best case (a prefill whose cache holds the previous prompt)."""
    from bench.runner import RunSpec
    from bench.workload import WorkloadSpec
    from turnkv.commands.bench import run_benchmark
    from turnkv.local.model import load_words
    from turnkv.local.stack import StackConfig, Supervisor, state_folder, tunables_file
    from turnkv.local.start import start_stack

    state_dir = state_folder(state_dir)

    # turnkv as deployed: prefix caching on prefill. The off arm salts every request (prefill recomputes it all);
    # peer-best and best share the prefix-cached prefill engine under salts of their own (bench.runner), so no arm
    # finds another's blocks. A host tier on decode (allocated at start): the pressure row
    # turns it on and off by reload.
    config = StackConfig(prefill_prefix_caching=True, state_dir=state_dir, router_port=port, best_case=True,
                         tunables={"host_kv_budget_mib": PRESSURE_HOST_MIB})
    section("turnkv demo: starting the local stack", "prefill, decode, a prefix-cached prefill, 2 routers")
    state = start_stack(config)
    try:
        if pressure:
            # First, while decode holds no one's turns: the row's device room must start empty (an evicted turn
            # keeps its room for retention_eviction_grace, longer than the row takes).
            section("retention pressure", f"twice the conversations decode's room holds (retained_kv_share "
                                          f"{PRESSURE_SHARE}), device only, then with the host tier")
            pressure_rows(state, config, out / "pressure")
        workload = WorkloadSpec(conversations=conversations, turns=turns, max_tokens=reply_tokens)
        section("multi-turn: turnkv against peer-best, no prefix cache and the best case",
                f"{conversations} conversations x {turns} turns, ~{workload.approx_last_prompt()} prompt tokens by "
                "the last turn")
        best = state["components"]["router-best"]["url"]
        spec = RunSpec(url=state["components"]["router"]["url"], workload=workload, ab=True, best_url=best,
                       peer_url=best, words=load_words(config.model_dir))
        summary = run_benchmark(spec, out, {"stack": "local", "workload": workload.__dict__})
        if load:
            section("under load", f"{load} conversations at once, reuse off then on")
            load_row(state["components"]["router"]["url"], load, out / "load", load_words(config.model_dir))
    finally:
        console.rule("stopping the local stack")
        Supervisor(state_dir).down()
        # Nothing left behind: the next `turnkv local up` writes its own file anyway (turnkv.local.stack).
        tunables_file(config).unlink(missing_ok=True)
    if summary["errors"]:
        console.print(f"[red]{summary['errors']} request(s) failed[/red]: {summary['error_samples']}")
        raise typer.Exit(1)


def section(title: str, detail: str = "") -> None:
    """A part of the demo: a rule with a short title (a long one was cut at 80 columns), then what it plays."""
    console.rule(title)
    if detail:
        console.print(detail, highlight=False)


def load_row(url: str, conversations: int, out: Path, words: list[str]) -> dict:
    """The capacity benchmark at one level, 4 short turns: TTFT p50/p90 with reuse off and on under load."""
    import asyncio

    from bench import capacity
    from turnkv.commands.bench import request_progress, result_callback

    args = capacity.parser().parse_args(["--turns", "4"])
    workload = capacity.workload(args)
    with request_progress("under load") as progress:
        on_result = result_callback(progress, capacity.total_requests([conversations], args.turns))
        swept = asyncio.run(capacity.sweep(url, workload, [conversations], args.stagger, on_result, words=words))
    result = capacity.write(swept, out, None, {"workload": workload.__dict__, "stagger_s": args.stagger})
    print(capacity.markdown(result, per_turn=False), flush=True)
    console.print(f"wrote {out / 'capacity.md'} and {out / 'capacity.json'} (`turnkv bench capacity` sweeps levels)")
    return result


def pressure_rows(state: dict, config: StackConfig, out: Path) -> None:
    """bench.pressure's quick row at 2x on the demo's running stack: the share lowered and the host tier off, then
    on (both hot-reloaded through the engines' tunables file), each level's reuse share and TTFT printed; then the
    stack's own values again for the rest of the demo (``config``: its StackConfig)."""
    import json
    import time

    from bench import pressure, pressure_report
    from turnkv.local.stack import tunables_file, write_tunables_file

    components = state["components"]
    tunables = tunables_file(config)
    try:
        for row, (name, host_mib) in enumerate((("device only", 0), ("host tier", PRESSURE_HOST_MIB))):
            tunables.write_text(json.dumps({"retained_kv_share": PRESSURE_SHARE, "host_kv_budget_mib": host_mib}))
            time.sleep(1.5)  # the connector re-reads the file at most once a second
            result = pressure.quick(out / name.replace(" ", "-"), url=components["router"]["url"],
                                    decode_url=components["decode-0"]["url"],
                                    prefill_url=components["prefill-0"]["url"],
                                    variant=f"{name}=retained_kv_share={PRESSURE_SHARE}", levels="2",
                                    # each row its own words: the second row would otherwise find the first row's
                                    # prompts, replies included, in prefill's prefix cache and pull nothing
                                    seed=7 + 100 * row)
            pressure_report.show(result)
    finally:
        write_tunables_file(config)
        time.sleep(1.5)
