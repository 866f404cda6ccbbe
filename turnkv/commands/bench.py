"""`turnkv bench multiturn`: the agentic multi-turn TTFT benchmark (A/B: reuse off vs on); `turnkv bench agent`: an
agent trace (forks, subagents, think times) played the same way."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from turnkv import router_env
from turnkv.commands import renamed

app = typer.Typer(help="Benchmarks.", no_args_is_help=True)
console = Console(stderr=True)


def request_progress(label: str) -> Progress:
    """A progress bar over benchmark requests; ``on_result`` below advances it."""
    return Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[last]}"),
                    TimeElapsedColumn(), console=console)


def result_callback(progress: Progress, total: int):
    """The runner's per-result callback: advance the bar and show the last turn's TTFT or error."""
    task = progress.add_task("bench", total=total, last="")

    def on_result(r) -> None:
        last = (f"conv {r.conversation} turn {r.turn + 1} {r.arm}: "
                + (f"TTFT {r.ttft_ms:.0f} ms" if r.error is None else f"[red]{r.error[:60]}[/red]"))
        progress.update(task, advance=1, last=last)

    return on_result


def run_benchmark(spec, out: Path, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run ``spec`` with a progress bar, write the report to ``out`` and print the table."""
    from bench import report, runner

    with request_progress("multi-turn") as progress:
        on_result = result_callback(progress, spec.total_requests)

        try:
            results = asyncio.run(runner.run(spec, on_result))
        except Exception as exc:  # connection refused, no models, ...
            progress.stop()
            console.print(f"[red]benchmark failed:[/red] {type(exc).__name__}: {exc} (is the router at {spec.url} up?)")
            raise typer.Exit(1) from None
    summary = report.write(results, out, meta)
    Console().print(report.markdown(summary))
    console.print(f"wrote {out / 'summary.md'}, {out / 'summary.json'}, {out / 'results.jsonl'} and the chart "
                  f"[bold]{out / 'ttft.png'}[/bold]")
    shared = report.shared_prefill_cache(results)
    if shared:
        console.print(f"[yellow]warning[/yellow]: {shared}", soft_wrap=True)
    return summary


@app.command()
def multiturn(
    url: Annotated[str, typer.Option(help="Router (or any OpenAI-compatible) base URL.")] = router_env.LOCAL_URL,
    out: Annotated[Path, typer.Option(help="Folder for results.jsonl, summary.md/json and ttft.png.")] = Path(
        "results/bench"),
    ab: Annotated[bool, typer.Option("--ab", help="Play every conversation with reuse off and on (interleaved turn "
                                                  "by turn; with --concurrency above 1, one arm after the other).")]
    = False,
    phased: Annotated[bool | None, typer.Option(
        "--phased/--interleaved", help="Arms one after the other, or interleaved turn by turn (default: phased when "
                                       "--concurrency is above 1, so neither arm queues behind the other's requests).")]
    = None,
    best_url: Annotated[str | None, typer.Option(help="Router over a prefix-caching prefill engine (best case).")]
    = None,
    conversations: Annotated[int, typer.Option(min=1, help="Conversations.")] = 3,
    turns: Annotated[int, typer.Option(min=1, help="Turns per conversation.")] = 8,
    system_words: Annotated[int, typer.Option(min=0, help="Shared system prompt length (words ~ tokens).")] = 500,
    first_user_words: Annotated[int, typer.Option(min=1, help="First user message length.")] = 700,
    turn_words: Annotated[int, typer.Option(min=1, help="Words each later turn appends (tool/user text).")] = 380,
    max_tokens: Annotated[int, typer.Option(min=1, help="Reply length in tokens.")] = 32,
    concurrency: Annotated[int, typer.Option(min=1, help="Conversations in flight at once.")] = 1,
    think_time: Annotated[float, typer.Option(min=0, help="Seconds between turns.")] = 0.0,
    model: Annotated[str | None, typer.Option(help="Model name (default: the first of /v1/models).")] = None,
    api_key: Annotated[str | None, typer.Option(envvar="TURNKV_API_KEY", help="Bearer token for the router.")]
    = None,
    seed: Annotated[int, typer.Option(help="Workload seed.")] = 7,
    workload_file: Annotated[Path | None, typer.Option(
        "--workload", help="A `turnkv plan` workload file (vLLM multi-turn generator JSON + num_clients, "
                           "think_time_s): conversations, lengths, concurrency and think times come from it.")] = None,
) -> None:
    """Measure TTFT per turn of agentic conversations; with --ab, reuse off vs on in one run."""
    from bench.runner import RunSpec
    from bench.workload import WorkloadSpec, from_workload_file

    workload = WorkloadSpec(conversations=conversations, turns=turns, system_words=system_words,
                            first_user_words=first_user_words, turn_words=turn_words, max_tokens=max_tokens, seed=seed)
    convs, meta = None, {"url": url, "workload": workload.__dict__}
    if workload_file is not None:
        from turnkv.plan.workload import WorkloadError, load

        try:
            planned = load(workload_file)
        except WorkloadError as exc:
            console.print(f"[red]--workload: {exc}[/red]")
            raise typer.Exit(2) from None
        convs = from_workload_file(planned, seed=seed)
        concurrency = planned.num_clients
        meta = {"url": url, "workload_file": str(workload_file)}
    spec = RunSpec(url=url, workload=workload, ab=ab, best_url=best_url, model=model, concurrency=concurrency,
                   think_time=think_time, api_key=api_key, conversations=convs, phased=phased)
    summary = run_benchmark(spec, out, {**meta, "concurrency": spec.concurrency,
                                        "arms_in_phases": spec.arms_in_phases})
    if summary["errors"]:
        raise typer.Exit(1)


@app.command()
def agent(
    ctx: typer.Context,
    trace: Annotated[str, typer.Option(help="An agent trace file (bench/agent_trace.py's format), or the name of a "
                                            "shipped one: agent-coding, agent-research.")] = "agent-coding",
    url: Annotated[str, typer.Option(help="Router base URL (the on and off arms).")] = router_env.LOCAL_URL,
    router: Annotated[str | None, typer.Option("--router", hidden=True)] = None,
    best_url: Annotated[str | None, typer.Option(help="Router over a prefix-caching prefill engine (the best arm).")]
    = None,
    best_router: Annotated[str | None, typer.Option("--best-router", hidden=True)] = None,
    peer_url: Annotated[str | None, typer.Option(help="The peer-best router (`turnkv local up --peer`: port + 2): "
                                                      "a prefix-caching prefill of its own, no reuse.")] = None,
    arms: Annotated[str | None, typer.Option(help="Comma list of off, on, best, peer, played in that order (default: "
                                                  "off,on, plus best with --best-url and peer with --peer-url).")]
    = None,
    time_scale: Annotated[float, typer.Option(min=0, help="Multiply every think time of the trace (0: no pauses).")]
    = 1.0,
    model: Annotated[str | None, typer.Option(help="Model name (default: the first of /v1/models).")] = None,
    api_key: Annotated[str | None, typer.Option(envvar="TURNKV_API_KEY", help="Bearer token for the router.")]
    = None,
    out: Annotated[Path, typer.Option(help="Folder for results.jsonl and summary.md/json.")] = Path("results/agent"),
) -> None:
    """Play an agent trace (shared prefix, parallel tool calls, forks, subagents, think times) with reuse off and on:
    TTFT p50/p90 per arm and step kind, prompt tokens by source (prefill cache, pulled from decode, recomputed), fork
    turns that pulled, identical answers."""
    from bench import agent_bench, agent_report, agent_trace

    url = renamed(ctx, "url", "router")
    best_url = renamed(ctx, "best_url", "best_router")
    try:
        loaded = agent_trace.load(trace)
        spec = agent_bench.PlaySpec(url=url, arms=agent_bench.parse_arms(
            arms or agent_bench.default_arms(best_url, peer_url)), best_url=best_url, peer_url=peer_url, model=model,
            api_key=api_key, time_scale=time_scale)
    except ValueError as exc:  # a bad trace (agent_trace.TraceError) or arms
        console.print(str(exc), soft_wrap=True, markup=False, style="red")
        raise typer.Exit(2) from None
    sessions = agent_trace.expand(loaded)
    shape = agent_trace.stats(sessions)
    console.print(f"{loaded.name}: {shape.sessions} sessions, {shape.requests} requests per arm "
                  f"({', '.join(f'{k} {v}' for k, v in shape.kinds.items())}), arms {','.join(spec.arms)}",
                  soft_wrap=True, markup=False)
    with request_progress("agent") as progress:
        task = progress.add_task("agent", total=agent_bench.total_requests(sessions, spec.arms), last="")

        def on_record(r) -> None:
            last = (f"{r.arm} session {r.session} {r.agent} step {r.step + 1} {r.kind}: "
                    + (f"TTFT {r.ttft_ms:.0f} ms" if r.error is None else f"[red]{r.error[:60]}[/red]"))
            progress.update(task, advance=1, last=last)

        try:
            records = asyncio.run(agent_bench.play(sessions, spec, on_record))
        except Exception as exc:  # connection refused, no models, ...
            progress.stop()
            where = f"{spec.url}" + (f" and {spec.best_url}" if "best" in spec.arms else "")
            console.print(f"agent benchmark failed: {type(exc).__name__}: {exc} (is the router at {where} up?)",
                          soft_wrap=True, markup=False, style="red")
            raise typer.Exit(1) from None
    summary = agent_report.write(records, out, {"trace": loaded.name, "trace_file": str(agent_trace.resolve(trace)),
                                                "url": spec.url, "best_url": spec.best_url,
                                                "peer_url": spec.peer_url, "arms": list(spec.arms),
                                                "off_salted": True,
                                                "time_scale": time_scale})
    print(agent_report.markdown(summary), flush=True)  # plain: a table is not wrapped at the terminal's width
    console.print(f"wrote {out / 'summary.md'}, {out / 'summary.json'} and {out / 'results.jsonl'}")
    shared = agent_report.shared_prefill_cache(summary)
    if shared:
        console.print(f"[yellow]warning[/yellow]: {shared}", soft_wrap=True)
    if summary["errors"] or summary["answers"]["mismatch_count"]:
        raise typer.Exit(1)


@app.command()
def capacity(
    ctx: typer.Context,
    url: Annotated[str, typer.Option(help="Router (or any OpenAI-compatible) base URL.")] = router_env.LOCAL_URL,
    concurrency_levels: Annotated[str, typer.Option(
        help="Comma list of concurrency levels: conversations at once (closed loop).")] = "1,2,4,8,16",
    levels: Annotated[str | None, typer.Option("--levels", hidden=True)] = None,
    turns: Annotated[int, typer.Option(min=2, help="Turns per conversation.")] = 6,
    system_words: Annotated[int, typer.Option(min=0, help="Shared system prompt length (words ~ tokens).")] = 200,
    first_user_words: Annotated[int, typer.Option(min=1, help="First user message length.")] = 300,
    turn_words: Annotated[int, typer.Option(min=1, help="Words each later turn appends.")] = 200,
    max_tokens: Annotated[int, typer.Option(min=1, help="Reply length in tokens.")] = 16,
    seed: Annotated[int, typer.Option(help="Workload seed.")] = 11,
    stagger: Annotated[float, typer.Option(min=0, help="Seconds between conversation starts.")] = 0.2,
    ttft_target_ms: Annotated[float | None, typer.Option(
        help="TTFT p90 target in ms (default: twice the reuse-off p90 of the lowest level).")] = None,
    model: Annotated[str | None, typer.Option(help="Model name (default: the first of /v1/models).")] = None,
    api_key: Annotated[str | None, typer.Option(envvar="TURNKV_API_KEY", help="Bearer token for the router.")]
    = None,
    out: Annotated[Path, typer.Option(help="Folder for capacity.md/json and capacity.png.")] = Path(
        "results/capacity"),
    records: Annotated[bool, typer.Option(help="Also write every request (level, arm, turn, TTFT, latency, tokens, "
                                               "reuse) to records.jsonl: what `turnkv plan twin --fit` reads.")]
    = False,
) -> None:
    """Concurrency sweep, reuse off and on in one run: TTFT p50/p90 per level and turn, reuse share, and the
    highest load each variant sustains under a TTFT target."""
    from bench import capacity as cap

    try:
        level_list = cap.parse_levels(renamed(ctx, "concurrency_levels", "levels"))
    except ValueError as exc:
        console.print(f"[red]{exc}[/red]", soft_wrap=True)
        raise typer.Exit(2) from None
    args = cap.parser().parse_args([])
    args.__dict__.update(turns=turns, system_words=system_words, first_user_words=first_user_words,
                         turn_words=turn_words, max_tokens=max_tokens, seed=seed)
    workload = cap.workload(args)
    meta = {"url": url, "workload": workload.__dict__, "stagger_s": stagger}
    rows: list[dict[str, Any]] = []
    with request_progress("capacity") as progress:
        advance = result_callback(progress, cap.total_requests(level_list, turns))

        def on_result(r) -> None:
            advance(r)
            rows.append({"level": level_list[min(len(done_levels), len(level_list) - 1)], **r.to_json()})

        done_levels: list[int] = []

        def on_level(done: list[dict[str, Any]]) -> None:
            done_levels[:] = [lv["concurrency"] for lv in done]
            cap.write(done, out, ttft_target_ms, meta)
            if records:
                (out / "records.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))

        try:
            swept = asyncio.run(cap.sweep(url, workload, level_list, stagger, on_result, model=model,
                                          api_key=api_key, on_level=on_level))
        except Exception as exc:  # connection refused, no models, ...
            progress.stop()
            console.print(f"[red]capacity benchmark failed:[/red] {type(exc).__name__}: {exc} "
                          f"(is the router at {url} up?)")
            raise typer.Exit(1) from None
    result = cap.write(swept, out, ttft_target_ms, meta)
    print(cap.markdown(result), flush=True)  # plain: a table is not wrapped at the terminal's width
    console.print(f"wrote {out / 'capacity.md'}, {out / 'capacity.json'} and the chart [bold]{out / 'capacity.png'}"
                  "[/bold]")
    if any(level[arm]["errors"] for level in swept for arm in cap.ARMS):
        raise typer.Exit(1)


@app.command()
def modes(
    modes: Annotated[str, typer.Option(help="Comma list of connector modes (pull is the baseline).")] = "pull,push",
    conversations: Annotated[int, typer.Option(min=1, help="Conversations.")] = 3,
    turns: Annotated[int, typer.Option(min=1, help="Turns per conversation.")] = 8,
    max_tokens: Annotated[int, typer.Option(min=1, help="Reply length in tokens.")] = 32,
    port_base: Annotated[int, typer.Option(help="Router port of the stack; engines at +10 and +20.")] = 8400,
    out: Annotated[Path, typer.Option(help="Folder for summary.md/json, ttft.png and one folder per mode.")] = Path(
        "results/modes"),
) -> None:
    """TTFT per turn by connector mode, on the local stack started once per mode: push + bi-directional,
    pull + bi-directional and reuse off, in one run."""
    from bench import modes as bench_modes
    from turnkv.local.stack import StackError

    args = bench_modes.parser().parse_args(["--modes", modes, "--conversations", str(conversations), "--turns",
                                            str(turns), "--max-tokens", str(max_tokens), "--port-base",
                                            str(port_base), "--out", str(out)])
    try:
        count = len(bench_modes.parse_modes(modes))
    except ValueError as exc:
        console.print(f"[red]{exc}[/red]", soft_wrap=True)
        raise typer.Exit(2) from None
    with request_progress("modes") as progress:
        on_result = result_callback(progress, count * conversations * turns * 2)
        try:
            result = bench_modes.run(args, on_result, say=progress.console.print)
        except StackError as exc:
            progress.stop()
            console.print(f"[red]modes benchmark failed:[/red] {exc}", soft_wrap=True)
            raise typer.Exit(2) from None
    if any(m["errors"] for m in result["modes"].values()):
        raise typer.Exit(1)


@app.command()
def router(
    ctx: typer.Context,
    targets: Annotated[str, typer.Option(help="Comma list: direct,turnkv,vllm-router,vllm-router-rr (round_robin: "
                                               "no render and tokenize calls),fastapi,turnkv-valkey (one replica on "
                                               "a Valkey store),turnkv-2x (two replicas on it).")]
    = "direct,turnkv,vllm-router,fastapi",
    concurrency_levels: Annotated[str, typer.Option(help="Comma list of concurrency levels (requests in flight).")]
    = "1,32,128",
    concurrency: Annotated[str | None, typer.Option("--concurrency", hidden=True)] = None,
    reply_tokens: Annotated[str, typer.Option(help="Comma list of reply lengths; two or more split CPU per request "
                                                   "into a fixed cost and a cost per relayed event.")] = "16",
    event_writes: Annotated[bool, typer.Option(help="The fake engine writes one event at a time, as vLLM does.")]
    = False,
    requests: Annotated[int, typer.Option(help="Requests per level (32, 128) and round.")] = 2000,
    requests_c1: Annotated[int, typer.Option(help="Requests at concurrency 1, per round.")] = 300,
    rounds: Annotated[int, typer.Option(help="Interleaved rounds (median requests/s).")] = 3,
    memory: Annotated[int, typer.Option(help="Also measure a MemoryStore holding this many conversations.")] = 0,
    rate: Annotated[str, typer.Option(help="Open loop: comma list of requests/s offered to every target alike "
                                           "(--concurrency-levels caps requests in flight); CPU per request compares "
                                           "fairly only at equal load. Empty: closed loop.")] = "",
    router_cpus: Annotated[str, typer.Option(help="Pin every router to these CPUs (comma list) and the client and "
                                                  "fake engines to the others, e.g. 1: a 1-vCPU task's share. "
                                                  "Empty: no pinning.")] = "",
    port_base: Annotated[int, typer.Option(help="Router ports base; fake engines at +100 and +200.")] = 28000,
    out: Annotated[Path, typer.Option(help="Folder for peers.json and peers.md.")] = Path("results/router-peers"),
) -> None:
    """The router against direct access, vllm-router and a FastAPI+httpx proxy, on a fake instant engine."""
    from bench import router_peers

    levels = renamed(ctx, "concurrency_levels", "concurrency")
    try:
        args = router_peers.parser().parse_args([
            "--targets", targets, "--concurrency-levels", levels, "--reply-tokens", reply_tokens, "--requests",
            str(requests), "--requests-c1", str(requests_c1), "--rounds", str(rounds), "--memory", str(memory),
            "--port-base", str(port_base), "--out", str(out), *(["--event-writes"] if event_writes else []),
            *(["--rate", rate] if rate else []), *(["--router-cpus", router_cpus] if router_cpus else [])])
    except SystemExit as exc:  # argparse printed what is wrong (e.g. a rate that is not a positive number)
        raise typer.Exit(2) from exc
    router_peers.run(args)


@app.command("fault-load")
def fault_load(
    engines: Annotated[str, typer.Option(help="fake (bench.fake_engine) or real (vLLM CPU, 2P+2D).")] = "fake",
    duration: Annotated[float, typer.Option(help="Seconds of load.")] = 120,
    conversations: Annotated[int, typer.Option(help="Conversations in flight.")] = 64,
    kill_every: Annotated[float, typer.Option(help="Seconds between engine kills.")] = 10,
    restart_after: Annotated[float, typer.Option(help="Seconds before a killed engine restarts.")] = 5,
    out: Annotated[Path, typer.Option(help="Folder for fault_load.json.")] = Path("results/fault-load"),
) -> None:
    """Many conversations while engines are killed and restarted: errors, reuse, wrong reuse, router memory."""
    import asyncio as aio

    from bench import fault_load as fl

    args = fl.parser().parse_args(["--engines", engines, "--duration", str(duration), "--conversations",
                                   str(conversations), "--kill-every", str(kill_every), "--restart-after",
                                   str(restart_after), "--out", str(out)])
    report = aio.run(fl.main(args))
    if report["client_errors"] or report["wrong_reuse"]:
        raise typer.Exit(1)


@app.command()
def pressure(
    levels: Annotated[str, typer.Option(help="Comma list of multiples of the conversations that fit decode's "
                                             "retention room.")] = "0.5,1,2,4,8",
    variant: Annotated[list[str] | None, typer.Option(
        help='NAME=KEY=VALUE,... engine tunables of one stack (repeatable), e.g. "host tier=retained_kv_share=0.02,'
             'host_kv_budget_mib=512". Default: "device only" (retained_kv_share=0.02) and "host tier" (+ '
             'host_kv_budget_mib=512). With --url: one, naming the running stack.')] = None,
    url: Annotated[str | None, typer.Option(help="A router already up instead of local stacks of our own.")] = None,
    decode_url: Annotated[str | None, typer.Option(help="With --url: decode's base URL (/metrics).")] = None,
    decode_pid: Annotated[int | None, typer.Option(help="With --url: decode's pid (host RSS).")] = None,
    prefill_url: Annotated[str | None, typer.Option(help="With --url: prefill's base URL (pulls by tier).")] = None,
    fit: Annotated[int | None, typer.Option(min=1, help="Conversations that fit (default: from decode's /metrics).")]
    = None,
    turns: Annotated[int, typer.Option(min=2, help="Turns per conversation.")] = 4,
    think: Annotated[str, typer.Option(help="fixed:S, exp:MEAN (seeded) or file (with --workload).")] = "fixed:35",
    workload_file: Annotated[Path | None, typer.Option("--workload", help="A `turnkv plan` workload file.")] = None,
    system_words: Annotated[int, typer.Option(min=0, help="Shared system prompt length (words ~ tokens).")] = 200,
    first_user_words: Annotated[int, typer.Option(min=1, help="First user message length.")] = 300,
    turn_words: Annotated[int, typer.Option(min=1, help="Words each later turn appends.")] = 200,
    max_tokens: Annotated[int, typer.Option(min=1, help="Reply length in tokens.")] = 16,
    seed: Annotated[int, typer.Option(help="Workload and think-time seed.")] = 7,
    stagger: Annotated[float, typer.Option(min=0, help="Seconds between conversation starts.")] = 0.2,
    max_minutes: Annotated[float, typer.Option(min=1, help="No turn starts after this many minutes.")] = 120,
    max_conversations: Annotated[int, typer.Option(min=1, help="Levels needing more conversations are skipped.")]
    = 256,
    stack_per: Annotated[str, typer.Option(help="level (a fresh stack per level) or variant.")] = "level",
    port_base: Annotated[int, typer.Option(help="Router port of our stacks; engines at +10 and +20.")] = 8700,
    quick: Annotated[bool, typer.Option("--quick", help="make demo's short mode: levels 1,2, 3 short turns, 1 s "
                                                        "think, one stack (retained_kv_share 0.01); overrides those "
                                                        "options.")] = False,
    agent: Annotated[bool, typer.Option("--agent", help="Three arms (no prefix cache: reuse off "
                                                        "and a fresh cache salt per request; peer-best: a "
                                                        "prefix-caching prefill, no reuse; turnkv as deployed) "
                                                        "on agent traffic at a 1P5D p5en fleet's memory "
                                                        "ratios (docs/benchmarks.md); overrides those options, "
                                                        "--levels aside.")] = False,
    ttft_target_ms: Annotated[float, typer.Option(min=1, help="With --agent: capacity is counted at this TTFT p90 of "
                                                              "turns 2+.")] = 1000.0,
    out: Annotated[Path, typer.Option(help="Folder for summary.json, results.jsonl and pressure.png.")] = Path(
        "results/pressure"),
) -> None:
    """Retention pressure: live conversations against decode's retention room (0.5x to 8x what fits), reuse share,
    TTFT p50/p90 with reuse on and off, identical answers, evictions and refusals by reason, bytes per tier."""
    import aiohttp

    from bench import pressure as bench_pressure
    from bench import pressure_report
    from turnkv.local.stack import StackError

    argv = ["--levels", levels, "--turns", str(turns), "--think", think, "--system-words", str(system_words),
            "--first-user-words", str(first_user_words), "--turn-words", str(turn_words), "--max-tokens",
            str(max_tokens), "--seed", str(seed), "--stagger", str(stagger), "--max-minutes", str(max_minutes),
            "--max-conversations", str(max_conversations), "--stack-per", stack_per, "--port-base", str(port_base),
            "--out", str(out)]
    for v in variant or ():
        argv += ["--variant", v]
    for flag, value in (("--url", url), ("--decode-url", decode_url), ("--decode-pid", decode_pid),
                        ("--prefill-url", prefill_url), ("--fit", fit),
                        ("--workload", workload_file)):
        if value is not None:
            argv += [flag, str(value)]
    argv += ["--ttft-target-ms", str(ttft_target_ms)]
    args = bench_pressure.parser().parse_args([*argv, *(["--quick"] if quick else []), *(["--agent"] if agent else [])])
    try:
        opts, variants, target = bench_pressure.options(args)
    except (ValueError, OSError) as exc:
        console.print(f"[red]{exc}[/red]", soft_wrap=True)
        raise typer.Exit(2) from None
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[last]}"), TimeElapsedColumn(), console=console) as progress:
        current: dict[str, Any] = {}

        def on_level_start(name: str, level: float, n: int) -> None:
            current["task"] = progress.add_task(f"{name} {level:g}x ({n} conversations)",
                                                total=n * opts.turns * max(2, len(opts.arms)), last="")

        def on_result(r) -> None:
            last = (f"conv {r.conversation} turn {r.turn + 1} {r.arm}: "
                    + (f"TTFT {r.ttft_ms:.0f} ms" if r.error is None else f"[red]{r.error[:60]}[/red]"))
            if "task" in current:
                progress.update(current["task"], advance=1, last=last)

        try:
            result = bench_pressure.run(opts, variants, out, url=target, state_dir=args.state_dir,
                                        port_base=port_base, stack_per=stack_per, on_result=on_result,
                                        on_level_start=on_level_start, say=progress.console.print)
        except (StackError, RuntimeError, OSError, aiohttp.ClientError) as exc:  # a router down or not a router
            progress.stop()
            console.print(f"[red]pressure benchmark failed:[/red] {type(exc).__name__}: {exc}", soft_wrap=True)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:  # the stack it started is already down (bench.pressure.stack_target)
            progress.stop()
            console.print(f"interrupted; the levels done so far are in {out / 'summary.json'}")
            raise typer.Exit(130) from None
    if opts.arms:
        from bench import arms

        for v in result["variants"]:
            Console().print(arms.markdown(pressure_report.played(v["levels"]), opts.ttft_target_ms))
    else:
        pressure_report.show(result)
    for v in result["variants"]:
        console.print(pressure_report.fit_line(v), soft_wrap=True)
    console.print(f"wrote {out / 'summary.json'}, {out / 'results.jsonl'} and the chart [bold]{out / 'pressure.png'}"
                  "[/bold]")
    if any(lv.get("errors_on") or lv.get("errors_off") for v in result["variants"] for lv in v["levels"]):
        raise typer.Exit(1)


@app.command("hostile")
def hostile(
    duration: Annotated[float, typer.Option(help="Seconds per phase (quiet, hostile) and round.")] = 15,
    rounds: Annotated[int, typer.Option(help="Quiet and hostile phases, alternated this many times.")] = 3,
    conversations: Annotated[int, typer.Option(help="Bystander conversations at once.")] = 8,
    honest_conversations: Annotated[int, typer.Option(
        help="Conversations of the heavy-but-honest tenant in the hostile phase (0: none).")] = 16,
    compute: Annotated[str, typer.Option(
        help="The fake engines' time (bench.engine_clock): a modelled GPU engine, or instant.")] = "",
    isolate: Annotated[bool, typer.Option(help="The router on a core of its own, the attacker at nice 19.")] = True,
    batch_streams: Annotated[int, typer.Option(
        help="Long unary generations a batch tenant keeps running in the hostile phase (0: none).")] = 0,
    decode_seqs: Annotated[int | None, typer.Option(
        help="Sequences the fake decode engine runs at once (max_num_seqs; default vLLM's on H100/H200); the "
             "router's decode_fair_sequences follows it.")] = None,
    out: Annotated[Path, typer.Option(help="Folder for hostile_load.json.")] = Path("results/hostile"),
) -> None:
    """One tenant attacks the router (fake engines with modelled GPU time, loopback) while a heavy-but-honest one
    streams as fast as it is served and a third runs multi-turn streams: router RSS and CPU, the bystander's TTFT
    against quiet phases and its errors, the attacker's refusals by limit, the honest tenant's turns per second."""
    import asyncio as aio

    from bench import hostile_load as hl

    argv = ["--duration", str(duration), "--rounds", str(rounds), "--conversations", str(conversations),
            "--honest-conversations", str(honest_conversations), "--out", str(out), *(["--isolate"] if isolate else []),
            "--batch-streams", str(batch_streams), *(["--decode-seqs", str(decode_seqs)] if decode_seqs else [])]
    args = hl.parser().parse_args([*argv, *(["--compute", compute] if compute else [])])
    report = aio.run(hl.main(args))
    if report["bystander"]["hostile"]["errors"] or report["router_rss_mib"]["peak_share_of_task"] > 0.5:
        raise typer.Exit(1)
