"""turnkv.plan.calibrate's fits and the calibration file's round trip into the planner (no engines)."""

import json

import numpy as np
import pytest

from turnkv.plan import calibrate, closed_form, hardware
from turnkv.plan.architectures import tiny_local


def _secs(arch, chunk, c, new, ctx):
    hop, r_lin, r_att, r_ctx, step = c
    return float(calibrate.design(arch, chunk, new, ctx)[0] @ [hop, 1 / r_lin, 1 / r_att, 1 / r_ctx, step])


def test_fit_prefill_recovers_hop_rates_and_chunk_step():
    """Plain prefills (one chunk and several) and prefills over a cached context pin all five constants."""
    arch, chunk = tiny_local(), 2048
    truth = (0.021, 70e9, 130e9, 45e9, 0.004)
    points = [(n, 0, _secs(arch, chunk, truth, n, 0)) for n in (16, 256, 1024, 2048, 4096, 6144)]
    points += [(n, h, _secs(arch, chunk, truth, n, h)) for h, n in ((1024, 256), (3072, 128), (3072, 512))]
    got = calibrate.fit_prefill(arch, points, chunk)
    assert (got["hop_s"], got["linear_flops_s"], got["attention_flops_s"], got["context_attention_flops_s"],
            got["step_s"]) == pytest.approx(truth, rel=1e-6)


def test_chunking_splits_attention_without_changing_its_total():
    """A 6,144-token prompt in 2,048-token chunks: the same attention FLOPs as one pass, two thirds of
    them over the earlier chunks' keys."""
    arch = tiny_local()
    fresh, ctx = closed_form.chunked_attention_flops(arch, 6144.0, 0.0, 2048)
    assert fresh + ctx == pytest.approx(arch.attention_flops(6144, 0))
    assert fresh == pytest.approx(3 * arch.attention_flops(2048, 0))
    fresh, ctx = closed_form.chunked_attention_flops(arch, np.array([390.0]), np.array([3775.0]), 2048)
    assert ctx[0] == pytest.approx(arch.attention_flops(390, 3775) - arch.attention_flops(390, 0))


def test_fit_prefill_reads_old_two_column_points():
    arch = tiny_local()
    truth = (0.02, 60e9, 100e9, 100e9, 0.0)
    points = [(n, _secs(arch, 8192, truth, n, 0)) for n in (16, 256, 1024, 2048, 4096)]
    got = calibrate.fit_prefill(arch, points, 8192)
    assert got["hop_s"] == pytest.approx(0.02, rel=1e-6) and got["linear_flops_s"] == pytest.approx(60e9, rel=1e-6)


def test_fit_prefill_refuses_noise():
    with pytest.raises(ValueError, match="did not grow"):
        calibrate.fit_prefill(tiny_local(), [(256, 0.5), (1024, 0.4), (4096, 0.3)], 2048)


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
    fit = {"hop_s": 0.025, "linear_flops_s": 30e9, "attention_flops_s": 10e9, "context_attention_flops_s": 5e9,
           "step_s": 0.004}
    data = calibrate.constants(arch, inst, fit, (0.003, 4e9), {"prefills": []})
    (tmp_path / hardware.CALIBRATION_FILE).write_text(json.dumps(data))
    loaded = hardware.load("local-cpu", tmp_path)
    assert loaded.efficiency.dense == pytest.approx(30e9 / inst.peak("float32"))
    assert loaded.efficiency.request_overhead_s == 0.025 and loaded.prefill_chunk_tokens == 2048
    f = closed_form.Fleet(arch, loaded, loaded, 1, 1, block_size=128)
    n = 3000  # two chunks: 2,048 fresh, then 952 fresh over the first chunk's keys
    fresh = arch.attention_flops(2048, 0) + arch.attention_flops(952, 0)
    expected = (arch.linear_flops_per_token() * n / 30e9 + fresh / 10e9
                + (arch.attention_flops(n, 0) - fresh) / 5e9 + 0.004)
    assert float(closed_form.compute_s(f, [n], [0])[0]) == pytest.approx(expected, rel=1e-6)
    # a pulled history: the new tokens' attention over it runs at the context rate
    expected = (arch.linear_flops_per_token() * 400 / 30e9 + arch.attention_flops(400, 0) / 10e9
                + (arch.attention_flops(400, 3600) - arch.attention_flops(400, 0)) / 5e9)
    assert float(closed_form.compute_s(f, [400], [3600])[0]) == pytest.approx(expected, rel=1e-6)
    assert float(closed_form.transfer_s(f, [1000])[0]) == pytest.approx(0.003 + 1000 * 8192 / 4e9, rel=1e-6)
    # another instance's file is ignored
    assert hardware.load("p5en.48xlarge", tmp_path) == hardware.load("p5en.48xlarge")


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


def test_fit_prefill_never_returns_a_negative_cost():
    """Measurements where attention explains everything (CPU attention kernels are slow): plain least
    squares gives the GEMMs a negative cost; the fit keeps every term >= 0 and bounds the free rate."""
    arch = tiny_local()
    points = [(n, 0, 0.15 + arch.attention_flops(n, 0) / 8e9 - 1e-12 * n) for n in (256, 1024, 2048, 4096, 6144)]
    got = calibrate.fit_prefill(arch, points, 8192, peak=156e9)
    assert got["hop_s"] >= 0 and got["linear_flops_s"] == 156e9
    assert got["attention_flops_s"] == pytest.approx(8e9, rel=0.05)
    assert got["context_attention_flops_s"] == got["attention_flops_s"]  # no context in the data


def test_local_cpu_band_is_the_prefill_fit_residual(tmp_path):
    arch, inst = tiny_local(), hardware.INSTANCES["local-cpu"]
    fit = {"hop_s": 0.02, "linear_flops_s": 30e9, "attention_flops_s": 10e9, "context_attention_flops_s": 5e9,
           "step_s": 0.0}
    coef = np.array([0.02, 1 / 30e9, 1 / 10e9, 1 / 5e9, 0.0])
    shapes = [(16, 0), (256, 0), (1024, 0), (2048, 0), (4096, 0), (6144, 0), (256, 1024), (512, 3072)]
    noise = [1.1, 0.9, 1.1, 0.9, 1.1, 0.9, 1.1, 0.9]
    pts = [(n, h, float(calibrate.design(arch, inst.prefill_chunk_tokens, n, h)[0] @ coef) * k)
           for (n, h), k in zip(shapes, noise, strict=True)]
    data = calibrate.constants(arch, inst, fit, (0.003, 4e9), {"prefills": pts[:6], "context_prefills": pts[6:]})
    band = calibrate.prefill_band(data)
    assert band == pytest.approx(np.sqrt(sum((1 / k - 1) ** 2 for k in noise) / (8 - 4)), abs=1e-3)
    (tmp_path / hardware.CALIBRATION_FILE).write_text(json.dumps(data))
    assert hardware.load("local-cpu", tmp_path).efficiency.ttft_band == band
    assert hardware.load("local-cpu").efficiency.ttft_band is None  # uncalibrated: no band claimed
