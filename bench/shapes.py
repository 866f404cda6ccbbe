"""The target's unequal shapes on real vLLM CPU engines: prefill and decode at different tensor parallelism or KV
block sizes, in pull and push mode (both bi-directional), each played as ``turnkv smoke`` plays a deploy: four
turns, each sent with reuse off and on, answers compared, the router's reuse outcome per turn.

Each shape gets its own local stack (``turnkv.local.stack``); a shape whose engines do not start, or whose turns
hang, is reported with the reason (the engine log's last lines) and the next shape runs. Prints a table and writes
JSON + Markdown.

    python -m bench.shapes                       # every shape, pull and push
    python -m bench.shapes --shape p2d1 --mode pull
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench import engine_metrics
from turnkv import smoke
from turnkv.engine_args import Mode
from turnkv.local.stack import StackConfig, StackError, Supervisor, tail

#: Prompt tokens prefill took over the connector (vLLM's prefix-cache query counter by source).
PULLED = "vllm:prompt_tokens_by_source_total"


@dataclass(frozen=True)
class Shape:
    key: str
    label: str
    prefill_tp: int = 1
    decode_tp: int = 1
    prefill_block_size: int | None = None
    decode_block_size: int | None = None
    #: Extra ``vllm serve`` flags for decode (speculative decoding).
    decode_args: tuple[str, ...] = ()


#: vLLM's n-gram drafter (prompt lookup, no draft model): it runs on the CPU backend, so decode's scheduler sees
#: num_computed_tokens run ahead of the token ids by the drafts, the case of turnkv's spec-decode offer rule.
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4})

SHAPES = (
    Shape("equal", "P TP1 / D TP1, blocks 128/128 (the suites' shape)"),
    Shape("p1d2", "P TP1 / D TP2", decode_tp=2),
    Shape("p2d1", "P TP2 / D TP1", prefill_tp=2),
    Shape("b32-128", "P blocks 32 / D blocks 128", prefill_block_size=32, decode_block_size=128),
    Shape("b128-32", "P blocks 128 / D blocks 32", prefill_block_size=128, decode_block_size=32),
    Shape("ngram", "P TP1 / D TP1, decode with n-gram speculative decoding (3 tokens)",
          decode_args=("--speculative-config", NGRAM)),
)


@dataclass
class ShapeRun:
    """One shape played in one mode: whether its engines started, its turns, the tokens pulled and the verdict."""

    shape: str
    label: str
    mode: str
    started: bool = False
    turns: list[dict] = field(default_factory=list)
    pulled_tokens: float = 0.0
    #: Decode's speculative-decoding counters (drafted, accepted tokens; 0 without a drafter).
    drafted_tokens: float = 0.0
    accepted_tokens: float = 0.0
    passed: bool = False
    failure: str = ""
    seconds: float = 0.0
    #: What a caller's ``play`` found on the running stack (bench.gpu_smoke: forks, transfers, backend).
    extra: dict = field(default_factory=dict)


#: vLLM's speculative-decoding counters on decode.
DRAFTED, ACCEPTED = "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"


def run_shape(shape: Shape, mode: Mode, state_dir: Path, timeout_s: float,
              play: Callable[[dict[str, str]], dict] | None = None, **stack: object) -> ShapeRun:
    """One shape's stack, played and stopped; ``stack`` overrides :class:`StackConfig` fields, and ``play`` (given
    the components' URLs) runs more checks on it after the conversation, into ``extra`` (bench.gpu_smoke)."""
    row = ShapeRun(shape.key, shape.label, mode.value)
    started = time.monotonic()
    stack = dict(stack)  # its tunables go over these (not instead of them)
    config = StackConfig(**{**dict(state_dir=state_dir, router_port=8600, prefill_port=8610, decode_port=8620,
                                   prefill_prefix_caching=False,  # the seeds' setting: the A/B measures reuse
                                   side_channel_base=5700, mode=mode, kv_cache_gib=1, startup_timeout=300.0,
                                   # Ranks outnumber cores here: a health probe that waits behind a spinning rank
                                   # must not eject an engine the turn then needs (eject_failures 1, probes of 2 s
                                   # by default: a decode beside a TP-2 prefill missed five in a row),
                                   # and a TP-2 decode's evictions feed (a collective_rpc over its ranks) took over
                                   # the 3 s that evictions_interval 1 allows, so its turns were not replayed.
                                   tunables={"eject_failures": 10, "health_interval": 5.0,
                                             "evictions_interval": 3.0, **stack.pop("tunables", {})},
                                   prefill_tp=shape.prefill_tp, decode_tp=shape.decode_tp,
                                   prefill_block_size=shape.prefill_block_size,
                                   decode_block_size=shape.decode_block_size,
                                   decode_extra_args=shape.decode_args), **stack})
    supervisor = Supervisor(state_dir)
    supervisor.down()
    try:
        try:
            state = supervisor.up(config)
        except StackError as exc:
            logs = sorted((state_dir / "logs").glob("*-0.log"))
            row.failure = f"did not start: {exc}; " + " | ".join(
                f"{log.name}: {tail(log, 3)}" for log in logs)
            return row
        row.started = True
        urls = {name: c["url"] for name, c in state["components"].items()}
        result = asyncio.run(smoke.run(urls["router"], timeout_s=timeout_s))
        row.turns = smoke.summary_rows(result)
        prefill = engine_metrics.fetch_sync(urls["prefill-0"])
        row.pulled_tokens = engine_metrics.total(prefill, PULLED, source="external_kv_transfer")
        decode = engine_metrics.fetch_sync(urls["decode-0"])
        row.drafted_tokens = engine_metrics.total(decode, DRAFTED)
        row.accepted_tokens = engine_metrics.total(decode, ACCEPTED)
        row.passed, row.failure = result.ok, result.failure or ""
        if play is not None:
            row.extra = play(urls)
        return row
    finally:
        supervisor.down()
        row.seconds = round(time.monotonic() - started, 1)


def markdown(rows: list[ShapeRun]) -> str:
    lines = ["| shape | mode | engines up | turns reused (of later) | reused tokens by turn | answers equal | "
             "prefill pulled tokens | result |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        later = r.turns[1:]
        reused = sum(1 for t in later if t["outcome"] == smoke.HIT)
        tokens = ", ".join(str(t["reused_tokens"]) for t in later) or "-"
        equal = f"{sum(1 for t in r.turns if t['same_answer'])}/{len(r.turns)}" if r.turns else "-"
        result = "passed" if r.passed else (r.failure.replace("|", "/").replace("\n", " ")[:300] or "failed")
        if r.drafted_tokens > 0:  # NaN (decode did not answer) and 0 (no drafter) say nothing
            result += f" (decode drafted {r.drafted_tokens:,.0f} tokens, accepted {r.accepted_tokens:,.0f})"
        lines.append(f"| {r.label} | {r.mode} | {'yes' if r.started else 'no'} | {reused}/{len(later)} | {tokens} | "
                     f"{equal} | {r.pulled_tokens:,.0f} | {result} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", choices=[s.key for s in SHAPES],
                        help="shape(s) to run (default: all)")
    parser.add_argument("--mode", action="append", choices=[m.value for m in Mode], help="default: pull and push")
    parser.add_argument("--out", type=Path, default=Path("results/shapes"))
    parser.add_argument("--state-dir", type=Path, default=Path(".turnkv/shapes"))
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds for one shape's turns")
    args = parser.parse_args(argv)
    shapes = [s for s in SHAPES if not args.shape or s.key in args.shape]
    modes = [Mode(m) for m in (args.mode or [m.value for m in Mode])]
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[ShapeRun] = []
    for shape in shapes:
        for mode in modes:
            print(f"shape {shape.label}, {mode.value} ...", flush=True)
            rows.append(run_shape(shape, mode, args.state_dir, args.timeout))
            print(markdown(rows[-1:]).splitlines()[-1], flush=True)
            (args.out / "shapes.json").write_text(json.dumps([asdict(r) for r in rows], indent=2))
    text = markdown(rows)
    (args.out / "shapes.md").write_text(text + "\n")
    print(text)
    return 0 if all(r.passed for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
