"""`turnkv plan calibrate`: measure this machine's engines and store the local-cpu constants.

Prefills only, plus one pull: a few prompts of different lengths sent straight to the prefill engine
(prefix caching off, one output token) give the achieved FLOP/s (the slope against each prompt's FLOPs,
attention included) and one engine hop's fixed cost (the intercept); one two-turn conversation through
the router gives the NIXL transfers (decode's P->D reads and prefill's D->P pull, from the engines'
``vllm:nixl_*`` metrics), fitted as set-up + bytes / bandwidth. Nothing here looks at multi-turn TTFT,
which is what the planner then predicts. ``fit_prefill`` and ``fit_transfers`` are pure.
"""

from __future__ import annotations

import json
import socket
import statistics
import time
import urllib.request
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from turnkv.metric_names import VLLM_NIXL_BYTES, VLLM_NIXL_XFER_TIME
from turnkv.plan import hardware
from turnkv.plan.models import ModelArch

LENGTHS = (256, 1024, 2048, 4096, 6144)


def fit_prefill(arch: ModelArch, points: Sequence[tuple[int, float]],
                peak: float = float("inf")) -> tuple[float, float, float]:
    """(fixed seconds per request, achieved GEMM FLOP/s, achieved attention FLOP/s) from (prompt tokens,
    seconds) of plain prefills: non-negative least squares on seconds = fixed + linear FLOPs / R +
    attention FLOPs / Ra (every subset of the three terms, the best fit with no negative coefficient). A
    rate the data cannot see (its term fitted as free) is bounded by ``peak``, the hardware's nominal one."""
    n = np.array([p[0] for p in points], dtype=float)
    secs = np.array([p[1] for p in points], dtype=float)
    if len(points) < 2 or secs[np.argmax(n)] <= secs[np.argmin(n)]:
        raise ValueError("prefill time did not grow with prompt length: the measurements are noise")
    columns = np.column_stack([np.ones_like(n), arch.linear_flops_per_token() * n,
                               [arch.attention_flops(x, 0.0) for x in n]])
    best: tuple[float, np.ndarray] | None = None
    for mask in ((0, 1, 2), (1, 2), (0, 2), (0, 1), (2,), (1,)):
        if len(points) < len(mask):
            continue
        coef, *_ = np.linalg.lstsq(columns[:, mask], secs, rcond=None)
        if (coef < 0).any() or not (coef[[i for i, m in enumerate(mask) if m > 0]] > 0).any():
            continue
        full = np.zeros(3)
        full[list(mask)] = coef
        err = float(((columns @ full - secs) ** 2).sum())
        if best is None or err < best[0] - 1e-15:
            best = (err, full)
    if best is None:
        raise ValueError("prefill time did not grow with prompt length: the measurements are noise")
    fixed, per_lin, per_att = best[1]
    rate_lin = min(peak, 1 / per_lin) if per_lin > 0 else peak
    rate_att = min(peak, 1 / per_att) if per_att > 0 else peak
    return float(fixed), float(rate_lin), float(rate_att)


def fit_transfers(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(set-up seconds, bytes/s) from (bytes, seconds) of single NIXL transfers."""
    pts = [(b, s) for b, s in points if b > 0 and s > 0]
    if not pts:
        raise ValueError("no NIXL transfer was measured (is the connector's KV transfer working?)")
    b = np.array([p[0] for p in pts])
    s = np.array([p[1] for p in pts])
    if len(pts) >= 2 and np.ptp(b) > 0.2 * b.max():
        slope, intercept = np.polyfit(b, s, 1)
        if slope > 0 and intercept >= 0:
            return float(intercept), float(1.0 / slope)
    return 0.0, float(b.sum() / s.sum())


def constants(arch: ModelArch, inst: hardware.Instance, prefill: tuple[float, float, float],
              transfer: tuple[float, float], raw: dict[str, Any]) -> dict[str, Any]:
    """The calibration file's content."""
    hop, achieved, achieved_attention = prefill
    setup, rate = transfer
    return {
        "instance": inst.name,
        "model": arch.name,
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "achieved_flops_s": achieved,
        "achieved_attention_flops_s": achieved_attention,
        "network_bits_s": rate * 8,
        "efficiency": {"dense": achieved / inst.peak(arch.dtype),
                       "attention": achieved_attention / inst.peak(arch.dtype), "request_overhead_s": hop,
                       "transfer_setup_s": setup, "transfer_efficiency": 1.0},
        "raw": raw,
    }


# -- measurement (I/O) ----------------------------------------------------------------------------


def _post(url: str, body: dict[str, Any], timeout: float = 300) -> tuple[float, dict[str, Any], dict[str, str]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        data = json.loads(resp.read())
        return time.perf_counter() - started, data, dict(resp.headers)


def nixl_totals(engine_url: str) -> tuple[float, float, float]:
    """(seconds, bytes, transfers) summed over the engine's NIXL histograms."""
    with urllib.request.urlopen(engine_url.rstrip("/") + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    secs = byts = count = 0.0
    for line in text.splitlines():
        if line.startswith(VLLM_NIXL_XFER_TIME + "_sum"):
            secs += float(line.rsplit(" ", 1)[1])
        elif line.startswith(VLLM_NIXL_XFER_TIME + "_count"):
            count += float(line.rsplit(" ", 1)[1])
        elif line.startswith(VLLM_NIXL_BYTES + "_sum"):
            byts += float(line.rsplit(" ", 1)[1])
    return secs, byts, count


def measure_prefills(prefill_url: str, model: str, words: list[str], lengths: Sequence[int] = LENGTHS,
                     repeats: int = 3, say: Callable[[str], None] = print) -> list[tuple[int, float]]:
    """Median latency of one-token completions straight to the prefill engine, by prompt length."""
    rng = np.random.default_rng(11)
    url = prefill_url.rstrip("/") + "/v1/completions"
    _post(url, {"model": model, "prompt": " ".join(words[:64]), "max_tokens": 1, "temperature": 0})  # warm-up
    points = []
    for n in lengths:
        runs, tokens = [], n
        for _ in range(repeats):
            prompt = " ".join(rng.choice(words, size=n))
            secs, data, _ = _post(url, {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
            tokens = int(data.get("usage", {}).get("prompt_tokens") or n)
            runs.append(secs)
            time.sleep(1.2)  # engines busy-loop for about a second after a request: let the core settle
        points.append((tokens, statistics.median(runs)))
        say(f"prefill {tokens:>5} tokens: {statistics.median(runs) * 1000:.0f} ms "
            f"(runs {[round(r * 1000) for r in runs]})")
    return points


def measure_pull(router_url: str, prefill_url: str, decode_url: str, model: str, words: list[str],
                 say: Callable[[str], None] = print) -> list[tuple[float, float]]:
    """A two-turn conversation through the router: each NIXL transfer's (bytes, seconds)."""
    rng = np.random.default_rng(12)
    conv = f"plan-calibrate-{int(time.time())}"
    url = router_url.rstrip("/") + "/v1/chat/completions"
    messages = [{"role": "user", "content": " ".join(rng.choice(words, size=1500))}]
    points = []
    for turn in range(2):
        before = {u: nixl_totals(u) for u in (prefill_url, decode_url)}
        _, data, headers = _post(url, {"model": model, "messages": messages, "max_tokens": 16, "temperature": 0,
                                       "conversation_id": conv})
        time.sleep(1.5)  # the transfer's metrics are published on the engines' next stats tick
        for u, role in ((decode_url, "P->D"), (prefill_url, "D->P")):
            after = nixl_totals(u)
            secs, byts, count = (a - b for a, b in zip(after, before[u], strict=True))
            if count > 0:
                points.append((byts / count, secs / count))
                say(f"turn {turn + 1} {role}: {count:.0f} transfer(s), {byts / 2**20:.1f} MiB in {secs * 1000:.1f} ms")
        reply = data["choices"][0]["message"]["content"]
        messages += [{"role": "assistant", "content": reply},
                     {"role": "user", "content": " ".join(rng.choice(words, size=300))}]
        if turn == 1 and int(headers.get("X-TurnKV-Reused-Tokens", 0) or 0) == 0:
            say("warning: the second turn reused no tokens (reuse off on this router?)")
    return points


def refit(state_dir: Path) -> dict[str, Any]:
    """Fit the stored raw measurements again (after a change to the fits), without new measurements."""
    from turnkv.plan.models import tiny_local

    path = state_dir / hardware.CALIBRATION_FILE
    old = json.loads(path.read_text())
    arch, inst = tiny_local(), hardware.INSTANCES["local-cpu"]
    raw = old["raw"]
    result = constants(arch, inst, fit_prefill(arch, raw["prefills"], inst.peak(arch.dtype)),
                       fit_transfers(raw["transfers"]), raw)
    result["measured_at"] = old["measured_at"]
    path.write_text(json.dumps(result, indent=2))
    return result


def run(state_dir: Path, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Start the local stack, measure, stop it; write and return the calibration."""
    from turnkv.commands.local import start_stack
    from turnkv.local.model import load_words
    from turnkv.local.stack import SERVED_MODEL_NAME, StackConfig, Supervisor
    from turnkv.plan.models import tiny_local

    config = StackConfig(state_dir=state_dir)
    state = start_stack(config)
    try:
        comps = state["components"]
        words = load_words(config.model_dir)
        prefill_url, decode_url = comps["prefill-0"]["url"], comps["decode-0"]["url"]
        prefills = measure_prefills(prefill_url, SERVED_MODEL_NAME, words, say=say)
        transfers = measure_pull(comps["router"]["url"], prefill_url, decode_url, SERVED_MODEL_NAME, words, say=say)
    finally:
        Supervisor(state_dir).down()
    arch, inst = tiny_local(), hardware.INSTANCES["local-cpu"]
    try:
        transfer = fit_transfers(transfers)
    except ValueError as exc:  # keep the prefill measurements; say what is missing
        say(f"warning: {exc}; keeping the table's transfer placeholders")
        transfer = (inst.efficiency.transfer_setup_s, inst.network_bits_s / 8)
    result = constants(arch, inst, fit_prefill(arch, prefills, inst.peak(arch.dtype)), transfer,
                       {"prefills": prefills, "transfers": transfers})
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / hardware.CALIBRATION_FILE).write_text(json.dumps(result, indent=2))
    return result
