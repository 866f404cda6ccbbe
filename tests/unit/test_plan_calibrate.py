"""turnkv.plan.calibrate's fits and the calibration file's round trip into the planner (no engines)."""

import json

import numpy as np
import pytest

from turnkv.plan import calibrate, hardware
from turnkv.plan import model as plan_model
from turnkv.plan.models import tiny_local


def test_fit_prefill_recovers_gemm_and_attention_rates():
    arch = tiny_local()
    hop, r_lin, r_att = 0.03, 40e9, 12e9
    points = [(n, hop + arch.linear_flops_per_token() * n / r_lin + arch.attention_flops(n, 0) / r_att)
              for n in (256, 1024, 2048, 4096, 6144)]
    got = calibrate.fit_prefill(arch, points)
    assert got == pytest.approx((hop, r_lin, r_att), rel=1e-6)


def test_fit_prefill_refuses_noise():
    with pytest.raises(ValueError, match="did not grow"):
        calibrate.fit_prefill(tiny_local(), [(256, 0.5), (1024, 0.4), (4096, 0.3)])


def test_fit_transfers_line_and_single_point():
    setup, rate = 0.004, 5e9
    pts = [(b, setup + b / rate) for b in (1e6, 8e6, 3e7)]
    assert calibrate.fit_transfers(pts) == pytest.approx((setup, rate), rel=1e-6)
    assert calibrate.fit_transfers([(1e7, 0.002)]) == pytest.approx((0.0, 5e9))
    with pytest.raises(ValueError, match="no NIXL transfer"):
        calibrate.fit_transfers([])


def test_stored_constants_drive_local_cpu_predictions(tmp_path):
    arch = tiny_local()
    inst = hardware.INSTANCES["local-cpu"]
    data = calibrate.constants(arch, inst, (0.025, 30e9, 10e9), (0.003, 4e9), {"prefills": []})
    (tmp_path / hardware.CALIBRATION_FILE).write_text(json.dumps(data))
    loaded = hardware.load("local-cpu", tmp_path)
    assert loaded.efficiency.dense == pytest.approx(30e9 / inst.peak("float32"))
    f = plan_model.Fleet(arch, loaded, loaded, 1, 1, block_size=128)
    n = 3000
    expected = arch.linear_flops_per_token() * n / 30e9 + arch.attention_flops(n, 0) / 10e9
    assert float(plan_model.compute_s(f, [n], [0])[0]) == pytest.approx(expected, rel=1e-6)
    assert float(plan_model.transfer_s(f, [1000])[0]) == pytest.approx(0.003 + 1000 * 8192 / 4e9, rel=1e-6)
    # another instance's file is ignored
    assert hardware.load("p5en.48xlarge", tmp_path) == hardware.INSTANCES["p5en.48xlarge"]


def test_metrics_parsing_sums_every_label_set(monkeypatch):
    text = "\n".join([
        '# HELP vllm:nixl_xfer_time_seconds x',
        'vllm:nixl_xfer_time_seconds_sum{engine="0"} 0.25',
        'vllm:nixl_xfer_time_seconds_count{engine="0"} 2.0',
        'vllm:nixl_xfer_time_seconds_sum{engine="1"} 0.05',
        'vllm:nixl_xfer_time_seconds_count{engine="1"} 1.0',
        'vllm:nixl_bytes_transferred_sum{engine="0"} 3.0e7',
        'vllm:nixl_bytes_transferred_bucket{le="1e6"} 1.0',
    ])

    class Resp:
        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def read(self):
            return text.encode()

    monkeypatch.setattr(calibrate.urllib.request, "urlopen", lambda url, timeout: Resp())
    assert calibrate.nixl_totals("http://x") == pytest.approx((0.30, 3.0e7, 3.0))
    assert np.isclose(sum(calibrate.LENGTHS), 13568)


def test_fit_prefill_never_returns_a_negative_cost():
    """Measurements where attention explains everything (CPU attention kernels are slow): plain least
    squares gives the GEMMs a negative cost; the fit keeps every term >= 0 and bounds the free rate."""
    arch = tiny_local()
    points = [(n, 0.15 + arch.attention_flops(n, 0) / 8e9 - 1e-12 * n) for n in (256, 1024, 2048, 4096, 6144)]
    fixed, r_lin, r_att = calibrate.fit_prefill(arch, points, peak=156e9)
    assert fixed >= 0 and r_lin == 156e9 and r_att == pytest.approx(8e9, rel=0.05)
