"""The agent benchmark's report: TTFT p50/p90 per arm and step kind, where prompt tokens came from, forks that
pulled, errors and identical answers (pure but ``write``).

Where each prompt token came from, per arm, over the requests that succeeded: **prefill cache** (prefill's own
prefix-cache hits, ``X-TurnKV-Prefill-Cached-Tokens``; 0 when the router does not send it), **pulled** from decode
(``X-TurnKV-Reused-Tokens``), **recomputed** (the prompt less both, at least 0). The two sources are counted as
disjoint, as the headers define them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench.agent_bench import ARMS, Record
from bench.agent_trace import REQUEST_KINDS
from bench.capacity import percentile
from bench.run_files import write_run


def _ttfts(records: Iterable[Record]) -> list[float]:
    return [r.ttft_ms for r in records if r.error is None and r.ttft_ms is not None]


def _share(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None


def sources(records: Iterable[Record]) -> dict[str, Any]:
    """Prompt tokens by source over the successful requests that reported their prompt length."""
    prompt = cached = pulled = recomputed = 0
    for r in records:
        if r.error is not None or not r.prompt_tokens:
            continue
        prompt += r.prompt_tokens
        cached += r.prefill_cached_tokens
        pulled += r.reused_tokens
        recomputed += max(r.prompt_tokens - r.prefill_cached_tokens - r.reused_tokens, 0)
    return {"prompt_tokens": prompt, "prefill_cached_tokens": cached, "pulled_tokens": pulled,
            "recomputed_tokens": recomputed, "share_prefill_cache": _share(cached, prompt),
            "share_pulled": _share(pulled, prompt), "share_recomputed": _share(recomputed, prompt)}


def answers(records: Iterable[Record], arms: list[str]) -> dict[str, Any]:
    """Each arm's replies against the first arm's (``off`` when played), request by request."""
    by_key: dict[tuple, dict[str, str]] = defaultdict(dict)
    for r in records:
        if r.error is None:
            by_key[r.key][r.arm] = r.reply_sha
    reference = arms[0] if arms else ""
    compared = identical = 0
    mismatches = []
    for key in sorted(by_key):
        replies = by_key[key]
        if reference not in replies:
            continue
        for arm in arms[1:]:
            if arm in replies:
                compared += 1
                if replies[arm] == replies[reference]:
                    identical += 1
                else:
                    mismatches.append({"arm": arm, "session": key[0], "agent": key[1], "step": key[2],
                                       "branch": key[3]})
    return {"reference": reference, "compared": compared, "identical": identical, "mismatches": mismatches[:20],
            "mismatch_count": len(mismatches)}


def summarize(records: list[Record]) -> dict[str, Any]:
    arms = [a for a in ARMS if any(r.arm == a for r in records)]
    per_arm: dict[str, Any] = {}
    for arm in arms:
        mine = [r for r in records if r.arm == arm]
        ok = _ttfts(mine)
        kinds = {}
        for kind in REQUEST_KINDS:
            of_kind = [r for r in mine if r.kind == kind]
            if of_kind:
                t = _ttfts(of_kind)
                kinds[kind] = {"requests": len(of_kind), "ttft_p50_ms": percentile(t, 50),
                               "ttft_p90_ms": percentile(t, 90)}
        forks = [r for r in mine if r.kind == "fork" and r.error is None]
        outcomes: dict[str, int] = defaultdict(int)
        for r in mine:
            outcomes[r.reuse_outcome or "-"] += 1
        per_arm[arm] = {
            "requests": len(mine),
            "errors": sum(1 for r in mine if r.error is not None),
            "ttft_p50_ms": percentile(ok, 50),
            "ttft_p90_ms": percentile(ok, 90),
            "by_kind": kinds,
            "tokens": sources(mine),
            "fork_turns": len(forks),
            "fork_turns_pulled": sum(1 for r in forks if r.reused_tokens > 0),
            "outcomes": dict(sorted(outcomes.items())),
        }
    return {
        "arms": arms,
        "per_arm": per_arm,
        "requests": len(records),
        "errors": sum(1 for r in records if r.error is not None),
        "error_samples": sorted({r.error for r in records if r.error})[:5],
        "answers": answers(records, arms),
    }


def shared_prefill_cache(summary: dict[str, Any], threshold: float = 0.05) -> str | None:
    """Why the A/B is not one, when the ``on`` arm found prompts in prefill's own cache after the ``off`` arm played the
    same prompts through the same router: a prefix-caching prefill engine served both (None otherwise). An off arm
    that salted its requests (``meta.off_salted``: ``bench.arms.body_extras``, every run since issue #36) left
    nothing the on arm could find: what the on arm found there is its own sessions' history, as deployed."""
    per_arm = summary.get("per_arm", {})
    arms = summary.get("arms", [])
    if (summary.get("meta") or {}).get("off_salted"):
        return None
    if "off" not in arms or "on" not in arms or arms.index("off") > arms.index("on"):
        return None
    share = (per_arm.get("on", {}).get("tokens") or {}).get("share_prefill_cache") or 0.0
    if share <= threshold:
        return None
    return (f"the on arm found {100 * share:.0f}% of its prompt tokens in prefill's own cache: the off arm played "
            "the same prompts just before through a prefix-caching prefill engine, so this is no A/B of reuse. "
            "Start the stack with `turnkv local up --no-prefill-prefix-caching` for the A/B (docs/benchmarks.md).")


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def markdown(summary: dict[str, Any]) -> str:
    arms = summary["arms"]
    head = ["arm", "requests", "errors", "TTFT p50 (ms)", "TTFT p90 (ms)", "prefill cache", "pulled from decode",
            "recomputed", "fork turns that pulled"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm in arms:
        a = summary["per_arm"][arm]
        t = a["tokens"]
        lines.append("| " + " | ".join([
            arm, str(a["requests"]), str(a["errors"]), _ms(a["ttft_p50_ms"]), _ms(a["ttft_p90_ms"]),
            _pct(t["share_prefill_cache"]), _pct(t["share_pulled"]), _pct(t["share_recomputed"]),
            f"{a['fork_turns_pulled']}/{a['fork_turns']}"]) + " |")
    kinds = [k for k in REQUEST_KINDS if any(k in summary["per_arm"][a]["by_kind"] for a in arms)]
    head = ["step kind", *(f"TTFT p50 / p90 {a} (ms)" for a in arms)]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for kind in kinds:
        cells = [kind]
        for arm in arms:
            k = summary["per_arm"][arm]["by_kind"].get(kind)
            cells.append(f"{_ms(k['ttft_p50_ms'])} / {_ms(k['ttft_p90_ms'])} ({k['requests']})" if k else "-")
        lines.append("| " + " | ".join(cells) + " |")
    ans = summary["answers"]
    notes = [f"\nrequests: {summary['requests']}, errors: {summary['errors']}"]
    if ans["compared"]:
        notes.append(f"identical answers against reuse {ans['reference']}: {ans['identical']}/{ans['compared']}"
                     + (f" ({ans['mismatch_count']} differ)" if ans["mismatch_count"] else ""))
    for sample in summary["error_samples"]:
        notes.append(f"error: {sample}")
    return "\n".join(lines) + "\n" + "\n".join(notes) + "\n"


def write(records: list[Record], out: Path, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """results.jsonl, summary.json and summary.md under ``out`` (``bench.run_files``); the summary."""
    return write_run(records, out, summarize, markdown, meta)
