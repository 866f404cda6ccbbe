"""trn2's achieved factors fitted to published AWS Neuron measurements (turnkv/plan/data/neuron_measurements.json).

A colocated TTFT row (one vLLM server, no P/D split) is split as the GPU fit splits it
(``gpu_calibration.terms``):

    TTFT = FLOPs at trn2's BF16 peak x c_dense + hops x c_hop + all-reduces (NeuronLink prior)

c_hop is not determined by rows that all run one hop at one prompt length: it stays at the GPU fit's per-hop
cost (the same vLLM API server in front). 1 / c_dense is trn2's ``Efficiency.dense`` (least squares on relative
error over the ``calibration`` rows). A row's TPOT fits ``decode_bandwidth``: one decode step at the row's mid-
generation context (``closed_form.decode_step_s``) over the measured TPOT. ``held_out`` rows are only compared.
Pure apart from reading the data file.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import replace
from importlib import resources
from typing import Any

from turnkv.plan import closed_form, gpu_calibration, hardware

#: The instance these figures price (the rows' instance type).
INSTANCE = "trn2.48xlarge"


def load_data() -> dict[str, Any]:
    return json.loads(resources.files("turnkv.plan").joinpath("data/neuron_measurements.json").read_text())


def rows(data: dict[str, Any], split: str) -> list[dict[str, Any]]:
    return [r for r in data["ttft"] if r["split"] == split]


def _hop_s() -> float:
    """The per-hop cost the rows cannot determine: the GPU fit's."""
    return gpu_calibration.calibrated_efficiency().request_overhead_s


def fit_dense(calibration: list[dict[str, Any]], inst: hardware.Instance, assumptions: dict[str, Any]) -> float:
    """The achieved fraction of peak that fits the rows' TTFTs (least squares on relative error)."""
    hop = _hop_s()
    num = den = 0.0
    for row in calibration:
        t = gpu_calibration.terms(row, inst, assumptions)
        x = t.columns["dense_compute"]
        y = row["measured_ms"] / 1000 - row["hops"] * hop - t.known["allreduce"]
        if x <= 0 or y <= 0:
            raise ValueError(f"{row['id']}: the priors alone exceed the measurement")
        m = row["measured_ms"] / 1000
        num, den = num + x * y / m**2, den + x * x / m**2
    return den / num  # 1 / c_dense


def decode_step_unit_s(row: dict[str, Any], inst: hardware.Instance, assumptions: dict[str, Any]) -> float:
    """One decode step of the row at decode_bandwidth 1, at its mid-generation context."""
    unit = replace(inst, efficiency=replace(inst.efficiency, decode_bandwidth=1.0))
    fleet = gpu_calibration.row_fleet(row, unit, assumptions)
    context = float(row["prompt_tokens"]) + float(row.get("output_tokens", 0)) / 2
    return float(closed_form.decode_step_s(fleet, [context])[0])


def fit_decode_bandwidth(calibration: list[dict[str, Any]], inst: hardware.Instance,
                         assumptions: dict[str, Any]) -> float:
    """The fraction of HBM bandwidth the rows' decode steps reach (geometric mean over rows)."""
    ratios = [decode_step_unit_s(r, inst, assumptions) / (r["tpot_ms"] / 1000) for r in calibration]
    return math.exp(sum(math.log(x) for x in ratios) / len(ratios))


@functools.cache
def fitted() -> dict[str, Any]:
    """The fitted constants and the errors of every row (calibration and held-out) under them."""
    data = load_data()
    assumptions = data["ttft_assumptions"]
    base = hardware.INSTANCES[INSTANCE]
    calibration = rows(data, "calibration")
    dense = fit_dense(calibration, base, assumptions)
    decode = fit_decode_bandwidth(calibration, base, assumptions)
    eff = replace(base.efficiency, dense=dense, request_overhead_s=_hop_s(), decode_bandwidth=decode,
                  moe=gpu_calibration.calibrated_efficiency().moe)
    inst = replace(base, efficiency=eff)
    out = []
    for row in data["ttft"]:
        ttft = gpu_calibration.predicted_ttft_s(row, inst, assumptions) * 1000
        tpot = decode_step_unit_s(row, base, assumptions) / decode * 1000
        out.append({"id": row["id"], "model": row["model"], "source": row["source"], "split": row["split"],
                    "measured_ms": row["measured_ms"], "predicted_ms": round(ttft, 1),
                    "error": round(ttft / row["measured_ms"] - 1, 4), "tpot_measured_ms": row["tpot_ms"],
                    "tpot_predicted_ms": round(tpot, 1), "tpot_error": round(tpot / row["tpot_ms"] - 1, 4)})
    held = [abs(r["error"]) for r in out if r["split"] == "held_out"]
    band = max(math.ceil(e * 100) / 100 for e in held) if held else None  # the held-out error is the evidence
    return {"dense": dense, "decode_bandwidth": decode, "request_overhead_s": eff.request_overhead_s,
            "moe": eff.moe, "rows": out, "band": band, "sources": data["sources"]}


def calibrated(inst: hardware.Instance) -> hardware.Instance:
    """``inst`` with the Neuron fit when it is the instance the data prices; otherwise unchanged."""
    if inst.name != INSTANCE:
        return inst
    f = fitted()
    held = ", ".join(f"{r['model']} {r['error']:+.0%}" for r in f["rows"] if r["split"] == "held_out")
    cal = ", ".join(r["model"] for r in f["rows"] if r["split"] == "calibration")
    eff = replace(inst.efficiency, dense=f["dense"], decode_bandwidth=f["decode_bandwidth"],
                  request_overhead_s=f["request_overhead_s"], moe=f["moe"], ttft_band=f["band"],
                  ttft_band_source=(f"±{f['band']:.0%}: the held-out published trn2 TTFT ({held}); "
                                    "turnkv/plan/data/neuron_measurements.json") if f["band"] else
                  "none: no held-out trn2 row",
                  source=f"prefill factor and decode bandwidth fitted to published Neuron TTFT/TPOT ({cal}; "
                         "turnkv/plan/data/neuron_measurements.json); per-hop cost and MoE factor from the GPU fit; "
                         "all-reduces at the NeuronLink prior")
    return replace(inst, efficiency=eff)


def markdown() -> str:
    """docs/planning.md's trn2 table (``python -m turnkv.plan.neuron_calibration``)."""
    f = fitted()
    band = f"±{f['band']:.0%}" if f["band"] else "none"
    lines = [f"Fitted: prefill {f['dense']:.3f} of BF16 peak, decode {f['decode_bandwidth']:.3f} of HBM bandwidth; "
             f"per hop {f['request_overhead_s'] * 1000:.0f} ms (GPU fit); band {band}.", "",
             "| measurement | source | TTFT measured | TTFT predicted | error | TPOT measured | TPOT predicted | "
             "error | split |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in f["rows"]:
        lines.append(f"| {r['id']} | {r['source']} | {r['measured_ms']:,.0f} ms | {r['predicted_ms']:,.0f} ms | "
                     f"{r['error']:+.0%} | {r['tpot_measured_ms']:.1f} ms | {r['tpot_predicted_ms']:.1f} ms | "
                     f"{r['tpot_error']:+.0%} | {r['split']} |")
    lines += ["", "Sources:", ""]
    for key, v in f["sources"].items():
        lines.append(f"- `{key}`: {v['title']} ({v['url']}): {v['what']}.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
