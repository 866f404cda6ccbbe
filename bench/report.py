"""Turn raw results into the A/B table (Markdown), ``summary.json`` and ``ttft.png``.

Every ratio reads one way: a speedup of turnkv as deployed over another arm, that arm's TTFT over turnkv's (above 1:
turnkv is faster), and only on turns where turnkv reused something (turn 1, or a turn that reused nothing, shows the
machine's noise, not reuse). The headline compares with peer-best, what a user would run instead, where it was
played; arm names and definitions come from ``bench.arms``.
"""

from __future__ import annotations

import statistics
import textwrap
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench.arm_names import LABELS, MEANINGS
from bench.client import Result
from bench.run_files import write_run


def _median(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return round(statistics.median(vals), 1) if vals else None


def shared_prefill_cache(results: Iterable[Result], threshold: float = 0.05) -> str | None:
    """Why an A/B is not one: the ``off`` arm found its prompts in prefill's own cache, though every one of its
    requests carries a salt of its own (``bench.runner``): something between the client and prefill dropped the
    salt, and the ``off`` arm is not the no-prefix-cache baseline. None when it did not."""
    off = [r for r in results if r.arm == "off" and r.error is None and r.prompt_tokens]
    prompt = sum(r.prompt_tokens or 0 for r in off)
    cached = sum(r.prefill_cached_tokens for r in off)
    if not prompt or cached / prompt <= threshold:
        return None
    return (f"with reuse off, prefill found {100 * cached / prompt:.0f}% of the prompt tokens in its own prefix cache "
            "although every off request carries its own cache_salt: the salt did not reach prefill (a proxy that "
            "drops body fields?), so this is no A/B of reuse. `turnkv local up --no-prefill-prefix-caching` "
            "measures without the salt's help.")


def speedup(other_ms: float | None, on_ms: float | None, reused: float | None) -> float | None:
    """turnkv's TTFT speedup over another arm (``other / on``: above 1, turnkv is faster), or None where turnkv
    reused nothing on the turn. Pure."""
    if not other_ms or not on_ms or not reused:
        return None
    return round(other_ms / on_ms, 2)


#: The report's text lines fit a terminal this wide.
WIDTH = 80
#: Which arm the headline compares turnkv with, the first played: what a user would run, else the others.
HEADLINE_ARMS = ("peer", "best", "off")


def headline(summary: dict[str, Any]) -> str | None:
    """The report's first line: turnkv's speedup over the strongest baseline played, at the last turn. Pure."""
    for arm in HEADLINE_ARMS:
        if ratio := summary.get(f"speedup_vs_{arm}_last_turn"):
            return f"turnkv's TTFT speedup over {LABELS[arm]}, last turn: {ratio:.2f}x (higher is better)"
    return None


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
        for arm in arms:
            if arm != "on" and (ratio := speedup(row.get(f"ttft_ms_{arm}"), row.get("ttft_ms_on"),
                                                 row.get("reused_tokens_on"))):
                row[f"speedup_vs_{arm}"] = ratio
        turns.append(row)
    last = turns[-1] if turns else {}
    summary: dict[str, Any] = {
        "arms": arms,
        "turns": turns,
        **{f"speedup_vs_{arm}_last_turn": last.get(f"speedup_vs_{arm}") for arm in arms if arm != "on"},
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
    """The headline, the table (short headers: it fits 80 columns) and a legend defining every column and arm."""
    arms = summary["arms"]
    others = [a for a in arms if a != "on"] if "on" in arms else []
    head = ["turn", "prompt", *arms]
    if "on" in arms:
        head.append("reused")
    head += [f"x {a}" for a in others]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in summary["turns"]:
        cells = [str(row["turn"]), str(row.get("prompt_tokens") or "-")]
        cells += [f"{row[f'ttft_ms_{a}']:.0f}" if row.get(f"ttft_ms_{a}") is not None else "-" for a in arms]
        if "on" in arms:
            cells.append(f"{row['reused_tokens_on']:.0f}" if row.get("reused_tokens_on") is not None else "-")
        cells += [f"{row[f'speedup_vs_{a}']:.2f}x" if row.get(f"speedup_vs_{a}") else "-" for a in others]
        lines.append("| " + " | ".join(cells) + " |")
    top = [line] if (line := headline(summary)) else []
    legend = ["", *textwrap.wrap(
        "prompt: prompt tokens; <arm>: its median time to first token (ms); reused: tokens turnkv pulled from decode; "
        "x <arm>: turnkv's speedup over that arm (its TTFT / turnkv's; higher is better), only on turns that reused "
        "something. Arms:", WIDTH)]
    legend += [line for a in arms
               for line in textwrap.wrap(f"- {a} = {LABELS[a]}: {MEANINGS[a]}", WIDTH, subsequent_indent="  ")]
    notes = [f"\nrequests: {summary['requests']}, errors: {summary['errors']}"]
    notes += [f"TTFT speedup over {LABELS[a]} at the last turn: {summary[f'speedup_vs_{a}_last_turn']:.2f}x"
              for a in others if summary.get(f"speedup_vs_{a}_last_turn")]
    if "answers_compared" in summary:
        notes.append(f"identical answers with reuse on and off: {summary['answers_identical']}"
                     f"/{summary['answers_compared']}")
    return "\n".join([*top, *([""] if top else []), *lines, *legend, *notes]) + "\n"


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


#: Each arm's colour and marker in the charts.
STYLES = {"off": ("#c0392b", "o"), "on": ("#27ae60", "s"), "best": ("#2980b9", "^"), "peer": ("#8e44ad", "D")}


def chart(summary: dict[str, Any], path: Path) -> Path:
    """Left: TTFT per turn, one line per arm, named as in the table (``bench.arms.LABELS``). Right: turnkv's
    speedup over the arms with a prefix cache (peer-best, best case) per turn that reused something, higher is
    better, 1x marked: the comparison the headline makes, which the no-prefix-cache line's scale flattens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ttft_ax, speed_ax) = plt.subplots(1, 2, figsize=(11, 4.4), dpi=120)
    for arm in summary["arms"]:
        if pts := points(summary["turns"], f"ttft_ms_{arm}"):
            ttft_ax.plot(*zip(*pts, strict=True), label=LABELS[arm], color=STYLES[arm][0], marker=STYLES[arm][1])
        if arm in ("peer", "best") and (pts := points(summary["turns"], f"speedup_vs_{arm}")):
            speed_ax.plot(*zip(*pts, strict=True), label=f"over {LABELS[arm]}", color=STYLES[arm][0],
                          marker=STYLES[arm][1])
    speed_ax.axhline(1.0, color="#7f8c8d", linestyle=":", label="1x: as fast")
    for ax, ylabel, title in ((ttft_ax, "TTFT, median (ms)", "TTFT per turn"),
                              (speed_ax, "their TTFT / turnkv's", "speedup over prefix caching (higher is better)")):
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle("Multi-turn TTFT: turnkv as deployed against the baselines")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write(results: list[Result], out: Path, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """results.jsonl, summary.json and summary.md under ``out`` (``bench.run_files``), then ttft.png; the summary."""
    summary = write_run(results, out, summarize, markdown, meta)
    chart(summary, out / "ttft.png")
    return summary
