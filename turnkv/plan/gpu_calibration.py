"""GPU constants fitted to published measurements (turnkv/plan/data/gpu_measurements.json).

Each TTFT row is split into what the fit solves for and what the priors in ``hardware.py`` give:

    TTFT = FLOPs at peak x c_dense (dense models) or c_moe (MoE models) + 2 hops x c_hop
           + pulled turn x c_pull + [transfers + decode's first step + all-reduces]  (priors)

so 1 / c_dense and 1 / c_moe are the achieved fractions of peak (``Efficiency.dense``, ``.moe``), c_hop is
``request_overhead_s`` and c_pull ``pull_overhead_s``. The fit is non-negative least squares on relative
error over the rows marked ``calibration`` (every subset of the columns, the best fit with no negative
coefficient), with every achieved factor capped by the kernel bounds marked ``constraint``. A term the rows
do not determine (fitting it lowers the RMS relative error by under ``IDENTIFIED``) keeps its prior from
hardware.py (``select``). Rows marked ``held_out`` are only compared. Pure apart from reading the data file.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any

import numpy as np

from turnkv.plan import architectures, closed_form, hardware

#: The fitted columns, in order.
COLUMNS = ("dense_compute", "moe_compute", "hops", "pull")
#: The compute columns (their coefficients are 1 / achieved fraction of peak, bounded by the kernel bounds).
COMPUTE = ("dense_compute", "moe_compute")
#: The prior terms each row's known part sums (the ablation drops them one at a time).
KNOWN = ("transfers", "handover", "first_decode_step", "allreduce")
#: Instances whose achieved factors are the GPU ones: trn1 runs them as a what-if (it is not deployable); trn2 has
#: its own, fitted to published Neuron measurements (turnkv.plan.neuron_calibration).
GPU_FACTOR_INSTANCES = ("p5en.48xlarge", "p5e.48xlarge", "p5.48xlarge", "trn1.32xlarge")
#: Columns never fitted: held at their priors. The pull's fixed cost is the sum of named components, each from a
#: published measurement (hardware.GPU_PULL); fitting it to the seeds' two reuse-on cells gave 246 ms that named
#: nothing (issue #39).
NEVER_FITTED = ("pull",)


def load_data() -> dict[str, Any]:
    """The packaged measurements file."""
    text = resources.files("turnkv.plan").joinpath("data/gpu_measurements.json").read_text()
    return json.loads(text)


@dataclass(frozen=True)
class Terms:
    """One TTFT row split into the fit's columns (seconds per unit coefficient) and the prior part (seconds)."""

    columns: dict[str, float]
    known: dict[str, float]


def row_fleet(row: dict[str, Any], inst: hardware.Instance, assumptions: dict[str, Any]) -> closed_form.Fleet:
    """The fleet a measurement ran on, as the data file's assumptions describe it: the row's instance type (its
    peaks and HBM) with ``inst``'s efficiency, the row's model at the row's GEMM precision when it states one."""
    machine = replace(hardware.INSTANCES[row.get("instance", inst.name)], efficiency=inst.efficiency)
    model = architectures.load(row["model"]).with_dtypes(dtype=row.get("dtype"))
    return closed_form.Fleet(model, machine, machine, tp_prefill=row["tp"], tp_decode=row["tp"],
                            block_size=int(assumptions["block_size"]), mode=assumptions["mode"],
                            ttl_s=float(assumptions["ttl_s"]), threshold=int(assumptions["threshold"]),
                            prefill_prefix_caching=False)


def colocated(row: dict[str, Any]) -> bool:
    """A row measured on one engine (no P/D split): no KV transfer, the first token comes out of the prefill step,
    and ``row["hops"]`` engine hops (0 for an in-process benchmark, 1 for one server) instead of the P/D path's 2."""
    return row.get("setup") == "colocated"


def unit_instance(inst: hardware.Instance) -> hardware.Instance:
    """``inst`` with every fitted constant at 1 (factors) or 0 (fixed costs): the fit's basis."""
    eff = replace(inst.efficiency, dense=1.0, moe=1.0, attention=None, context_attention=None, step_overhead_s=0.0,
                  request_overhead_s=0.0, pull_components=())
    return replace(inst, efficiency=eff)


def terms(row: dict[str, Any], inst: hardware.Instance, assumptions: dict[str, Any]) -> Terms:
    """The fit's columns and the prior part of one TTFT row."""
    fleet = row_fleet(row, unit_instance(inst), assumptions)
    prompt, new = float(row["prompt_tokens"]), float(row["new_tokens"])
    if colocated(row):
        flops_s, _, allreduce = closed_form.compute_parts(fleet, [prompt], [0.0])
        if not assumptions.get("attention", True):
            flops_s = closed_form.linear_compute_s(fleet, [prompt])
        moe = fleet.model.moe
        return Terms({"dense_compute": 0.0 if moe else float(flops_s[0]), "moe_compute": float(flops_s[0]) if moe
                      else 0.0, "hops": float(row["hops"]), "pull": 0.0},
                     {"transfers": 0.0, "handover": 0.0, "first_decode_step": 0.0, "allreduce": float(allreduce[0])})
    history = prompt - new
    computed, context = (new, history) if row["reuse"] else (prompt, 0.0)
    flops_s, _, allreduce = closed_form.compute_parts(fleet, [computed], [context])
    if not assumptions.get("attention", True):  # the ablation's "attention" term: GEMMs only
        flops_s = closed_form.linear_compute_s(fleet, [computed])
    pd = closed_form.transfer_s(fleet, [new], setup=fleet.mode != "push")
    transfers = float(pd[0]) + (float(closed_form.transfer_s(fleet, [history])[0]) if row["reuse"] else 0.0)
    moe = fleet.model.moe
    columns = {"dense_compute": 0.0 if moe else float(flops_s[0]), "moe_compute": float(flops_s[0]) if moe else 0.0,
               "hops": 2.0, "pull": 1.0 if row["reuse"] else 0.0}
    known = {"transfers": transfers, "handover": fleet.prefill.efficiency.pd_handover_s,
             "first_decode_step": float(closed_form.decode_step_s(fleet, [prompt])[0]),
             "allreduce": float(allreduce[0])}
    return Terms(columns, known)


def nnls_relative(design: np.ndarray, target: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Non-negative least squares on relative error: min sum(((design @ c - target) / scale)^2), c >= 0, by
    every subset of columns (the fewest columns among fits within 1e-12 of the best)."""
    a, b = design / scale[:, None], target / scale
    n = design.shape[1]
    best: tuple[float, int, np.ndarray] | None = None
    for size in range(1, n + 1):
        for mask in itertools.combinations(range(n), size):
            sub = a[:, mask]
            if not sub.any(axis=0).all():  # a column no row uses
                continue
            coef, *_ = np.linalg.lstsq(sub, b, rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(n)
            full[list(mask)] = coef
            err = float(((a @ full - b) ** 2).sum())
            if best is None or err < best[0] - 1e-12:
                best = (err, size, full)
    if best is None:
        raise ValueError("no non-negative fit")
    return best[2]


def fit(rows: list[dict[str, Any]], inst: hardware.Instance, assumptions: dict[str, Any],
        columns: tuple[str, ...] = COLUMNS, known: tuple[str, ...] = KNOWN,
        fixed: dict[str, float] | None = None) -> dict[str, float]:
    """Coefficients of ``columns`` fitted to ``rows`` (the ``known`` prior terms subtracted); a column in ``fixed``
    takes that value instead of being fitted, any other column not in ``columns`` is 0 (left out of the model)."""
    fixed = fixed or {}
    split = [terms(r, inst, assumptions) for r in rows]
    free = tuple(c for c in columns if c not in fixed)
    design = np.array([[t.columns[c] for c in free] for t in split]).reshape(len(rows), len(free))
    target = np.array([r["measured_ms"] / 1000 - sum(t.known[k] for k in known) for r, t in zip(rows, split,
                                                                                                  strict=True)])
    if (target <= 0).any():
        raise ValueError("a measurement is below the prior terms alone: the priors are wrong for it")
    target -= np.array([sum(v * t.columns[c] for c, v in fixed.items()) for t in split])
    out = {c: fixed.get(c, 0.0) for c in COLUMNS}
    if not free:
        return out
    # Achieved factors at most the bound: a compute coefficient (1 / factor) at least 1 / bound, fitted as that
    # floor (moved into the known part) plus a non-negative excess.
    floor = np.array([1 / max_fraction(assumptions) if c in COMPUTE else 0.0 for c in free])
    measured = np.array([r["measured_ms"] / 1000 for r in rows])
    coef = floor + nnls_relative(design, target - design @ floor, measured)
    return out | {c: float(coef[i]) for i, c in enumerate(free)}


def rms_error(rows: list[dict[str, Any]], coef: dict[str, float], inst: hardware.Instance,
              assumptions: dict[str, Any], known: tuple[str, ...] = KNOWN) -> float:
    """RMS relative error of the fit's linear form over ``rows``."""
    return math.sqrt(sum((linear_prediction(r, coef, inst, assumptions, known) * 1000 / r["measured_ms"] - 1) ** 2
                         for r in rows) / len(rows))


def prior_coefficients(prior: hardware.Efficiency) -> dict[str, float]:
    """The columns' values the priors in hardware.py give."""
    return {"dense_compute": 1 / prior.dense, "moe_compute": 1 / prior.moe, "hops": prior.request_overhead_s,
            "pull": prior.pull_overhead_s}


#: A term whose own fitted value lowers the calibration's RMS relative error by less than this keeps its prior:
#: the data does not determine it (another term absorbs it).
IDENTIFIED = 0.001


def select(rows: list[dict[str, Any]], inst: hardware.Instance,
           assumptions: dict[str, Any]) -> tuple[dict[str, float], tuple[str, ...]]:
    """The fit with every term the rows do not determine held at its prior (greedily, the least useful first),
    and the terms left at their priors."""
    priors = prior_coefficients(inst.efficiency)
    at_prior: dict[str, float] = {c: priors[c] for c in NEVER_FITTED}
    while True:
        best = fit(rows, inst, assumptions, fixed=at_prior)
        base = rms_error(rows, best, inst, assumptions)
        gains = {c: rms_error(rows, fit(rows, inst, assumptions, fixed=at_prior | {c: priors[c]}), inst, assumptions)
                 - base for c in COLUMNS if c not in at_prior and len(at_prior) < len(COLUMNS) - 1}
        weakest = min(gains, key=gains.__getitem__, default=None)
        if weakest is None or gains[weakest] >= IDENTIFIED:
            return best, tuple(at_prior)
        at_prior[weakest] = priors[weakest]


def max_fraction(assumptions: dict[str, Any]) -> float:
    """The highest achieved fraction of peak the fit may give a compute factor (the data's kernel bounds)."""
    return float(assumptions.get("max_fraction_of_peak", 1.0))


def linear_prediction(row: dict[str, Any], coef: dict[str, float], inst: hardware.Instance,
                      assumptions: dict[str, Any], known: tuple[str, ...] = KNOWN) -> float:
    """Seconds the fit's linear form predicts for a row (the ablation's measure; the planner adds the weight-read
    floor, see ``predict``)."""
    t = terms(row, inst, assumptions)
    return sum(coef[c] * t.columns[c] for c in COLUMNS) + sum(t.known[k] for k in known)


def efficiency(coef: dict[str, float], prior: hardware.Efficiency, rows: int,
               at_prior: tuple[str, ...] = ()) -> hardware.Efficiency:
    """The Efficiency the coefficients make (1 / compute coefficient is the achieved factor)."""
    kept = f"; kept at their priors (not determined by the rows): {', '.join(at_prior)}" if at_prior else ""
    return replace(prior, dense=1 / coef["dense_compute"], moe=1 / coef["moe_compute"],
                   request_overhead_s=coef["hops"],
                   source=f"fitted to {rows} published TTFT measurements (turnkv/plan/data/gpu_measurements.json)"
                          f"{kept}; transfers, decode and all-reduce from the priors in turnkv/plan/hardware.py")


def settings(data: dict[str, Any]) -> dict[str, Any]:
    """The rows' shared assumptions, with the tightest kernel bound marked ``constraint`` as the factors' cap."""
    bounds = [b["max_fraction_of_peak"] for b in data["kernel_bounds"] if b["split"] == "constraint"]
    return data["ttft_assumptions"] | {"max_fraction_of_peak": min(bounds, default=1.0)}


def calibration_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in data["ttft"] if r["split"] == "calibration"]


@functools.cache
def calibrated_efficiency() -> hardware.Efficiency:
    """The GPU Efficiency fitted to the data file's calibration rows (all on p5en.48xlarge)."""
    data = load_data()
    rows = calibration_rows(data)
    base = hardware.INSTANCES["p5en.48xlarge"]
    coef, at_prior = select(rows, base, settings(data))
    return efficiency(coef, base.efficiency, len(rows), at_prior)


def calibrated(inst: hardware.Instance) -> hardware.Instance:
    """``inst`` with the GPU factors fitted to the data file when it runs them; otherwise unchanged."""
    if inst.name not in GPU_FACTOR_INSTANCES:
        return inst
    fitted = calibrated_efficiency()
    eff = replace(inst.efficiency, dense=fitted.dense, moe=fitted.moe, request_overhead_s=fitted.request_overhead_s,
                  source=fitted.source, ttft_band=band(),
                  ttft_band_source=band_details()["source"])
    return replace(inst, efficiency=eff)


# -- the report: errors, held-out checks, ablation, band ------------------------------------------


def predict(row: dict[str, Any], inst: hardware.Instance, assumptions: dict[str, Any]) -> closed_form.TurnCosts:
    """The planner's own costs for a row's turn on ``inst``."""
    fleet = row_fleet(row, inst, assumptions)
    prompt = float(row["prompt_tokens"])
    return closed_form.turn_costs(fleet, [prompt], [prompt - float(row["new_tokens"])])


def predicted_ttft_s(row: dict[str, Any], inst: hardware.Instance, assumptions: dict[str, Any]) -> float:
    """The planner's TTFT for a row with ``inst``'s efficiency: its P/D turn (``predict``), or for a colocated row
    the planner's own prefill (``closed_form.compute_s``: compute, weight-read floor, all-reduces) plus the row's
    hops at the per-hop cost."""
    if colocated(row):
        fleet = row_fleet(row, inst, assumptions)
        prefill = float(closed_form.compute_s(fleet, [float(row["prompt_tokens"])], [0.0])[0])
        return row["hops"] * inst.efficiency.request_overhead_s + prefill
    costs = predict(row, inst, assumptions)
    return float((costs.ttft_on if row["reuse"] else costs.ttft_off)[0])


def ttft_errors(inst: hardware.Instance, data: dict[str, Any]) -> list[dict[str, Any]]:
    """Every TTFT row: measured, predicted by the planner on ``inst``, relative error, split."""
    out = []
    for row in data["ttft"]:
        ms = predicted_ttft_s(row, inst, settings(data)) * 1000
        out.append({"id": row["id"], "source": row["source"], "split": row["split"], "measured_ms": row["measured_ms"],
                    "predicted_ms": round(ms, 1), "error": round(ms / row["measured_ms"] - 1, 4)})
    return out


def transfer_checks(inst: hardware.Instance, data: dict[str, Any]) -> list[dict[str, Any]]:
    """Held-out transfer ranges: the planner's D->P transfer against each range (0 error inside it)."""
    out = []
    for row in data["transfer_ranges"]:
        ms = float(predict(row | {"reuse": True}, inst, settings(data)).transfer_on[0]) * 1000
        low, high = row["low_ms"], row["high_ms"]
        error = 0.0 if low <= ms <= high else (ms / high - 1 if ms > high else ms / low - 1)
        out.append({"id": row["id"], "source": row["source"], "split": row["split"], "low_ms": low, "high_ms": high,
                    "predicted_ms": round(ms, 1), "error": round(error, 4)})
    return out


def kernel_checks(eff: hardware.Efficiency, data: dict[str, Any]) -> list[dict[str, Any]]:
    """Kernel bounds: whether each fitted compute factor is at or under the bound (the fit keeps it there when the
    bound is a constraint; ``at_bound`` says whether the data pushed it against it)."""
    return [{"id": b["id"], "source": b["source"], "split": b["split"], "bound": b["max_fraction_of_peak"],
             "dense": round(eff.dense, 4), "moe": round(eff.moe, 4),
             "ok": max(eff.dense, eff.moe) <= b["max_fraction_of_peak"] + 1e-9,
             "at_bound": max(eff.dense, eff.moe) >= b["max_fraction_of_peak"] - 1e-6}
            for b in data["kernel_bounds"]]


def leave_one_out(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Each calibration row predicted from a fit to the others, when the others determine it: every column the row
    uses must appear in another row at a quarter of its size or more (a compute factor measured on a 140-token
    prefill does not predict a 20,000-token one)."""
    rows, assumptions = calibration_rows(data), settings(data)
    base = hardware.INSTANCES["p5en.48xlarge"]
    out = []
    for i, row in enumerate(rows):
        rest = rows[:i] + rows[i + 1:]
        x = terms(row, base, assumptions).columns
        others = [terms(r, base, assumptions).columns for r in rest]
        # a column the row uses must be measured by another row at a comparable size (no extrapolation past 4x)
        determined = all(max(o[c] for o in others) >= 0.25 * x[c] for c in COLUMNS if x[c] > 0)
        entry: dict[str, Any] = {"id": row["id"], "measured_ms": row["measured_ms"]}
        if not determined:
            entry |= {"predicted_ms": None, "error": None,
                      "why": "the other rows do not determine it (its model's compute factor rests on it alone)"}
        else:
            coef, at_prior = select(rest, base, assumptions)
            inst = replace(base, efficiency=efficiency(coef, base.efficiency, len(rest), at_prior))
            costs = predict(row, inst, assumptions)
            ms = float((costs.ttft_on if row["reuse"] else costs.ttft_off)[0]) * 1000
            entry |= {"predicted_ms": round(ms, 1), "error": round(ms / row["measured_ms"] - 1, 4)}
        out.append(entry)
    return out


def ridge(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Fits as good as the calibrated one along the dense / per-request trade-off the rows cannot resolve: the dense
    factor at the kernel cap, the calibrated fit, no per-request cost. For each, its constants, RMS error, and two
    consequences for Qwen3-32B on p5en: the break-even threshold for 140-token turns and reuse-off TTFT at 4,567
    prompt tokens (the worked example's first turn)."""
    rows, assumptions = calibration_rows(data), settings(data)
    base = hardware.INSTANCES["p5en.48xlarge"]
    selected, at_prior = select(rows, base, assumptions)
    pull = {c: selected[c] for c in NEVER_FITTED}
    ends = {"dense at the kernel cap": {"dense_compute": 1 / max_fraction(assumptions)} | pull,
            "calibrated": {c: selected[c] for c in at_prior}, "no per-request cost": {"hops": 0.0} | pull}
    out = []
    for name, fixed in ends.items():
        coef = fit(rows, base, assumptions, fixed=fixed)
        inst = replace(base, efficiency=efficiency(coef, base.efficiency, len(rows)))
        fleet = closed_form.Fleet(architectures.load("Qwen3-32B"), inst, inst)
        out.append({"fit": name, "dense": round(1 / coef["dense_compute"], 3), "moe": round(1 / coef["moe_compute"], 3),
                    "hop_ms": round(coef["hops"] * 1000, 1), "pull_ms": round(coef["pull"] * 1000, 1),
                    "rms_error": round(rms_error(rows, coef, base, assumptions), 4),
                    "break_even_tokens": closed_form.break_even_tokens(fleet, 140),
                    "ttft_off_ms_4567": round(float(closed_form.turn_costs(fleet, [4567], [0]).ttft_off[0]) * 1000)})
    return out


def implied_by_held_out(data: dict[str, Any]) -> list[dict[str, Any]]:
    """What each held-out group of one source and model at two or more prompt lengths says on its own: the fixed
    seconds per request and the achieved fraction of its precision's peak that fit its rows (least squares on
    TTFT = fixed + FLOPs at peak / factor + all-reduces). A diagnostic shown next to the fitted constants; the
    planner does not use it (the rows are other stacks, see the data file's split_rule)."""
    assumptions, base = settings(data), hardware.INSTANCES["p5en.48xlarge"]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in data["ttft"]:
        if r["split"] == "held_out" and colocated(r):
            groups.setdefault((r["source"], r["model"]), []).append(r)
    out = []
    for (source, model), rows in groups.items():
        if len({r["prompt_tokens"] for r in rows}) < 2:
            continue
        split = [terms(r, base, assumptions) for r in rows]
        design = np.array([[1.0, t.columns["dense_compute"] + t.columns["moe_compute"]] for t in split])
        target = np.array([r["measured_ms"] / 1000 - sum(t.known.values()) for r, t in zip(rows, split, strict=True)])
        (fixed, coef), *_ = np.linalg.lstsq(design, target, rcond=None)
        out.append({"source": source, "model": model, "dtype": rows[0].get("dtype", "bf16"), "tp": rows[0]["tp"],
                    "hops": rows[0]["hops"], "prompt_tokens": sorted(r["prompt_tokens"] for r in rows),
                    "fixed_ms": round(float(fixed) * 1000, 1), "factor": round(1 / float(coef), 3)})
    return out


def describe(term: str, value: float) -> str:
    """A fitted column's value in the units of its constant."""
    if term in COMPUTE:
        return f"{1 / value:.2f} of peak"
    return f"{value * 1000:.0f} ms per {'hop' if term == 'hops' else 'pull'}"


def ablation(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Calibration error with each term removed (set to 0, the rest refitted as ``select`` left them; "attention":
    the compute columns count GEMM FLOPs only): RMS relative error, and the share of that error the term removes
    (1 - SSE with it / SSE without it)."""
    rows, assumptions = calibration_rows(data), settings(data)
    base = hardware.INSTANCES["p5en.48xlarge"]
    coef, at_prior = select(rows, base, assumptions)
    priors = prior_coefficients(base.efficiency)

    def rms(term: str | None) -> float:
        columns, known = tuple(c for c in COLUMNS if c != term), tuple(k for k in KNOWN if k != term)
        settings_ = assumptions | {"attention": term != "attention"}
        try:
            fitted = fit(rows, base, settings_, columns, known, {c: priors[c] for c in at_prior if c != term})
        except ValueError:
            return math.inf
        return rms_error(rows, fitted, base, settings_, known)

    full = rms(None)
    out: list[dict[str, Any]] = [{"term": "none (the calibrated model)", "rms_error": round(full, 4),
                                  "explains": None, "value": None}]
    for term in (*COLUMNS, "attention", *KNOWN):
        without = rms(term)
        explains = None if not math.isfinite(without) or without == 0 else round(1 - (full / without) ** 2, 4)
        value = ((describe(term, coef[term]) + (" (prior)" if term in at_prior else "")) if term in COLUMNS
                 else "at the compute factors" if term == "attention" else "prior")
        out.append({"term": term, "rms_error": round(without, 4) if math.isfinite(without) else None,
                    "explains": explains, "value": value})
    return out


@functools.cache
def band_details() -> dict[str, Any]:
    """The relative uncertainty the planner states on every GPU TTFT: the larger of the calibration's RMS
    relative residual (over rows minus fitted non-zero terms, the residual degrees of freedom) and the RMS of
    the leave-one-out errors that the data determines."""
    data = load_data()
    rows = calibration_rows(data)
    base = hardware.INSTANCES["p5en.48xlarge"]
    inst = replace(base, efficiency=calibrated_efficiency())
    errors = [e["error"] for e in ttft_errors(inst, data) if e["split"] == "calibration"]
    coef, at_prior = select(rows, base, settings(data))
    dof = max(1, len(rows) - sum(1 for c, v in coef.items() if v > 0 and c not in at_prior))
    residual = math.sqrt(sum(e**2 for e in errors) / dof)
    loo = [e["error"] for e in leave_one_out(data) if e["error"] is not None]
    loo_rms = math.sqrt(sum(e**2 for e in loo) / len(loo)) if loo else 0.0
    value = round(max(residual, loo_rms), 2)
    source = (f"±{value:.0%}: the larger of the GPU fit's RMS relative residual ({residual:.0%}, {len(rows)} "
              f"published TTFT cells, {dof} residual degree(s) of freedom) and the RMS of its {len(loo)} "
              f"leave-one-out errors ({loo_rms:.0%}); turnkv/plan/data/gpu_measurements.json")
    return {"band": value, "residual_rms": round(residual, 4), "dof": dof, "loo_rms": round(loo_rms, 4),
            "source": source}


def band() -> float:
    """See ``band_details``."""
    return float(band_details()["band"])


def report() -> dict[str, Any]:
    """Everything docs/planning.md's calibration section shows."""
    data = load_data()
    inst = calibrated(hardware.INSTANCES["p5en.48xlarge"])
    coef, at_prior = select(calibration_rows(data), hardware.INSTANCES["p5en.48xlarge"], settings(data))
    eff = inst.efficiency
    return {"coefficients": coef, "at_prior": at_prior,
            "efficiency": {"dense": eff.dense, "moe": eff.moe, "request_overhead_s": eff.request_overhead_s,
                           "pull_overhead_s": eff.pull_overhead_s},
            "ttft": ttft_errors(inst, data), "transfers": transfer_checks(inst, data),
            "kernels": kernel_checks(inst.efficiency, data), "leave_one_out": leave_one_out(data),
            "ablation": ablation(data), "ridge": ridge(data), "implied": implied_by_held_out(data), "band": band(),
            "band_details": band_details(),
            "sources": data["sources"]}


def markdown(rep: dict[str, Any] | None = None) -> str:
    """The tables docs/planning.md shows (``python -m turnkv.plan.gpu_calibration --markdown`` prints them)."""
    rep = rep or report()
    lines = ["| measurement | source | measured | predicted | error | split |", "|---|---|---:|---:|---:|---|"]
    for r in rep["ttft"]:
        lines.append(f"| {r['id']} TTFT | {r['source']} | {r['measured_ms']:,.0f} ms | "
                     f"{r['predicted_ms']:,.0f} ms | {r['error']:+.0%} | {r['split']} |")
    for r in rep["transfers"]:
        where = "inside the range" if r["error"] == 0 else f"{r['error']:+.0%} outside the range"
        lines.append(f"| {r['id']} (D->P, longest prompt) | {r['source']} | {r['low_ms']}-{r['high_ms']} ms | "
                     f"{r['predicted_ms']:,.0f} ms | {where} | {r['split']} |")
    for r in rep["leave_one_out"]:
        measured = f"{r['measured_ms']:,.0f} ms"
        if r["error"] is None:
            lines.append(f"| {r['id']} TTFT, fitted without it | seeds-bidir-kv | {measured} | not determined | - | "
                         "held out (leave-one-out) |")
        else:
            lines.append(f"| {r['id']} TTFT, fitted without it | seeds-bidir-kv | {measured} | "
                         f"{r['predicted_ms']:,.0f} ms | {r['error']:+.0%} | held out (leave-one-out) |")
    for k in rep["kernels"]:
        lines.append(f"| {k['id']}: achieved fraction of peak | {k['source']} | at most {k['bound']:.2f} | "
                     f"dense {k['dense']:.2f}, MoE {k['moe']:.2f} | {'ok' if k['ok'] else 'EXCEEDED'} | {k['split']} |")
    lines += ["", "| term removed | RMS error of the calibration rows | share of that error the term removes | value |",
              "|---|---:|---:|---|"]
    for a in rep["ablation"]:
        rms = "-" if a["rms_error"] is None else f"{a['rms_error']:.1%}"
        explains = "-" if a["explains"] is None else f"{a['explains']:.0%}"
        lines.append(f"| {a['term']} | {rms} | {explains} | {a['value'] or ''} |")
    lines += ["", "| equally good fit | dense | MoE | per hop | per pull | RMS error | Qwen3-32B break-even | "
              "Qwen3-32B TTFT off, 4,567 tokens |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rep["ridge"]:
        lines.append(f"| {r['fit']} | {r['dense']:.2f} | {r['moe']:.2f} | {r['hop_ms']:.0f} ms | "
                     f"{r['pull_ms']:.0f} ms | {r['rms_error']:.1%} | {r['break_even_tokens']:,} tokens | "
                     f"{r['ttft_off_ms_4567']} ms |")
    lines += ["", "| held-out rows on their own (not used by the planner) | precision, TP | engine hops | "
              "prompt tokens | fixed per request | achieved fraction of peak |", "|---|---|---:|---|---:|---:|"]
    for r in rep["implied"]:
        prompts = ", ".join(f"{p:,}" for p in r["prompt_tokens"])
        lines.append(f"| {r['source']}: {r['model']} | {r['dtype']}, TP {r['tp']} | {r['hops']} | {prompts} | "
                     f"{r['fixed_ms']:.0f} ms | {r['factor']:.2f} |")
    lines += ["", "Sources:", ""]
    for key, v in rep["sources"].items():
        where = v["url"] or v.get("url_note", "")
        lines.append(f"- `{key}`: {v['title']} ({where}; {v['date'] or 'date not in the copy'}): {v['what']}.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys

    print(markdown() if "--markdown" in sys.argv else json.dumps(report(), indent=2), end="")
