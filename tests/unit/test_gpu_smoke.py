"""bench.gpu_smoke: the preflight that refuses a machine it cannot run on, and the report. The GPU run itself
needs a CUDA machine (``make gpu-smoke``); none is here."""

import json

from bench import gpu_smoke, shapes
from turnkv import versions

GPU = gpu_smoke.Machine(cuda=True, devices=1, device_name="NVIDIA H200", vllm=versions.VLLM_GPU, nixl=versions.NIXL)


def test_a_cuda_machine_with_the_gpu_images_pins_passes_the_preflight():
    assert gpu_smoke.problems(GPU) == []


def test_each_missing_piece_is_named_with_its_fix():
    cpu = gpu_smoke.Machine(cuda=False, devices=0, device_name="", vllm=f"{versions.VLLM_GPU}+cpu", nixl="")
    found = gpu_smoke.problems(cpu)
    assert len(found) == 3
    assert "no CUDA device" in found[0] and "make gpu-smoke" in found[0]
    assert "not the GPU image's CUDA wheel" in found[1] and versions.NIXL_CUDA_PACKAGE in found[2]
    other = gpu_smoke.Machine(cuda=True, devices=1, device_name="x", vllm="0.29.0", nixl=versions.NIXL)
    assert gpu_smoke.problems(other) == [f"vLLM 0.29.0 is not the GPU image's CUDA wheel ({versions.VLLM_GPU}); "
                                         "run from .venv-gpu (`make gpu-smoke`)"]


def test_on_this_machine_it_stops_before_starting_anything_and_says_why(tmp_path):
    state = tmp_path / "state"
    assert gpu_smoke.main(["--out", str(tmp_path), "--state-dir", str(state)]) == 2
    report = json.loads((tmp_path / "gpu-smoke.json").read_text())
    assert any("no CUDA device" in line for line in report["not_run"]) and not state.exists()


def test_the_report_gives_ttft_off_and_on_and_flags_a_differing_answer():
    row = shapes.ShapeRun("equal", "P TP1 / D TP1", "pull", started=True, passed=False,
                          failure="turn 3: answers differ", pulled_tokens=900.0, seconds=42.0,
                     turns=[{"turn": 1, "ttft_off_ms": 50.0, "ttft_on_ms": 52.0, "outcome": "miss",
                             "reused_tokens": 0, "same_answer": True},
                            {"turn": 2, "ttft_off_ms": 90.0, "ttft_on_ms": 30.0, "outcome": "hit",
                             "reused_tokens": 241, "same_answer": False}])
    text = gpu_smoke.markdown(GPU, [row])
    assert "1 x NVIDIA H200" in text
    assert "| pull | 2 | 90.0 | 30.0 | 3.00x | hit | 241 | NO |" in text
    assert "- pull: FAILED: turn 3: answers differ, prefill pulled 900 tokens, 42.0 s" in text
