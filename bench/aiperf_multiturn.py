"""aiperf multi-turn chat against the local stack, reuse on vs off in one run (a benchmark, not CI).

aiperf (``aiperf==0.13.0``, a client we do not control) plays synthetic conversations, threads the
live replies into each history and tags each session with ``X-Correlation-ID``; it sends no turnkv
field. The stack (1 prefill + 1 decode vLLM CPU engine, the router) is started once; aiperf runs twice
over it: ``on`` as is, ``off`` with ``X-TurnKV-Reuse: off``. Per turn: TTFT from aiperf's own records
(client side), and the reused tokens from the router's EMF line of each request, matched by session
and order (the router labels each line with the session hint). Prefill's
``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`` is read before and after each arm.

aiperf lives in its own venv (its pins differ from vLLM's): ``make aiperf`` creates ``.venv-aiperf``.

    python -m bench.aiperf_multiturn --out results/aiperf
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.variants import stack_with_env
from turnkv import wire

ROOT = Path(__file__).resolve().parent.parent
PULLED = "vllm:prompt_tokens_by_source_total"


def find_aiperf(given: str | None) -> str:
    for candidate in (given, os.environ.get("AIPERF"), str(ROOT / ".venv-aiperf" / "bin" / "aiperf"),
                      shutil.which("aiperf")):
        if candidate and Path(candidate).is_file():
            return candidate
    raise SystemExit("aiperf not found: run `make aiperf` (creates .venv-aiperf with aiperf==0.13.0), or pass "
                     "--aiperf PATH / set AIPERF")


def prefill_pulled(url: str) -> float:
    from tests.e2e.client import metric

    return metric(url, PULLED, source="external_kv_transfer")


def hub_alias(model_dir: Path, hf_home: Path, name: str = "turnkv/tiny") -> str:
    """Expose the tiny model's tokenizer as a cached hub repo: aiperf 0.13 offline resolves every tokenizer
    name through ``snapshot_download`` (a local folder is refused as an invalid repo id)."""
    repo = hf_home / "hub" / ("models--" + name.replace("/", "--"))
    snapshot = repo / "snapshots" / "local"
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text("local")
    for f in model_dir.iterdir():
        if f.suffix in (".json", ".txt") and not (snapshot / f.name).exists():
            (snapshot / f.name).symlink_to(f.resolve())
    return name


def aiperf_command(aiperf: str, args: argparse.Namespace, url: str, tokenizer: str, out: Path,
                   headers: dict[str, str]) -> list[str]:
    cmd = [aiperf, "profile", "--model", "tiny", "--url", url, "--endpoint-type", "chat", "--streaming",
           "--tokenizer", str(tokenizer), "--conversation-num", str(args.conversations),
           "--conversation-turn-mean", str(args.turns), "--conversation-turn-stddev", "0",
           "--synthetic-input-tokens-mean", str(args.input_tokens), "--synthetic-input-tokens-stddev", "0",
           "--output-tokens-mean", str(args.output_tokens), "--output-tokens-stddev", "0",
           "--concurrency", str(args.concurrency), "--random-seed", str(args.seed), "--artifact-dir", str(out),
           "--ui-type", "none"]
    for name, value in headers.items():
        cmd += ["--header", f"{name}:{value}"]
    return cmd


def read_records(artifacts: Path) -> list[dict[str, Any]]:
    """aiperf's per-request export (one JSON object per line)."""
    found = sorted(artifacts.rglob("profile_export.jsonl"))
    if not found:
        raise SystemExit(f"aiperf wrote no profile_export.jsonl under {artifacts}")
    return [json.loads(line) for line in found[0].read_text().splitlines() if line.strip()]


def _value(metric: Any) -> float | None:
    if isinstance(metric, dict):
        metric = metric.get("value")
    return float(metric) if isinstance(metric, (int, float)) else None


def ttft_by_turn(records: list[dict[str, Any]]) -> dict[int, list[float]]:
    """Client-side TTFT (ms) by turn; the turn is aiperf's ``turn_index``, else the request's rank in its session."""
    out: dict[int, list[float]] = defaultdict(list)
    rank: dict[str, int] = defaultdict(int)
    for rec in sorted(records, key=lambda r: (r.get("metadata") or {}).get("request_start_ns") or 0):
        meta, metrics = rec.get("metadata") or {}, rec.get("metrics") or {}
        ttft = _value(metrics.get("time_to_first_token"))
        turn = meta.get("turn_index")
        if not isinstance(turn, int):
            session = str(meta.get("x_correlation_id") or meta.get("conversation_id") or "")
            turn, rank[session] = rank[session], rank[session] + 1
        if ttft is not None:
            out[turn].append(ttft)
    return out


def emf_lines(log: Path, offset: int) -> list[dict[str, Any]]:
    lines = []
    with log.open("rb") as f:
        f.seek(offset)
        for raw in f:
            raw = raw.strip()
            if raw.startswith(b"{") and b'"_aws"' in raw:
                lines.append(json.loads(raw))
    return lines


def reuse_by_turn(lines: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Router EMF lines grouped by turn: the n-th request of a session is its turn n."""
    seen: dict[str, int] = defaultdict(int)
    out: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for line in lines:
        session = line.get("session")
        if not session or line.get("route") != "/v1/chat/completions":
            continue
        out[seen[session]].append(line)
        seen[session] += 1
    return out


def table(arms: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    turns = sorted(set(arms["on"]["ttft"]) | set(arms["off"]["ttft"]))
    for turn in turns:
        on, off = arms["on"]["ttft"].get(turn, []), arms["off"]["ttft"].get(turn, [])
        emf = arms["on"]["reuse"].get(turn, [])
        reused = [int(x.get("ReusedTokens") or 0) for x in emf]
        prompts = [int(x.get("prompt_tokens") or 0) for x in emf]
        row = {"turn": turn + 1, "requests": len(on),
               "ttft_on_p50_ms": round(statistics.median(on), 1) if on else None,
               "ttft_off_p50_ms": round(statistics.median(off), 1) if off else None,
               "prompt_tokens_mean": round(statistics.mean(prompts)) if prompts else None,
               "reused_tokens_mean": round(statistics.mean(reused)) if reused else None,
               "turns_with_reuse": f"{sum(1 for r in reused if r > 0)}/{len(reused)}",
               "outcomes": dict(sorted({o: sum(1 for x in emf if x.get("ReuseOutcome") == o)
                                        for o in {x.get("ReuseOutcome") for x in emf}}.items()))}
        if row["ttft_on_p50_ms"] and row["ttft_off_p50_ms"]:
            row["speedup"] = round(row["ttft_off_p50_ms"] / row["ttft_on_p50_ms"], 2)
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    lines = ["| turn | requests | prompt tokens | reused tokens (mean) | turns with reuse | TTFT p50 off ms | "
             "TTFT p50 on ms | speedup |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['turn']} | {r['requests']} | {r['prompt_tokens_mean']} | {r['reused_tokens_mean']} | "
                     f"{r['turns_with_reuse']} | {r['ttft_off_p50_ms']} | {r['ttft_on_p50_ms']} | "
                     f"{r.get('speedup', '-')} |")
    lines.append("")
    lines.append(f"Turns 2+ with reused tokens: {summary['later_turns_with_reuse']} of {summary['later_turns']} "
                 f"({summary['later_turns_reuse_share']:.1%}). Prefill pulled {summary['pulled_on']:.0f} tokens "
                 f"from decode with reuse on, {summary['pulled_off']:.0f} with reuse off.")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> dict[str, Any]:
    aiperf = find_aiperf(args.aiperf)
    args.out.mkdir(parents=True, exist_ok=True)
    arms: dict[str, dict[str, Any]] = {}
    with stack_with_env({}, args.state_dir, port_base=args.port_base,
                        tunables={"decoder_kv_blocks_ttl": 120, "conversation_ttl": 100}) as state:
        comps = state["components"]
        router, prefill = comps["router"]["url"], comps["prefill-0"]["url"]
        log = args.state_dir.resolve() / "logs" / "router.log"
        hf_home = args.state_dir.resolve() / "hf"
        tokenizer = hub_alias(Path(state["model_dir"]).resolve(), hf_home)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(hf_home)}
        for arm, headers in (("on", {}), ("off", {wire.REUSE_HEADER: wire.REUSE_OFF})):
            out = args.out / arm
            shutil.rmtree(out, ignore_errors=True)
            offset = log.stat().st_size
            before = prefill_pulled(prefill)
            cmd = aiperf_command(aiperf, args, router, tokenizer, out.resolve(), headers)
            print(f"{arm}: {' '.join(cmd)}", flush=True)
            t0 = time.monotonic()
            done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  timeout=args.timeout)
            (args.out / f"aiperf-{arm}.log").write_text(done.stdout)
            if done.returncode != 0:
                raise SystemExit(f"aiperf ({arm}) failed with {done.returncode}; see {args.out / f'aiperf-{arm}.log'}")
            time.sleep(1.5)  # the router batches EMF lines (0.5 s)
            arms[arm] = {"ttft": ttft_by_turn(read_records(out)), "reuse": reuse_by_turn(emf_lines(log, offset)),
                         "pulled": prefill_pulled(prefill) - before, "seconds": round(time.monotonic() - t0, 1)}
    rows = table(arms)
    later = [x for turn, lines in arms["on"]["reuse"].items() if turn > 0 for x in lines]
    with_reuse = sum(1 for x in later if int(x.get("ReusedTokens") or 0) > 0)
    summary = {"later_turns": len(later), "later_turns_with_reuse": with_reuse,
               "later_turns_reuse_share": with_reuse / len(later) if later else 0.0,
               "pulled_on": arms["on"]["pulled"], "pulled_off": arms["off"]["pulled"],
               "seconds": {arm: a["seconds"] for arm, a in arms.items()},
               "workload": {k: getattr(args, k) for k in ("conversations", "turns", "input_tokens", "output_tokens",
                                                          "concurrency", "seed")}}
    (args.out / "summary.json").write_text(json.dumps({"turns": rows, **summary}, indent=2))
    text = markdown(rows, summary)
    (args.out / "summary.md").write_text(text)
    print(text)
    return {"turns": rows, **summary}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--aiperf", help="path of the aiperf executable (default: .venv-aiperf/bin/aiperf, $AIPERF, PATH)")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--input-tokens", type=int, default=400, help="synthetic tokens per user turn")
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=13)
    p.add_argument("--timeout", type=float, default=300, help="seconds per aiperf run")
    p.add_argument("--port-base", type=int, default=8400)
    p.add_argument("--state-dir", type=Path, default=ROOT / ".turnkv" / "bench-aiperf")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "aiperf")
    return p


if __name__ == "__main__":
    sys.exit(0 if run(parser().parse_args()) else 1)
