"""The files a benchmark run leaves behind, one writer for every player that writes them.

``results.jsonl`` (one record a line, as the player measured it), ``summary.json`` (the summary, with the run's
``meta`` when given) and ``summary.md`` (the summary's table). The A/B report (``bench.report``) and the agent
benchmark's (``bench.agent_report``) share this shape; each brings its own records, summary and table.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar


class JsonRecord(Protocol):
    def to_json(self) -> dict[str, Any]: ...


R = TypeVar("R", bound=JsonRecord)


def write_run(records: Sequence[R], out: Path, summarize: Callable[[Sequence[R]], dict[str, Any]],
              markdown: Callable[[dict[str, Any]], str], meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the run's three files under ``out`` (created) and return the summary (``meta`` added when given).
    The records go to disk before they are summarised, so a summary that fails leaves them readable."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r.to_json()) + "\n")
    summary = summarize(records)
    if meta:
        summary["meta"] = meta
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "summary.md").write_text(markdown(summary))
    return summary
