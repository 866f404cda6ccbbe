"""Attempt 5's diagnosis of the pressure twin's misses (run from the repository root, PYTHONPATH=$PWD).

    python bench/twin_runs/2026-12-06-e/diagnose.py timeline p2 16 off   # a run's timeline, rebuilt from its records
    python bench/twin_runs/2026-12-06-e/diagnose.py decode                # decode ms/token against the batch, per run
    python bench/twin_runs/2026-12-06-e/diagnose.py turns p2 [5]          # simulated vs measured per level, arm, turn
    python bench/twin_runs/2026-12-06-e/diagnose.py capacity              # w7-w10 (in-sample) under attempts 4 and 5

`bench pressure` records no send times, but they follow from its schedule: conversation i starts at i x 0.2 s and
sends each later turn a fixed think time after the previous reply ended. `turns ... OVERRIDES` takes a JSON object
of constants for counterfactuals (diagnosis only: nothing here feeds a prediction).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from turnkv.engine_args import EngineSpec
from turnkv.plan import architectures, closed_form, hardware
from turnkv.plan import twin_sim as ts

D = Path("bench/twin_runs/2026-12-06-d")
#: think s, system, first user and turn words, reply tokens, retained_kv_share (the runs' scripts)
PRESSURE = {"p1": (1.0, 100, 200, 100, 96, 0.01), "p2": (2.0, 80, 150, 120, 64, 0.01),
            "p3": (3.0, 120, 200, 80, 48, 0.02), "p4": (1.5, 60, 300, 60, 32, 0.015)}
E = Path("bench/twin_runs/2026-12-06-e")


def run_dir(name: str) -> Path:
    """Where a pressure run's records are (p4: attempt 5's validation run)."""
    return (E if name == "p4" else D) / f"{name}-pressure"
CAPACITY = {"w7": (200, 300, 80, 24), "w8": (120, 200, 160, 40), "w9": (60, 100, 60, 64), "w10": (300, 600, 150, 16)}


def rows(path: Path) -> list[dict[str, Any]]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def timeline(rs: list[dict[str, Any]], think: float, level_key: str) -> list[tuple[float, float, float, dict]]:
    """(sent, first token, end, record) of every request, per level and arm from the phase's start."""
    out = []
    groups: dict[tuple, dict] = {}
    for r in rs:
        if r.get("error") is None:
            groups.setdefault((r[level_key], r["arm"]), {})[(r["conversation"], r["turn"])] = r
    for by in groups.values():
        for c in range(max(k[0] for k in by) + 1):
            t = c * 0.2
            for k in range(max(k[1] for k in by) + 1):
                r = by.get((c, k))
                if r is None:
                    break
                t += think if k else 0.0
                out.append((t, t + r["ttft_ms"] / 1000, t + r["latency_ms"] / 1000, r))
                t += r["latency_ms"] / 1000
    return out


def cmd_timeline(name: str, n: str, arm: str) -> None:
    rs = [r for r in rows(run_dir(name) / "results.jsonl") if r["conversations"] == int(n) and r["arm"] == arm]
    prev = None
    for sent, first, end, r in sorted(timeline(rs, PRESSURE[name][0], "conversations"), key=lambda e: e[1]):
        gap = "" if prev is None else f"{1000 * (first - prev):5.0f}"
        print(f"c{r['conversation']:2} t{r['turn']} sent {sent:7.3f} first {first:7.3f} end {end:7.3f} "
              f"ttft {1000 * (first - sent):6.0f} prompt {r['prompt_tokens']} pulled {r['reused_tokens']} gap {gap}")
        prev = first


def cmd_decode() -> None:
    runs = [(w, rows(D / f"{w}-capacity/records.jsonl"), 0.0, "level") for w in ["calib", *CAPACITY]]
    # one conversation (level 1) of the capacity runs: a reply's decode time against its length, both arms' means
    means = [(rs[0]["completion_tokens"] - 1, float(np.mean([r["latency_ms"] - r["ttft_ms"] for r in rs
                                                             if r["level"] == 1 and r["arm"] == arm])))
             for _, rs, _, _ in runs for arm in ("on", "off")]
    per_token, per_reply = np.polyfit([m[0] for m in means], [m[1] for m in means], 1)
    print(f"level 1 of the capacity runs: {per_reply:.0f} ms a reply + {per_token:.2f} ms a token after the first")
    runs += [(p, rows(run_dir(p) / "results.jsonl"), PRESSURE[p][0], "conversations") for p in PRESSURE]
    for name, rs, think, key in runs:
        iv = timeline(rs, think, key)
        x, y = [], []
        for _, first, end, r in iv:
            same = [(a, b) for _, a, b, o in iv if o[key] == r[key] and o["arm"] == r["arm"]]
            grid = np.linspace(first, end, 50)
            x.append(float(np.mean([sum(a <= g < b for a, b in same) for g in grid])))
            y.append((end - first) * 1000 / (r["completion_tokens"] - 1))
        xa, ya = np.array(x), np.array(y)
        coef = np.polyfit(xa, ya, 1)
        bins = " ".join(f"[{lo},{hi}):{ya[(xa >= lo) & (xa < hi)].mean():.1f}/{((xa >= lo) & (xa < hi)).sum()}"
                        for lo, hi in [(1, 1.5), (1.5, 2.5), (2.5, 4), (4, 6), (6, 9), (9, 20)]
                        if ((xa >= lo) & (xa < hi)).any())
        print(f"{name:6} {rs[0]['completion_tokens']:3} tokens: {coef[1]:5.2f} ms/token + {coef[0]:4.2f} ms per "
              f"sequence decoding alongside | {bins}")


def fleet(prefix_caching: bool) -> closed_form.Fleet:
    inst = hardware.load("local-cpu", D / "state")
    return closed_form.Fleet(architectures.tiny_local(), inst, inst, 1, 1, block_size=EngineSpec.block_size,
                             prefill_prefix_caching=prefix_caching, host_kv_gib=0.0)


def constants(attempt: int, overrides: dict[str, Any] | None = None) -> ts.SimConstants:
    c = ts.SimConstants.from_dict(json.loads((D / "sim-constants.json").read_text()))
    if attempt == 5:
        c = dataclasses.replace(c, hop_steals_step=True, hop_when_sent=True)
    return dataclasses.replace(c, **(overrides or {}))


def cmd_turns(name: str, attempt: str = "5", overrides: str = "{}") -> None:
    think, sw, fw, tw, mt, share = PRESSURE[name]
    f = fleet(False)
    room = int(share * int(2 * 2**30 // (f.block_size * f.model.kv_bytes_per_token_rank(1))))
    fit = ts.pressure_fit(4, sw, fw, tw, mt, room, f.block_size)
    counts = [fit * k for k in (1, 2, 4, 8)]
    sim = ts.Simulation(f, constants(int(attempt), json.loads(overrides)), 0.2, system_tokens=sw + ts.SYSTEM_EXTRA - 1,
                        retention_blocks=room, per_level_content=True)
    recs = sim.run([ts.conversation(4, sw, fw, tw, mt, think)] * max(counts), counts, arms=("on", "off"))
    meas = rows(run_dir(name) / "results.jsonl")
    for n in counts:
        for arm in ("on", "off"):
            for t in range(4):
                m = [r for r in meas if (r["conversations"], r["arm"], r["turn"]) == (n, arm, t)]
                s = [r for r in recs if (r.level, r.arm, r.turn) == (n, arm, t)]
                mt_, st = [r["ttft_ms"] for r in m], [r.ttft_ms for r in s]
                print(f"{n:3} {arm:3} t{t} TTFT measured p50/p90 {np.percentile(mt_, 50):5.0f}/"
                      f"{np.percentile(mt_, 90):5.0f}, simulated {np.percentile(st, 50):5.0f}/"
                      f"{np.percentile(st, 90):5.0f} | decode ms measured "
                      f"{np.mean([r['latency_ms'] - r['ttft_ms'] for r in m]):5.0f}, simulated "
                      f"{np.mean([r.latency_ms - r.ttft_ms for r in s]):5.0f} | pulled "
                      f"{np.mean([r['reused_tokens'] > 0 for r in m]):.2f}/"
                      f"{np.mean([r.reused_tokens > 0 for r in s]):.2f}")


def cmd_capacity() -> None:
    measured = {w: json.loads((D / f"{w}-capacity/capacity.json").read_text()) for w in CAPACITY}
    for attempt in (4, 5):
        ok = total = 0
        for w, (sw, fw, tw, mt) in CAPACITY.items():
            res = ts.simulate(fleet(True), constants(attempt), [ts.conversation(12, sw, fw, tw, mt)] * 8,
                              [1, 2, 4, 8], sw + ts.SYSTEM_EXTRA - 1, 0.2)
            for pl, ml in zip(res["levels"], measured[w]["levels"], strict=True):
                for arm in ("off", "on"):
                    for k in ("ttft_p50_ms", "ttft_p90_ms"):
                        err = pl[arm][k] / ml[arm][k] - 1
                        total, ok = total + 1, ok + (abs(err) <= 0.25)
                        if abs(err) > 0.25:
                            print(f"  attempt {attempt} {w} {pl['concurrency']} {arm} {k}: {pl[arm][k]} / "
                                  f"{ml[arm][k]} ({err:+.0%})")
        print(f"attempt {attempt}: {ok} of {total} capacity TTFT cells within 25%")


if __name__ == "__main__":
    {"timeline": cmd_timeline, "decode": cmd_decode, "turns": cmd_turns, "capacity": cmd_capacity}[sys.argv[1]](
        *sys.argv[2:])
