"""bench.run_files: the A/B and agent reports write their three files through one writer, byte for byte as each
wrote them on its own (the reference below is the writer both modules carried before they shared one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import agent_report, report
from tests.unit.test_agent_report import records
from tests.unit.test_bench_report import results


def _as_each_wrote_it(rows, summarize, markdown, meta) -> dict[str, bytes]:
    summary = summarize(rows)
    if meta:
        summary["meta"] = meta
    return {"results.jsonl": "".join(json.dumps(r.to_json()) + "\n" for r in rows).encode(),
            "summary.json": json.dumps(summary, indent=2).encode(),
            "summary.md": markdown(summary).encode()}


@pytest.mark.parametrize("module, rows", [(agent_report, records), (report, results)], ids=["agent", "ab"])
@pytest.mark.parametrize("meta", [None, {"trace": "t", "url": "http://127.0.0.1:8000"}], ids=["no-meta", "meta"])
def test_both_reports_write_the_same_bytes_as_before(tmp_path: Path, module, rows, meta):
    out = tmp_path / "run"
    summary = module.write(rows(), out, meta)
    expected = _as_each_wrote_it(rows(), module.summarize, module.markdown, meta)
    for name, data in expected.items():
        assert (out / name).read_bytes() == data, name
    assert summary == json.loads(expected["summary.json"])
    extra = {p.name for p in out.iterdir()} - set(expected)
    assert extra == ({"ttft.png"} if module is report else set())
