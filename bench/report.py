"""Turn raw results into the A/B table (Markdown), ``summary.json`` and ``ttft.png``."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench.client import Result
from bench.run_files import write_run


def _median(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return round(statistics.median(vals), 1) if vals else None


def shared_prefill_cache(results: Iterable[Result], threshold: float = 0.05) -> str | None:
    """Why an A/B is not one: the ``off`` arm found its prompts in prefill's own cache, though every one of its
    requests carries a salt of its own (``bench.runner``): something between the client and prefill dropped the
    salt, and the ``off`` arm is not the seeds' recompute-everything setting. None when it did not."""
    off = [r for r in results if r.arm == "off" and r.error is None and r.prompt_tokens]
    prompt = sum(r.prompt_tokens or 0 for r in off)
    cached = sum(r.prefill_cached_tokens for r in off)
    if not prompt or cached / prompt <= threshold:
        return None
    return (f"with reuse off, prefill found {100 * cached / prompt:.0f}% of the prompt tokens in its own prefix cache "
            "although every off request carries its own cache_salt: the salt did not reach prefill, so this is no "
            "A/B of reuse. Start the stack with `turnkv local up --no-prefill-prefix-caching` for the A/B.")


def summarize(results: list[Result]) -> dict[str, Any]:
    by_turn: dict[int, dict[str, list[Result]]] = defaultdict(lambda: defaultdict(list))
    for r in results:
        if r.arm != "warm":
            by_turn[r.turn][r.arm].append(r)
    arms = sorted({r.arm for r in results if r.arm != "warm"}, key=["off", "on", "best", "peer"].index)
    turns = []
    for turn in sorted(by_turn):
        row: dict[str, Any] = {"turn": turn + 1}
        ok = [r for arm in arms for r in by_turn[turn][arm] if r.error is None]
        row["prompt_tokens"] = int(statistics.median(r.prompt_tokens for r in ok if r.prompt_tokens)) if any(
            r.prompt_tokens for r in ok) else None
        for arm in arms:
            row[f"ttft_ms_{arm}"] = _median(r.ttft_ms for r in by_turn[turn][arm] if r.error is None)
        if "on" in arms:
            row["reused_tokens_on"] = _median(float(r.reused_tokens) for r in by_turn[turn]["on"] if r.error is None)
        if row.get("ttft_ms_off") and row.get("ttft_ms_on"):
            row["speedup"] = round(row["ttft_ms_off"] / row["ttft_ms_on"], 2)
        if row.get("ttft_ms_best") and row.get("ttft_ms_on"):
            row["on_vs_best"] = round(row["ttft_ms_on"] / row["ttft_ms_best"], 2)
        if row.get("ttft_ms_peer") and row.get("ttft_ms_on"):
            row["on_vs_peer"] = round(row["ttft_ms_on"] / row["ttft_ms_peer"], 2)
        turns.append(row)
    last = turns[-1] if turns else {}
    summary: dict[str, Any] = {
        "arms": arms,
        "turns": turns,
        "speedup_last_turn": last.get("speedup"),
        "on_vs_best_last_turn": last.get("on_vs_best"),
        "on_vs_peer_last_turn": last.get("on_vs_peer"),
        "requests": sum(1 for r in results if r.arm != "warm"),
        "errors": sum(1 for r in results if r.error is not None),
        "error_samples": sorted({r.error for r in results if r.error})[:5],
    }
    if {"off", "on"} <= set(arms):
        pairs = _paired_replies(results)
        summary["answers_identical"] = sum(1 for a, b in pairs if a == b)
        summary["answers_compared"] = len(pairs)
    return summary


def _paired_replies(results: list[Result]) -> list[tuple[str, str]]:
    by_key: dict[tuple[int, int], dict[str, str]] = defaultdict(dict)
    for r in results:
        if r.error is None and r.arm in ("off", "on"):
            by_key[(r.conversation, r.turn)][r.arm] = r.reply_sha
    return [(v["off"], v["on"]) for v in by_key.values() if len(v) == 2]


def markdown(summary: dict[str, Any]) -> str:
    arms = summary["arms"]
    head = ["turn", "prompt tokens", *(f"TTFT {a} (ms)" for a in arms)]
    if "on" in arms:
        head.append("reused tokens")
    if {"off", "on"} <= set(arms):
        head.append("speedup")
    if "best" in arms:
        head.append("on / best")
    if "peer" in arms:
        head.append("on / peer")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in summary["turns"]:
        cells = [str(row["turn"]), str(row.get("prompt_tokens") or "-")]
        cells += [f"{row[f'ttft_ms_{a}']:.0f}" if row.get(f"ttft_ms_{a}") is not None else "-" for a in arms]
        if "on" in arms:
            cells.append(f"{row['reused_tokens_on']:.0f}" if row.get("reused_tokens_on") is not None else "-")
        if {"off", "on"} <= set(arms):
            cells.append(f"{row['speedup']:.2f}x" if row.get("speedup") else "-")
        if "best" in arms:
            cells.append(f"{row['on_vs_best']:.2f}" if row.get("on_vs_best") else "-")
        if "peer" in arms:
            cells.append(f"{row['on_vs_peer']:.2f}" if row.get("on_vs_peer") else "-")
        lines.append("| " + " | ".join(cells) + " |")
    notes = [f"\nrequests: {summary['requests']}, errors: {summary['errors']}"]
    if summary.get("speedup_last_turn"):
        notes.append(f"TTFT speedup at the last turn (off / on): {summary['speedup_last_turn']:.2f}x")
    if summary.get("on_vs_best_last_turn"):
        notes.append(f"reuse on vs best case (prefix-cached prefill) at the last turn: "
                     f"{summary['on_vs_best_last_turn']:.2f}x")
    if summary.get("on_vs_peer_last_turn"):
        notes.append(f"reuse on vs peer-best (prefix-caching prefill, no reuse) at the last turn: "
                     f"{summary['on_vs_peer_last_turn']:.2f}x")
    if "answers_compared" in summary:
        notes.append(f"identical answers with reuse on and off: {summary['answers_identical']}"
                     f"/{summary['answers_compared']}")
    return "\n".join(lines) + "\n" + "\n".join(notes) + "\n"


def plot_ttft(lines: list[tuple[str, list[tuple[float, float]], dict[str, Any]]], title: str, path: Path,
              xlabel: str = "prompt tokens", ylabel: str = "TTFT, median (ms)",
              hline: tuple[float, str] | None = None, xticks: list[float] | None = None) -> Path:
    """TTFT against prompt tokens (or ``xlabel``), one line per (label, points, matplotlib style); ``hline``
    draws a labelled horizontal line (a target); ``xticks`` puts the x axis on a log-2 scale with those ticks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.4), dpi=120)
    for label, pts, style in lines:
        if pts:
            ax.plot(*zip(*pts, strict=True), label=label, **style)
    if hline is not None:
        ax.axhline(hline[0], color="#7f8c8d", linestyle=":", label=hline[1])
    if xticks:
        ax.set_xscale("log", base=2)
        ax.set_xticks(xticks, [f"{x:g}" for x in xticks])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def points(rows: list[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    return [(r["prompt_tokens"], r[key]) for r in rows if r.get("prompt_tokens") and r.get(key) is not None]


def chart(summary: dict[str, Any], path: Path) -> Path:
    styles = {"off": ("reuse off (recompute)", "#c0392b", "o"), "on": ("reuse on (pull from decode)", "#27ae60", "s"),
              "best": ("best case (prefix-cached prefill)", "#2980b9", "^"),
              "peer": ("peer-best (prefix-caching prefill, no reuse)", "#8e44ad", "D")}
    lines = [(styles[arm][0], points(summary["turns"], f"ttft_ms_{arm}"),
              {"color": styles[arm][1], "marker": styles[arm][2]}) for arm in summary["arms"]]
    return plot_ttft(lines, "Multi-turn TTFT: bi-directional KV reuse", path)


def write(results: list[Result], out: Path, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """results.jsonl, summary.json and summary.md under ``out`` (``bench.run_files``), then ttft.png; the summary."""
    summary = write_run(results, out, summarize, markdown, meta)
    chart(summary, out / "ttft.png")
    return summary
