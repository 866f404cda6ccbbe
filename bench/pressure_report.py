"""The retention-pressure sweep's report (``bench.pressure``): the table, summary.json, results.jsonl and the chart.
Pure formatting apart from the files written."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import pressure_calc as calc
from bench.client import Result


def _pct(v: float | None) -> str:
    return f"{100 * v:.0f}%" if v is not None else "-"


def _ms(v: float | None) -> str:
    return f"{v:,.0f}" if v is not None else "-"


def short_gauge(key: str) -> str:
    """``vllm:turnkv_pulls_total{tier="host"}`` -> ``host``; ``vllm:turnkv_host_pool_bytes`` -> ``host_pool``;
    ``vllm:turnkv_retained_bytes`` (both tiers) -> ``all``."""
    if "{" in key:
        return key.split('"')[1]
    name = key.removeprefix("vllm:turnkv_").removesuffix("_bytes")
    return {"retained": "all", "host_retained": "host"}.get(name, name)


def _mib(level: dict[str, Any]) -> str:
    peaks = [f"{short_gauge(k)} {v['peak'] / 2**20:,.1f}" for k, v in level["tier_bytes"].items()]
    return ", ".join(peaks) or "-"


def _pulls(level: dict[str, Any]) -> str:
    counters = level.get("prefill_counters") or {}
    pulls = [f"{short_gauge(k)} {v:g}" for k, v in counters.items() if k.startswith("vllm:turnkv_pulls_total{")]
    return ", ".join(pulls) or "-"


COLUMNS: dict[str, Callable[[dict[str, Any], dict[str, Any]], str]] = {
    "variant": lambda v, lv: v["variant"],
    "level": lambda v, lv: f"{lv['level']:g}x",
    "conversations": lambda v, lv: str(lv["conversations"]),
    "later turns reused": lambda v, lv: f"{lv['later_turns_reused']}/{lv['later_turns']} "
                                        f"({_pct(lv['reuse_share'])})",
    "TTFT p50 on/off, turns 2+ (ms)": lambda v, lv: f"{_ms(lv['ttft_on_later_p50_ms'])} / "
                                                    f"{_ms(lv['ttft_off_later_p50_ms'])}",
    "TTFT p90 on/off, turns 2+ (ms)": lambda v, lv: f"{_ms(lv['ttft_on_later_p90_ms'])} / "
                                                    f"{_ms(lv['ttft_off_later_p90_ms'])}",
    "p90 off/on": lambda v, lv: f"{calc.p90_ratio(lv):.2f}x" if calc.p90_ratio(lv) else "-",
    "identical": lambda v, lv: f"{lv['answers_identical']}/{lv['answers_compared']}",
    "errors on/off": lambda v, lv: f"{lv['errors_on']}/{lv['errors_off']}",
    "prefill pulls by tier": lambda v, lv: _pulls(lv),
    "evicted / refused": lambda v, lv: f"{lv['evictions']:g} / {lv['refusals']:g}",
    "retained peak (MiB)": lambda v, lv: _mib(lv),
    "decode RSS peak (MiB)": lambda v, lv: f"{lv['decode_rss_mib']['peak']:,.0f}" if lv["decode_rss_mib"] else "-",
}


def played(levels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [lv for lv in levels if "skipped" not in lv]


def rows(result: dict[str, Any]) -> list[list[str]]:
    out = []
    for v in result["variants"]:
        for lv in v["levels"]:
            if "skipped" in lv:
                out.append([v["variant"], f"{lv['level']:g}x", str(lv["conversations"]), f"skipped: {lv['skipped']}",
                            *[""] * (len(COLUMNS) - 4)])
            else:
                out.append([cell(v, lv) for cell in COLUMNS.values()])
    return out


def fit_line(variant: dict[str, Any]) -> str:
    """The fit and its inputs, with the largest last-turn prompt the engines reported (a check on the estimate)."""
    f = variant["fit"]
    if not f:
        return f"{variant['variant']}: no level ran"
    seen = max((lv.get("last_turn_prompt_tokens_max") or 0 for lv in variant["levels"]), default=0)
    measured = f"; largest prompt measured {seen} tokens (+ reply)" if seen else ""
    if f["source"] == "prefill":
        return (f"{variant['variant']}: 1x = {f['conversations']} conversations = the peer's prefill cache, "
                f"{f['num_gpu_blocks']} blocks of {f['block_size']} tokens / {f['blocks_per_conversation']} blocks per "
                f"conversation (last turn estimated ~{f['last_turn_tokens']} tokens{measured})")
    if f["source"] == "given":
        return (f"{variant['variant']}: fit {f['conversations']} conversations (given); last turn estimated "
                f"~{f['last_turn_tokens']} tokens{measured}")
    return (f"{variant['variant']}: fit {f['conversations']} conversations = {f['retained_kv_share']:g} x "
            f"{f['num_gpu_blocks']} blocks ({f['room_blocks']} blocks of {f['block_size']} tokens) / "
            f"{f['blocks_per_conversation']} blocks per conversation (last turn estimated ~{f['last_turn_tokens']} "
            f"tokens{measured})")


def table_console():
    """A console for the table: the terminal's width, or 220 columns into a file or pipe (rich's 80 would fold
    every cell)."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=220)


#: Below this width the table's 13 columns fold every cell: the rows print as records instead.
TABLE_WIDTH = 160


def records(result: dict[str, Any]) -> str:
    """The table's rows as records, one ``column: value`` line each, for a narrow terminal: a row reads whole where
    the table wrapped mid-cell (issue #49). Pure."""
    out = []
    for row in rows(result):
        out.append(f"{row[0]} at {row[1]} ({row[2]} conversations)")
        out += [f"  {name}: {value}" for name, value in list(zip(COLUMNS, row, strict=True))[3:] if value]
    return "\n".join(out)


def show(result: dict[str, Any]) -> None:
    """Print the table where it fits (a file or pipe gets it at 220 columns), else its rows as records."""
    console = table_console()
    if console.width >= TABLE_WIDTH:
        console.print(table(result))
    else:
        console.print(f"[bold]{table(result).title}[/bold]")
        console.print(records(result), markup=False, highlight=False)


def table(result: dict[str, Any]):
    from rich.table import Table

    t = Table(title="Retention pressure: live conversations against decode's retention room")
    for name in COLUMNS:
        t.add_column(name, overflow="fold")
    for row in rows(result):
        t.add_row(*row)
    return t


def chart(result: dict[str, Any], path: Path) -> Path:
    """Reuse share and TTFT p90 of later turns (on solid, off dashed) against the level, one colour per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (share_ax, ttft_ax) = plt.subplots(1, 2, figsize=(11, 4.4), dpi=120)
    colours = ["#27ae60", "#2980b9", "#8e44ad", "#d35400", "#7f8c8d"]
    for i, v in enumerate(result["variants"]):
        c = colours[i % len(colours)]
        lv = played(v["levels"])
        share = [(x["level"], 100 * x["reuse_share"]) for x in lv if x["reuse_share"] is not None]
        if share:
            share_ax.plot(*zip(*share, strict=True), marker="o", color=c, label=v["variant"])
        # the arms apart by line, marker and shade, not by line alone (a one-level row showed two alike dots)
        for arm, style, marker, alpha in (("on", "-", "o", 1.0), ("off", "--", "x", 0.55)):
            pts = [(x["level"], x[f"ttft_{arm}_later_p90_ms"]) for x in lv
                   if x[f"ttft_{arm}_later_p90_ms"] is not None]
            if pts:
                ttft_ax.plot(*zip(*pts, strict=True), linestyle=style, marker=marker, color=c, alpha=alpha,
                             label=f"{v['variant']}, reuse {arm}")
    levels = sorted({x["level"] for v in result["variants"] for x in played(v["levels"])})
    for ax, ylabel in ((share_ax, "later turns reused (%)"), (ttft_ax, "TTFT p90 of turns 2+ (ms)")):
        if levels:
            ax.set_xscale("log", base=2)
            ax.set_xticks(levels, [f"{x:g}x" for x in levels])
        ax.set_xlabel("live conversations / conversations that fit")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    share_ax.set_ylim(0, 105)
    fig.suptitle("Retention pressure")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(result, indent=2))
    chart(result, out / "pressure.png")


def append_results(out: Path, variant: str, level: dict[str, Any], results: list[Result]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.jsonl", "a") as f:
        for r in results:
            f.write(json.dumps({"variant": variant, "level": level["level"], "conversations": level["conversations"],
                                **r.to_json()}) + "\n")
