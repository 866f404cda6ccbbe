"""The GPU constants come from the published measurements file through the fit, and the fit is a fit."""

import json
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest

from turnkv.plan import gpu_calibration as gc
from turnkv.plan import hardware

ROOT = Path(__file__).resolve().parents[2]


def test_every_row_cites_a_source_with_its_conditions():
    data = gc.load_data()
    rows = data["ttft"] + data["transfer_ranges"] + data["kernel_bounds"]
    assert {r["split"] for r in rows} <= {"calibration", "held_out", "constraint"}
    assert len({r["id"] for r in rows}) == len(rows)
    for r in rows:
        src = data["sources"][r["source"]]
        assert src["title"] and src["what"] and src["conditions"] and "url" in src and "date" in src
        assert r["what"]
    assert any(r["split"] == "held_out" for r in rows) and data["left_out"]


def test_the_data_file_ships_with_the_package():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "plan/data/*.json" in conf["tool"]["setuptools"]["package-data"]["turnkv"]


def test_load_gives_the_constants_the_fit_derives_from_the_data_file():
    data = gc.load_data()
    coef, at_prior = gc.select(gc.calibration_rows(data), hardware.INSTANCES["p5en.48xlarge"], gc.settings(data))
    for name in ("p5en.48xlarge", "p5.48xlarge"):
        eff = hardware.load(name).efficiency
        assert eff.dense == pytest.approx(1 / coef["dense_compute"])
        assert eff.moe == pytest.approx(1 / coef["moe_compute"])
        assert eff.request_overhead_s == pytest.approx(coef["hops"])
        # the pull is never fitted: the sum of its named, published components
        published = hardware.pull_fixed_s(hardware.GPU_PULL)
        assert eff.pull_overhead_s == pytest.approx(coef["pull"]) == pytest.approx(published)
        assert "gpu_measurements.json" in eff.source and all(c in eff.source for c in at_prior)
    assert hardware.load("local-cpu") == hardware.INSTANCES["local-cpu"]  # the GPU fit leaves the CPU alone


def test_other_measurements_give_other_constants(monkeypatch):
    data = gc.load_data()
    slower = json.loads(json.dumps(data))
    for r in slower["ttft"]:
        r["measured_ms"] *= 1.5
    before = gc.fit(gc.calibration_rows(data), hardware.INSTANCES["p5en.48xlarge"], gc.settings(data))
    after = gc.fit(gc.calibration_rows(slower), hardware.INSTANCES["p5en.48xlarge"], gc.settings(slower))
    assert after != before and after["moe_compute"] > before["moe_compute"]


def test_the_fit_recovers_constants_it_generated():
    data = gc.load_data()
    inst, settings = hardware.INSTANCES["p5en.48xlarge"], gc.settings(data)
    truth = gc.prior_coefficients(inst.efficiency) | {"moe_compute": 1 / 0.2, "hops": 0.03}
    rows = [r | {"measured_ms": gc.linear_prediction(r, truth, inst, settings) * 1000} for r in data["ttft"]]
    coef, _ = gc.select(rows, inst, settings)
    assert coef == pytest.approx(truth, rel=1e-6)


def test_the_pull_is_never_fitted_to_the_rows():
    # data made with a 500 ms pull: the fit keeps the pull at its components' sum and the error stays in the residual
    data = gc.load_data()
    inst, settings = hardware.INSTANCES["p5en.48xlarge"], gc.settings(data)
    truth = gc.prior_coefficients(inst.efficiency) | {"pull": 0.5}
    rows = [r | {"measured_ms": gc.linear_prediction(r, truth, inst, settings) * 1000}
            for r in gc.calibration_rows(data)]
    coef, at_prior = gc.select(rows, inst, settings)
    assert "pull" in at_prior and coef["pull"] == pytest.approx(hardware.pull_fixed_s(hardware.GPU_PULL))


def test_a_term_the_rows_cannot_separate_keeps_its_prior():
    # the seeds' rows see a per-request cost and the dense factor only together (one reuse-off dense row): data made
    # with another per-request cost is fitted exactly with one of the two at its prior
    data = gc.load_data()
    inst, settings = hardware.INSTANCES["p5en.48xlarge"], gc.settings(data)
    truth = gc.prior_coefficients(inst.efficiency) | {"moe_compute": 1 / 0.2, "hops": 0.05}
    rows = [r | {"measured_ms": gc.linear_prediction(r, truth, inst, settings) * 1000}
            for r in gc.calibration_rows(data)]
    coef, at_prior = gc.select(rows, inst, settings)
    fitted_at_prior = [c for c in at_prior if c not in gc.NEVER_FITTED]
    assert len(fitted_at_prior) == 1 and fitted_at_prior[0] in ("dense_compute", "hops")
    assert gc.rms_error(rows, coef, inst, settings) < 1e-3
    assert coef["moe_compute"] == pytest.approx(5, rel=0.05)


def test_achieved_factors_stay_under_the_published_kernel_bound():
    data = gc.load_data()
    bound = gc.settings(data)["max_fraction_of_peak"]
    eff = hardware.load("p5en.48xlarge").efficiency
    assert 0 < eff.moe <= eff.dense <= bound + 1e-12
    tight = gc.fit(gc.calibration_rows(data), hardware.INSTANCES["p5en.48xlarge"],
                   gc.settings(data) | {"max_fraction_of_peak": 0.1})
    assert 1 / tight["dense_compute"] <= 0.1 + 1e-12 and 1 / tight["moe_compute"] <= 0.1 + 1e-12


def test_report_has_errors_held_out_checks_ablation_and_band():
    rep = gc.report()
    assert {r["split"] for r in rep["ttft"]} == {"calibration", "held_out"}
    assert all(r["split"] == "held_out" for r in rep["transfers"])
    assert {a["term"] for a in rep["ablation"]} == {"none (the calibrated model)", *gc.COLUMNS, "attention", *gc.KNOWN}
    full = rep["ablation"][0]["rms_error"]
    # removing a fitted term never helps; a term held at its published value (the pull) may fit the rows worse
    # than leaving it out, which the ablation then shows
    assert all(a["rms_error"] is None or a["rms_error"] >= full - 1e-9 for a in rep["ablation"]
               if a["term"] in gc.COLUMNS and a["term"] not in gc.NEVER_FITTED)
    assert 0 < rep["band"] < 1


def test_a_pull_pays_its_named_fixed_cost_and_recompute_does_not():
    from turnkv.plan import architectures, closed_form

    inst = hardware.load("p5en.48xlarge")
    none = replace(inst, efficiency=replace(inst.efficiency, pull_components=()))
    fleet = closed_form.Fleet(architectures.load("Qwen3-32B"), inst, inst)
    bare = closed_form.Fleet(architectures.load("Qwen3-32B"), none, none)
    a, b = closed_form.turn_costs(fleet, [8000], [7800]), closed_form.turn_costs(bare, [8000], [7800])
    assert float(a.ttft_on[0] - b.ttft_on[0]) == pytest.approx(inst.efficiency.pull_overhead_s)
    assert float(a.ttft_off[0]) == pytest.approx(float(b.ttft_off[0]))
    # and the threshold that makes a pull pay rises with it
    assert closed_form.break_even_tokens(fleet, 140) > closed_form.break_even_tokens(bare, 140)


def test_docs_show_the_tables_the_code_derives():
    doc = (ROOT / "docs" / "planning.md").read_text()
    shown = doc.split("<!-- gpu-calibration:begin -->\n")[1].split("<!-- gpu-calibration:end -->")[0]
    assert shown == gc.markdown(), "regenerate with: python -m turnkv.plan.gpu_calibration --markdown"


def test_the_ridge_shows_the_fits_along_the_dense_per_request_trade_off():
    # with the pull held at its published components the calibrated fit sits at the kernel cap; a fit with no
    # per-request cost is worse (the seeds' rows need fixed costs the pull no longer absorbs)
    ends = gc.ridge(gc.load_data())
    assert [e["fit"] for e in ends] == ["dense at the kernel cap", "calibrated", "no per-request cost"]
    assert min(e["rms_error"] for e in ends) == pytest.approx(ends[1]["rms_error"])
    assert ends[2]["rms_error"] > ends[1]["rms_error"]
    assert all(e["pull_ms"] == pytest.approx(1000 * hardware.pull_fixed_s(hardware.GPU_PULL)) for e in ends)


def test_every_held_out_figure_is_in_the_quoted_line_it_came_from():
    held = [r for r in gc.load_data()["ttft"] if r["split"] == "held_out"]
    assert len(held) >= 6
    for r in held:
        assert f"| {r['measured_ms']:g} |" in " ".join(r["quote"].split()), r["id"]
        assert r["setup"] == "colocated" and r["hops"] in (0, 1) and r["concurrency"] == 1


def test_held_out_rows_do_not_move_the_fit():
    data = gc.load_data()
    moved = json.loads(json.dumps(data))
    for r in moved["ttft"]:
        if r["split"] == "held_out":
            r["measured_ms"] *= 3
    inst = hardware.INSTANCES["p5en.48xlarge"]
    assert gc.select(gc.calibration_rows(moved), inst, gc.settings(moved)) == \
        gc.select(gc.calibration_rows(data), inst, gc.settings(data))
    assert [e["predicted_ms"] for e in gc.ttft_errors(inst, moved)] == [e["predicted_ms"] for e in
                                                                          gc.ttft_errors(inst, data)]


def test_a_colocated_row_is_prefill_plus_its_hops_without_transfer_or_decode():
    from turnkv.plan import closed_form

    data = gc.load_data()
    settings, inst = gc.settings(data), hardware.load("p5.48xlarge")
    for r in (r for r in data["ttft"] if gc.colocated(r)):
        fleet = gc.row_fleet(r, inst, settings)
        assert fleet.prefill.name == r["instance"] and fleet.model.dtype == r["dtype"]
        prefill = float(closed_form.compute_s(fleet, [r["prompt_tokens"]], [0])[0])
        want = prefill + r["hops"] * inst.efficiency.request_overhead_s
        assert gc.predicted_ttft_s(r, inst, settings) == pytest.approx(want)
        t = gc.terms(r, hardware.INSTANCES["p5en.48xlarge"], settings)
        assert t.known["transfers"] == t.known["first_decode_step"] == 0 and t.columns["pull"] == 0


def test_several_prompt_lengths_on_one_engine_separate_the_per_request_cost():
    # what the seeds' rows cannot do (above), rows shaped like the held-out ones (two prompt lengths, one hop) can:
    # data made from a known per-request cost and dense factor is recovered with neither kept at its prior
    data = gc.load_data()
    inst, settings = hardware.INSTANCES["p5en.48xlarge"], gc.settings(data)
    truth = gc.prior_coefficients(inst.efficiency) | {"dense_compute": 1 / 0.5, "hops": 0.01}
    rows = [r | {"measured_ms": gc.linear_prediction(r, truth, inst, settings) * 1000}
            for r in data["ttft"] if r["source"] == "nim-bench-llama33-70b"]
    coef, at_prior = gc.select(rows, inst, settings)
    assert "dense_compute" not in at_prior and "hops" not in at_prior
    assert coef["dense_compute"] == pytest.approx(2.0, rel=1e-6) and coef["hops"] == pytest.approx(0.01, rel=1e-6)


def test_each_held_out_group_says_what_it_implies_on_its_own():
    implied = gc.implied_by_held_out(gc.load_data())
    assert {(i["source"], i["model"]) for i in implied} == {("trtllm-perf-v0.5", "Llama-2-7B"),
                                                           ("trtllm-perf-v0.5", "Llama-2-70B"),
                                                           ("nim-bench-llama33-70b", "Llama-3.3-70B-Instruct")}
    assert all(0 < i["factor"] <= 1 and i["fixed_ms"] >= 0 for i in implied)
