"""Where the time of one pull goes, against recomputing the same tail, on real CPU engines as deployed.

``python -m bench.pull_cost`` starts the local stack (``turnkv.local.stack``: prefill with prefix caching on, as
deployed; one decode; the router) unless ``--router/--prefill/--decode`` name a running one, and plays
``--conversations`` conversations of ``--turns`` turns whose replies are ``--reply-tokens`` long (agent-sized: the
tail a later turn pulls is the previous reply). Every later turn runs twice, one request at a time:

- **pull**: as deployed (the router replays decode's offer; prefill's own cache serves the earlier prompt and prefill
  pulls the reply's tail from decode, unless its cost model recomputes it);
- **recompute**: the same turn with ``X-TurnKV-Reuse: off`` (prefill's own cache serves the earlier prompt and
  prefill computes the tail).

The arms never share a prefill (or decode) cache: each sends its own ``cache_salt``. Around each request the bench
reads the router's, prefill's and decode's ``/metrics``; one request at a time, the differences are that request's:

- ``router``: client TTFT less the two legs (store take, offer clearance, evictions-feed check, relay);
- ``P http``: the prefill leg (router-timed) less prefill's own end-to-end time (HTTP, tokenization, detokenization);
- ``P wait``: prefill's queue time (arrival to first scheduled step); for a pull it holds the handshake (first pull
  from an engine only: ``vllm:turnkv_handshake_seconds`` when it changes), the READ itself
  (``vllm:turnkv_read_seconds``, NIXL's own telemetry) and the rest: admission, the steps the engine polls the READ
  and the step that picks the request up after it (``admit+poll``);
- ``P compute``: scheduled to first token (the tokens neither cached nor pulled);
- ``D leg``: decode's first token, its READ of prefill's new KV included (both arms pay it).

The notification that tells decode its blocks were read travels with the READ (NIXL's notif) and is not waited for.
Output: a Markdown table per turn and a summary (medians over later pulled turns, first pull apart; the pull arm
over all its later turns, pulled or recomputed by the cost model, against the recompute arm), and JSON.
``--concurrency N`` sends every conversation's turn at once per arm instead (prefill busy: a row per batch, its
per-request means); ``--no-prefix-caching`` is ``make demo``'s setting; ``--from-json`` prints a run's tables again.

    python -m bench.pull_cost --out results/pull_cost
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from turnkv import wire

#: Prometheus families read per request (sample names, summed over labels).
ROUTER_LEG_SUM = "turnkv_router_leg_seconds_sum"
ROUTER_STORE_SUM = "turnkv_router_store_seconds_sum"
E2E_SUM = "vllm:e2e_request_latency_seconds_sum"
QUEUE_SUM = "vllm:request_queue_time_seconds_sum"
PREFILL_SUM = "vllm:request_prefill_time_seconds_sum"
READ_SECONDS = "vllm:turnkv_read_seconds_total"
READ_BYTES = "vllm:turnkv_read_bytes_total"
HANDSHAKE = "vllm:turnkv_handshake_seconds"
PULL_DECISIONS = "vllm:turnkv_decisions_total"

ARMS = ("pull", "recompute")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name: value summed over label sets}, plus ``name{label=value}`` keys for the
    ``leg`` and ``op`` labels the breakdown splits by (pure)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        try:
            number = float(value)
        except ValueError:
            continue
        name, brace, labels = head.partition("{")
        out[name] = out.get(name, 0.0) + number
        if brace:
            for part in labels.rstrip("}").split(","):
                key, _, val = part.partition("=")
                if key in ("leg", "op", "decision"):
                    labelled = f"{name}{{{key}={val.strip(chr(34))}}}"
                    out[labelled] = out.get(labelled, 0.0) + number
    return out


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


@dataclass
class Turn:
    """One request's breakdown (milliseconds unless named otherwise)."""

    arm: str
    conversation: int
    turn: int
    outcome: str = ""
    prompt_tokens: int = 0
    pulled_tokens: int = 0
    cached_tokens: int = 0
    ttft_ms: float = 0.0
    router_ms: float = 0.0
    store_ms: float = 0.0
    prefill_leg_ms: float = 0.0
    p_http_ms: float = 0.0
    p_wait_ms: float = 0.0
    handshake_ms: float = 0.0
    read_ms: float = 0.0
    read_bytes: int = 0
    admit_poll_ms: float = 0.0
    p_compute_ms: float = 0.0
    decode_leg_ms: float = 0.0
    first_pull: bool = False
    error: str | None = None

    @property
    def computed_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.pulled_tokens - self.cached_tokens)


def breakdown(turn: Turn, ttft_ms: float, before: dict[str, dict[str, float]],
              after: dict[str, dict[str, float]], handshake_changed: bool, requests: int = 1) -> Turn:
    """Fill ``turn`` from the three endpoints' metrics before and after its request, or the mean per request of a
    batch of ``requests`` sent at once (``ttft_ms``: their mean), pure."""
    r0, r1, p0, p1 = before["router"], after["router"], before["prefill"], after["prefill"]
    ms = 1000.0 / max(1, requests)
    turn.ttft_ms = ttft_ms
    turn.prefill_leg_ms = delta(r0, r1, f"{ROUTER_LEG_SUM}{{leg=prefill}}") * ms
    turn.decode_leg_ms = delta(r0, r1, f"{ROUTER_LEG_SUM}{{leg=decode}}") * ms
    turn.store_ms = delta(r0, r1, f"{ROUTER_STORE_SUM}{{op=take}}") * ms
    turn.router_ms = ttft_ms - turn.prefill_leg_ms - turn.decode_leg_ms
    e2e = delta(p0, p1, E2E_SUM) * ms
    turn.p_http_ms = turn.prefill_leg_ms - e2e
    turn.p_wait_ms = delta(p0, p1, QUEUE_SUM) * ms
    turn.p_compute_ms = delta(p0, p1, PREFILL_SUM) * ms
    turn.read_ms = delta(p0, p1, READ_SECONDS) * ms
    turn.read_bytes = int(delta(p0, p1, READ_BYTES) / max(1, requests))
    if handshake_changed:
        turn.handshake_ms = p1.get(HANDSHAKE, 0.0) * 1000.0
    turn.admit_poll_ms = turn.p_wait_ms - turn.read_ms - turn.handshake_ms if turn.read_bytes else 0.0
    return turn


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


COLUMNS = (("TTFT", "ttft_ms"), ("router", "router_ms"), ("P http", "p_http_ms"), ("P wait", "p_wait_ms"),
           ("handshake", "handshake_ms"), ("READ", "read_ms"), ("admit+poll", "admit_poll_ms"),
           ("P compute", "p_compute_ms"), ("D leg", "decode_leg_ms"))


def summary_rows(turns: list[Turn]) -> list[dict[str, Any]]:
    """Medians per group: the first pull (handshake), later pulls, turns the pull arm recomputed, and the recompute
    arm on the same turns as the later pulls (pure)."""
    ok = [t for t in turns if t.error is None and t.turn > 0]
    pulls = [t for t in ok if t.arm == "pull" and t.pulled_tokens > 0]
    later = [t for t in pulls if not t.first_pull]
    same = {(t.conversation, t.turn) for t in later}
    groups = [("pull, first (handshake)", [t for t in pulls if t.first_pull]),
              ("pull, later", later),
              ("recompute, same turns", [t for t in ok if t.arm == "recompute" and (t.conversation, t.turn) in same]),
              ("pull arm, recomputed by the cost model", [t for t in ok if t.arm == "pull" and not t.pulled_tokens]),
              ("pull arm, all later turns", [t for t in ok if t.arm == "pull"]),
              ("recompute, all later turns", [t for t in ok if t.arm == "recompute"])]
    rows = []
    for label, group in groups:
        if not group:
            continue
        row: dict[str, Any] = {"group": label, "n": len(group),
                               "pulled": _median([t.pulled_tokens for t in group]),
                               "computed": _median([t.computed_tokens for t in group]),
                               "read_kib": _median([t.read_bytes / 1024 for t in group])}
        for _, attr in COLUMNS:
            row[attr] = _median([getattr(t, attr) for t in group])
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ["group", "n", "pulled tok", "computed tok", "READ KiB", *(f"{c} ms" for c, _ in COLUMNS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["group"], str(r["n"]), f"{r['pulled']:.0f}", f"{r['computed']:.0f}", f"{r['read_kib']:.0f}",
                 *(f"{r[a]:.1f}" for _, a in COLUMNS)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def turns_markdown(turns: list[Turn]) -> str:
    head = ["conv", "turn", "arm", "outcome", "pulled", "cached", "computed", *(c for c, _ in COLUMNS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in turns:
        cells = [str(t.conversation), str(t.turn + 1), t.arm, t.error or t.outcome, str(t.pulled_tokens),
                 str(t.cached_tokens), str(t.computed_tokens), *(f"{getattr(t, a):.1f}" for _, a in COLUMNS)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratio(rows: list[dict[str, Any]], over_all: bool = False) -> float | None:
    """Later pulls' median TTFT over the recompute arm's on the same turns; ``over_all``: the pull arm's later turns
    (pulled or not: reuse as deployed) over the recompute arm's."""
    by = {r["group"]: r for r in rows}
    pull, rec = by.get("pull, later"), by.get("recompute, same turns")
    if over_all:
        pull, rec = by.get("pull arm, all later turns"), by.get("recompute, all later turns")
    if not pull or not rec or not rec["ttft_ms"]:
        return None
    return pull["ttft_ms"] / rec["ttft_ms"]


# -- I/O ------------------------------------------------------------------------------------------------------


@dataclass
class Endpoints:
    router: str
    prefill: str
    decode: str


async def scrape(session: Any, ends: Endpoints) -> dict[str, dict[str, float]]:
    async def one(url: str) -> dict[str, float]:
        async with session.get(url.rstrip("/") + "/metrics") as resp:
            return parse_metrics(await resp.text())

    router, prefill, decode = await asyncio.gather(one(ends.router), one(ends.prefill), one(ends.decode))
    return {"router": router, "prefill": prefill, "decode": decode}


async def run_batches(args: argparse.Namespace, ends: Endpoints, words: list[str]) -> list[Turn]:
    """``--concurrency N``: every conversation's turn t at once, one arm after the other (N conversations: the
    arm's load); one row per (turn, arm) with the per-request means of the batch."""
    import aiohttp

    from bench.client import Result, chat
    from bench.runner import discover_model
    from bench.workload import WorkloadSpec, build

    spec = WorkloadSpec(conversations=args.concurrency, turns=args.turns, system_words=args.system_words,
                        first_user_words=args.first_words, turn_words=args.turn_words, max_tokens=args.reply_tokens)
    conversations = build(spec, words)
    rows: list[Turn] = []
    pulled_once = False
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        model = args.model or await discover_model(session, ends.router)
        replies = {arm: {c.index: [] for c in conversations} for arm in ARMS}
        for t in range(args.turns):
            for arm in ARMS:
                headers = {wire.REUSE_HEADER: wire.REUSE_OFF} if arm == "recompute" else {}

                def body(conv: Any, arm: str = arm, t: int = t) -> dict[str, Any]:
                    return {"model": model, "messages": conv.messages_for(t, replies[arm][conv.index]),
                            "max_tokens": args.reply_tokens, "min_tokens": args.reply_tokens, "temperature": 0,
                            "stream": True, "stream_options": {"include_usage": True},
                            "cache_salt": f"pull-cost-{arm}-{args.salt}-{conv.index}"}

                await asyncio.sleep(args.settle)
                before = await scrape(session, ends)
                results = await asyncio.gather(*(chat(session, ends.router, body(c), headers,
                                                      Result(c.index, t, arm), 600) for c in conversations))
                await asyncio.sleep(args.settle)
                after = await scrape(session, ends)
                for c, r in zip(conversations, results, strict=True):
                    replies[arm][c.index].append(r.reply)
                ok = [r for r in results if r.error is None]
                errors = [r.error for r in results if r.error is not None]
                n = max(1, len(ok))
                pulled = sum(1 for r in ok if r.reused_tokens)
                row = Turn(arm, -1, t, f"{pulled}/{len(results)} pulled",
                           round(sum(r.prompt_tokens or 0 for r in ok) / n),
                           round(sum(r.reused_tokens for r in ok) / n),
                           round(sum(r.prefill_cached_tokens for r in ok) / n),
                           error=f"{len(errors)} failed: {errors[0]}" if errors else None)
                changed = after["prefill"].get(HANDSHAKE) != before["prefill"].get(HANDSHAKE)
                breakdown(row, sum(r.ttft_ms or 0.0 for r in ok) / n, before, after, changed, requests=len(results))
                if row.pulled_tokens and not pulled_once:
                    row.first_pull = pulled_once = True
                rows.append(row)
                print(f"turn {t + 1} {arm:9s} x{len(results)} {row.outcome:12s} pulled {row.pulled_tokens:5d} "
                      f"computed {row.computed_tokens:5d} mean TTFT {row.ttft_ms:7.1f} ms  P wait "
                      f"{row.p_wait_ms:6.1f} READ {row.read_ms:5.1f} P compute {row.p_compute_ms:6.1f} "
                      f"D {row.decode_leg_ms:6.1f}" + (f"  ERROR {row.error}" if row.error else ""),
                      file=sys.stderr, flush=True)
    return rows


async def run(args: argparse.Namespace, ends: Endpoints, words: list[str]) -> list[Turn]:
    if args.concurrency > 1:
        return await run_batches(args, ends, words)
    import aiohttp

    from bench.client import Result, chat
    from bench.runner import discover_model
    from bench.workload import WorkloadSpec, build

    spec = WorkloadSpec(conversations=args.conversations, turns=args.turns, system_words=args.system_words,
                        first_user_words=args.first_words, turn_words=args.turn_words, max_tokens=args.reply_tokens)
    conversations = build(spec, words)
    turns: list[Turn] = []
    pulled_once = False
    async with aiohttp.ClientSession() as session:
        model = args.model or await discover_model(session, ends.router)
        replies = {arm: {c.index: [] for c in conversations} for arm in ARMS}
        for conv in conversations:
            for t in range(args.turns):
                for arm in ARMS:
                    body = {"model": model, "messages": conv.messages_for(t, replies[arm][conv.index]),
                            "max_tokens": args.reply_tokens, "min_tokens": args.reply_tokens, "temperature": 0,
                            "stream": True, "stream_options": {"include_usage": True},
                            "cache_salt": f"pull-cost-{arm}-{args.salt}"}
                    headers = {wire.REUSE_HEADER: wire.REUSE_OFF} if arm == "recompute" else {}
                    await asyncio.sleep(args.settle)  # the engines publish stats per step
                    before = await scrape(session, ends)
                    result = await chat(session, ends.router, body, headers, Result(conv.index, t, arm), 300)
                    await asyncio.sleep(args.settle)  # the engines publish stats per step
                    after = await scrape(session, ends)
                    replies[arm][conv.index].append(result.reply)
                    turn = Turn(arm, conv.index, t, result.reuse_outcome, result.prompt_tokens or 0,
                                result.reused_tokens, result.prefill_cached_tokens, error=result.error)
                    changed = after["prefill"].get(HANDSHAKE) != before["prefill"].get(HANDSHAKE)
                    breakdown(turn, result.ttft_ms or 0.0, before, after, changed)
                    if turn.pulled_tokens and not pulled_once:
                        turn.first_pull = pulled_once = True
                    turns.append(turn)
                    print(f"conv {conv.index} turn {t + 1} {arm:9s} {turn.outcome or '-':10s} pulled "
                          f"{turn.pulled_tokens:4d} cached {turn.cached_tokens:5d} computed {turn.computed_tokens:4d} "
                          f"TTFT {turn.ttft_ms:7.1f} ms  P wait {turn.p_wait_ms:6.1f} READ {turn.read_ms:5.1f} "
                          f"P compute {turn.p_compute_ms:6.1f} D {turn.decode_leg_ms:6.1f}"
                          + (f"  ERROR {turn.error}" if turn.error else ""), file=sys.stderr, flush=True)
    return turns


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.pull_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("results/pull_cost"))
    p.add_argument("--conversations", type=int, default=3)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system-words", type=int, default=300)
    p.add_argument("--first-words", type=int, default=400)
    p.add_argument("--turn-words", type=int, default=60, help="New words each later turn (a short tool result).")
    p.add_argument("--reply-tokens", type=int, default=144, help="Reply length (min_tokens = max_tokens): the tail "
                                                                  "the next turn pulls.")
    p.add_argument("--settle", type=float, default=0.3, help="Seconds before each scrape (stats are per step).")
    p.add_argument("--salt", default=str(int(time.time())), help="Per-run cache salt (fresh caches per run).")
    p.add_argument("--router", help="A running router (with --prefill and --decode); default: start the stack.")
    p.add_argument("--prefill")
    p.add_argument("--decode")
    p.add_argument("--model", default=None)
    p.add_argument("--state-dir", type=Path, default=Path(".turnkv"))
    p.add_argument("--label", default="", help="A name for this run in the JSON (before/after).")
    p.add_argument("--concurrency", type=int, default=1,
                   help="N conversations at once per arm (the arm's load): rows are per-request means of each "
                        "(turn, arm) batch; 1: one request at a time, a row per request.")
    p.add_argument("--from-json", type=Path, help="Print the tables of an earlier run's pull_cost.json.")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="Prefill without prefix caching (the seeds' setting, `make demo`'s reuse-on arm): a pull then "
                        "moves the whole history and the recompute arm computes it all.")
    return p


def report(args: argparse.Namespace, turns: list[Turn]) -> dict[str, Any]:
    rows = summary_rows(turns)
    r, a = ratio(rows), ratio(rows, over_all=True)
    at_once = int(getattr(args, "concurrency", 1) or 1)
    how = "one request at a time" if at_once <= 1 else \
        f"{at_once} conversations at once per arm; each row of a group is a batch's per-request means"
    text = ["## Fixed cost of a pull" + (f" ({args.label})" if args.label else ""), "",
            f"Medians, milliseconds; {how}.", "", markdown(rows), "",
            f"pull / recompute TTFT on the same turns: {r:.2f}" if r else "no later pulls to compare",
            f"pull arm / recompute arm TTFT over all later turns (pulled or not): {a:.2f}" if a else "", "",
            "### Per turn", "", turns_markdown(turns)]
    md = "\n".join(text)
    print(md)
    args.out.mkdir(parents=True, exist_ok=True)
    data = {"label": args.label, "args": {k: str(v) for k, v in vars(args).items()}, "summary": rows,
            "pull_over_recompute": r, "pull_arm_over_recompute_arm": a,
            "turns": [{**asdict(t), "computed_tokens": t.computed_tokens} for t in turns]}
    (args.out / "pull_cost.json").write_text(json.dumps(data, indent=2))
    (args.out / "pull_cost.md").write_text(md + "\n")
    return data


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from turnkv.local.model import load_words

    if args.from_json:  # the tables again from a run's JSON (no engines)
        data = json.loads(args.from_json.read_text())
        names = {f.name for f in fields(Turn)}
        turns = [Turn(**{k: v for k, v in t.items() if k in names}) for t in data["turns"]]
        args.label = args.label or data.get("label", "")
        report(args, turns)
        return 0

    if args.router:
        if not (args.prefill and args.decode):
            print("--router needs --prefill and --decode (their /metrics)", file=sys.stderr)
            return 2
        from turnkv.local.stack import StackConfig

        ends = Endpoints(args.router, args.prefill, args.decode)
        turns = asyncio.run(run(args, ends, load_words(StackConfig(state_dir=args.state_dir).model_dir)))
        report(args, turns)
        return 0
    from turnkv.local.stack import StackConfig, Supervisor
    from turnkv.local.start import start_stack

    # prefill prefix caching on: as deployed (unless --no-prefix-caching)
    config = StackConfig(state_dir=args.state_dir, prefill_prefix_caching=not args.no_prefix_caching)
    state = start_stack(config)
    try:
        comps = state["components"]
        ends = Endpoints(comps["router"]["url"], comps["prefill-0"]["url"], comps["decode-0"]["url"])
        turns = asyncio.run(run(args, ends, load_words(config.model_dir)))
    finally:
        Supervisor(args.state_dir).down()
    report(args, turns)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
