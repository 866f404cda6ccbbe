"""`turnkv plan calibrate`: measure this machine's engines and store the local-cpu constants.

Prefills only, plus one pull: a few prompts of different lengths sent straight to the prefill engine
(prefix caching off, one output token) give the achieved FLOP/s (the slope against each prompt's FLOPs,
attention included) and one engine hop's fixed cost (the intercept); one two-turn conversation through
the router gives the NIXL transfers (decode's P->D reads and prefill's D->P pull, from the engines'
``vllm:nixl_*`` metrics), fitted as set-up + bytes / bandwidth. Nothing here looks at multi-turn TTFT,
which is what the planner then predicts. ``fit_prefill`` and ``fit_transfers`` are pure.
"""

from __future__ import annotations

import itertools
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
from turnkv.plan.architectures import ModelArch

#: Plain prefills (prompt tokens): one short enough to be all fixed cost, then single- and multi-chunk ones.
LENGTHS = (16, 256, 1024, 2048, 4096, 6144)
#: Prefills over a prefix-cached context (context tokens, new tokens), as a pulled history is prefilled.
CONTEXT_PREFILLS = ((1024, 256), (3072, 128), (3072, 512))


def design(arch: ModelArch, chunk: int, new: Any, context: Any) -> np.ndarray:
    """The fit's columns for prefills of ``new`` tokens after ``context`` cached ones: fixed cost, linear
    FLOPs, fresh and context attention FLOPs (chunked as the engine does), and chunks after the first."""
    from turnkv.plan.closed_form import chunked_attention_flops

    new, context = np.atleast_1d(np.asarray(new, dtype=float)), np.atleast_1d(np.asarray(context, dtype=float))
    fresh, ctx = chunked_attention_flops(arch, new, context, chunk)
    extra = np.maximum(np.ceil(new / chunk) - 1, 0)
    return np.column_stack([np.ones_like(new), arch.linear_flops_per_token() * new, fresh, ctx, extra])


def fit_prefill(arch: ModelArch, points: Sequence[Sequence[float]], chunk: int,
                peak: float = float("inf")) -> dict[str, float]:
    """The prefill constants from (new tokens, cached context tokens, seconds) of one-token completions.

    Non-negative least squares on relative error (every subset of the five columns of ``design``, the
    best fit with no negative coefficient): seconds = hop + linear FLOPs / R + fresh attention / Ra +
    context attention / Rc + extra chunks x step. A rate whose term the data cannot see (fitted as free)
    is bounded by ``peak``, the hardware's nominal one; attention over context the data does not reach
    takes the fresh attention's rate."""
    pts = [(float(p[0]), float(p[1]), float(p[2])) if len(p) == 3 else (float(p[0]), 0.0, float(p[1]))
           for p in points]
    plain = sorted((n, secs) for n, h, secs in pts if h == 0)
    if len(plain) < 2 or plain[-1][1] <= plain[0][1]:
        raise ValueError("prefill time did not grow with prompt length: the measurements are noise")
    new, ctx, secs = (np.array(col) for col in zip(*pts, strict=True))
    columns = design(arch, chunk, new, ctx) / secs[:, None]
    target = np.ones_like(secs)
    best: tuple[float, np.ndarray] | None = None
    for size in range(len(columns[0]), 0, -1):
        for mask in itertools.combinations(range(len(columns[0])), size):
            if not set(mask) & {1, 2, 3} or len(pts) < len(mask):
                continue
            coef, *_ = np.linalg.lstsq(columns[:, mask], target, rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(len(columns[0]))
            full[list(mask)] = coef
            err = float(((columns @ full - target) ** 2).sum())
            if best is None or err < best[0] - 1e-15:
                best = (err, full)
    if best is None or not (best[1][1:4] > 0).any():
        raise ValueError("prefill time did not grow with prompt length: the measurements are noise")
    hop, per_lin, per_fresh, per_ctx, step = (float(c) for c in best[1])
    rate_lin = min(peak, 1 / per_lin) if per_lin > 0 else peak
    rate_fresh = min(peak, 1 / per_fresh) if per_fresh > 0 else peak
    rate_ctx = min(peak, 1 / per_ctx) if per_ctx > 0 else rate_fresh
    return {"hop_s": hop, "linear_flops_s": rate_lin, "attention_flops_s": rate_fresh,
            "context_attention_flops_s": rate_ctx, "step_s": step}


def prefill_band(data: dict[str, Any]) -> float | None:
    """The relative uncertainty of a calibration file's prefill fit: the RMS relative residual of its raw points
    over points minus fitted terms (None without raw points, or with no residual degree of freedom)."""
    from turnkv.plan.architectures import tiny_local

    raw = data.get("raw") or {}
    pts = [p for p in raw.get("prefills", []) + raw.get("context_prefills", []) if len(p) == 3]
    if not pts or data.get("model", "tiny-local") != "tiny-local":
        return None
    e = data["efficiency"]
    coef = np.array([e["request_overhead_s"], 1 / data["achieved_flops_s"], 1 / data["achieved_attention_flops_s"],
                     1 / data["achieved_context_attention_flops_s"], e.get("step_overhead_s", 0.0)])
    new, ctx, secs = (np.array(col, dtype=float) for col in zip(*pts, strict=True))
    inst = hardware.INSTANCES["local-cpu"]
    rel = design(tiny_local(), inst.prefill_chunk_tokens, new, ctx) @ coef / secs - 1
    dof = len(pts) - int((coef > 0).sum())
    return round(float(np.sqrt((rel**2).sum() / dof)), 3) if dof > 0 else None


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


def constants(arch: ModelArch, inst: hardware.Instance, prefill: dict[str, float],
              transfer: tuple[float, float], raw: dict[str, Any]) -> dict[str, Any]:
    """The calibration file's content."""
    setup, rate = transfer
    peak = inst.peak(arch.dtype)
    return {
        "instance": inst.name,
        "model": arch.name,
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "achieved_flops_s": prefill["linear_flops_s"],
        "achieved_attention_flops_s": prefill["attention_flops_s"],
        "achieved_context_attention_flops_s": prefill["context_attention_flops_s"],
        "network_bits_s": rate * 8,
        "efficiency": {"dense": prefill["linear_flops_s"] / peak, "attention": prefill["attention_flops_s"] / peak,
                       "context_attention": prefill["context_attention_flops_s"] / peak,
                       "request_overhead_s": prefill["hop_s"], "step_overhead_s": prefill["step_s"],
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


def _complete(url: str, model: str, prompt: str) -> tuple[float, int]:
    secs, data, _ = _post(url, {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    return secs, int(data.get("usage", {}).get("prompt_tokens") or 0)


def measure_prefills(prefill_url: str, model: str, words: list[str], lengths: Sequence[int] = LENGTHS,
                     repeats: int = 3, say: Callable[[str], None] = print) -> list[tuple[int, int, float]]:
    """Median latency of one-token completions straight to the prefill engine, by prompt length:
    (prompt tokens, 0 cached, seconds)."""
    rng = np.random.default_rng()  # fresh words each run: nothing may be served from a prefix cache
    url = prefill_url.rstrip("/") + "/v1/completions"
    _complete(url, model, " ".join(words[:64]))  # warm-up
    points = []
    for n in lengths:
        runs, tokens = [], n
        for _ in range(repeats if n > 64 else 2 * repeats + 1):  # the short one is all fixed cost: noisier
            secs, tokens = _complete(url, model, " ".join(rng.choice(words, size=n)))
            runs.append(secs)
            time.sleep(1.2)  # engines busy-loop for about a second after a request: let the core settle
        points.append((tokens or n, 0, statistics.median(runs)))
        say(f"prefill {tokens:>5} tokens: {statistics.median(runs) * 1000:.0f} ms "
            f"(runs {[round(r * 1000) for r in runs]})")
    return points


def measure_context_prefills(engine_url: str, model: str, words: list[str], block_size: int,
                             shapes: Sequence[tuple[int, int]] = CONTEXT_PREFILLS, repeats: int = 3,
                             say: Callable[[str], None] = print) -> list[tuple[int, int, float]]:
    """Prefills over a cached context on an engine with prefix caching (the local stack's decode): a
    prompt, then the same prompt plus more. vLLM caches whole blocks, so the context is the first
    prompt's full blocks and the rest is computed: (new tokens, context tokens, seconds)."""
    rng = np.random.default_rng()  # fresh words each run: nothing may be served from a prefix cache
    url = engine_url.rstrip("/") + "/v1/completions"
    points = []
    for ctx_words, new_words in shapes:
        runs, new, ctx = [], 0, 0
        for _ in range(repeats):
            first = " ".join(rng.choice(words, size=ctx_words))
            _, n1 = _complete(url, model, first)
            time.sleep(1.2)
            secs, n2 = _complete(url, model, first + " " + " ".join(rng.choice(words, size=new_words)))
            time.sleep(1.2)
            ctx = n1 // block_size * block_size
            new = n2 - ctx
            runs.append(secs)
        points.append((new, ctx, statistics.median(runs)))
        say(f"prefill {new:>5} tokens over {ctx} cached: {statistics.median(runs) * 1000:.0f} ms "
            f"(runs {[round(r * 1000) for r in runs]})")
    return points


def measure_pull(router_url: str, prefill_url: str, decode_url: str, model: str, words: list[str],
                 say: Callable[[str], None] = print) -> list[tuple[float, float]]:
    """A two-turn conversation through the router: each NIXL transfer's (bytes, seconds)."""
    rng = np.random.default_rng()  # fresh words each run: nothing may be served from a prefix cache
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


def measure(components: dict[str, Any], words: list[str], repeats: int = 3,
            say: Callable[[str], None] = print) -> dict[str, list]:
    """Everything a calibration measures on a running local stack (its ``components``): the raw points."""
    from turnkv.engine_args import EngineSpec
    from turnkv.local.stack import SERVED_MODEL_NAME

    prefill, decode = components["prefill-0"]["url"], components["decode-0"]["url"]
    return {
        "prefills": measure_prefills(prefill, SERVED_MODEL_NAME, words, repeats=repeats, say=say),
        # The prefill engine runs without prefix caching (as the product does); decode's cache gives the
        # prefills over a context that a pulled history makes, on the same kind of core.
        "context_prefills": measure_context_prefills(decode, SERVED_MODEL_NAME, words, EngineSpec.block_size,
                                                     repeats=repeats, say=say),
        "transfers": measure_pull(components["router"]["url"], prefill, decode, SERVED_MODEL_NAME, words, say=say),
    }


def fit_raw(raw: dict[str, list], transfer: tuple[float, float] | None = None) -> dict[str, Any]:
    """The local-cpu calibration file's content from raw points (``transfer``: set-up and rate to use instead
    of fitting ``raw["transfers"]``)."""
    from turnkv.plan.architectures import tiny_local

    arch, inst = tiny_local(), hardware.INSTANCES["local-cpu"]
    points = raw["prefills"] + raw.get("context_prefills", [])
    prefill = fit_prefill(arch, points, inst.prefill_chunk_tokens, inst.peak(arch.dtype))
    return constants(arch, inst, prefill, transfer or fit_transfers(raw["transfers"]), raw)


def refit(state_dir: Path) -> dict[str, Any]:
    """Fit the stored raw measurements again (after a change to the fits), without new measurements."""
    path = state_dir / hardware.CALIBRATION_FILE
    old = json.loads(path.read_text())
    result = fit_raw(old["raw"])
    result["measured_at"] = old["measured_at"]
    path.write_text(json.dumps(result, indent=2))
    return result


def run(state_dir: Path, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Start the local stack, measure, stop it; write and return the calibration."""
    from turnkv.local.model import load_words
    from turnkv.local.stack import StackConfig, Supervisor
    from turnkv.local.start import start_stack

    config = StackConfig(prefill_prefix_caching=False, state_dir=state_dir)
    state = start_stack(config)
    try:
        raw = measure(state["components"], load_words(config.model_dir), say=say)
    finally:
        Supervisor(state_dir).down()
    try:
        transfer = fit_transfers(raw["transfers"])
    except ValueError as exc:  # keep the prefill measurements; say what is missing
        say(f"warning: {exc}; keeping the table's transfer placeholders")
        inst = hardware.INSTANCES["local-cpu"]
        transfer = (inst.efficiency.transfer_setup_s, inst.network_bits_s / 8)
    result = fit_raw(raw, transfer)
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / hardware.CALIBRATION_FILE).write_text(json.dumps(result, indent=2))
    return result
