"""Run the local stack once per variant (connector switches set through the environment)."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil

from turnkv.local.stack import StackConfig, Supervisor


@contextlib.contextmanager
def stack_with_env(env: dict[str, str], state_dir: Path, port_base: int = 8400, **config) -> Iterator[dict]:
    """Start a stack whose engines see ``env`` (TURNKV_* switches), yield its state (+ model_dir), stop it."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    supervisor = Supervisor(state_dir)
    config.setdefault("prefill_prefix_caching", False)  # the seeds' setting: the A/B measures reuse
    stack = StackConfig(state_dir=state_dir, router_port=port_base, prefill_port=port_base + 10,
                        decode_port=port_base + 20, side_channel_base=port_base - 2760, **config)
    try:
        state = supervisor.up(stack)
        yield {**state, "model_dir": stack.model_dir}
    finally:
        supervisor.down()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def group_cpu_seconds(pgid: int) -> float:
    """CPU seconds used so far by every live process of a process group."""
    total = 0.0
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                t = proc.cpu_times()
                total += t.user + t.system
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    return total


def cpu_percent_over(pgids: list[int], seconds: float) -> list[float]:
    """Percent of one core each process group used over the same ``seconds``."""
    start_cpu, start = [group_cpu_seconds(g) for g in pgids], time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - start
    return [100 * (group_cpu_seconds(g) - c) / elapsed for g, c in zip(pgids, start_cpu, strict=True)]


def report(rows: list[dict], out: Path, columns: dict[str, Callable[[dict], object]]) -> None:
    """Write ``rows`` to out/summary.json and print them as a Markdown table (header -> cell)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(rows, indent=2))
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(cell(row)) for cell in columns.values()) + " |")
