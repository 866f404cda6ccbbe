"""bench.gpu_smoke: the preflight that refuses a machine it cannot run on (naming what is missing and the plan it
did not run), the plan itself (what the engines run with: bf16, CUDA graphs, vLLM's attention pick, host tier,
forks, both modes bi-directional), the 8-minute budget, and the report of TTFT and transfer time. The GPU run
itself needs a CUDA machine (``make gpu-smoke``); none is here."""

import argparse
import json

from bench import gpu_smoke, shapes
from turnkv import versions
from turnkv.engine_args import Mode
from turnkv.local import stack

GPU = gpu_smoke.Machine(cuda=True, devices=1, device_name="NVIDIA H100 80GB HBM3", vllm=versions.VLLM_GPU,
                        nixl=versions.NIXL)


def test_a_cuda_machine_with_the_gpu_images_pins_passes_the_preflight():
    assert gpu_smoke.problems(GPU) == []


def test_each_missing_piece_is_named_with_its_fix():
    cpu = gpu_smoke.Machine(cuda=False, devices=0, device_name="", vllm=f"{versions.VLLM_GPU}+cpu", nixl="",
                            nvidia_smi=False)
    found = gpu_smoke.problems(cpu)
    assert len(found) == 3
    assert "no CUDA device" in found[0] and "no nvidia-smi" in found[0] and "make gpu-smoke" in found[0]
    assert "not the GPU image's CUDA wheel" in found[1] and versions.NIXL_CUDA_PACKAGE in found[2]
    other = gpu_smoke.Machine(cuda=True, devices=1, device_name="x", vllm="0.29.0", nixl=versions.NIXL)
    assert gpu_smoke.problems(other) == [f"vLLM 0.29.0 is not the GPU image's CUDA wheel ({versions.VLLM_GPU}); "
                                         "run from .venv-gpu (`make gpu-smoke`)"]


def test_on_this_machine_it_stops_before_starting_anything_naming_what_is_missing_and_the_plan(tmp_path, capsys):
    state = tmp_path / "state"
    assert gpu_smoke.main(["--out", str(tmp_path), "--state-dir", str(state)]) == 2
    report = json.loads((tmp_path / "gpu-smoke.json").read_text())
    assert any("no CUDA device" in line for line in report["missing"]) and not state.exists()
    for mode in ("pull", "push"):
        for stage in ("conversation", "forks", "host"):
            assert any(line.startswith(f"{mode} / {stage}: ") for line in report["not_run"])
    assert report["out_of_reach"] == list(gpu_smoke.OUT_OF_REACH)
    err = capsys.readouterr().err
    assert err.startswith("GPU smoke not run: this machine lacks\n- no CUDA device")
    assert "none of it run" in err and "- CUDA graphs: on: no --enforce-eager" in err


def test_the_engines_run_as_a_p5en_runs_them_scaled_to_one_gpu(tmp_path):
    """What `make gpu-smoke` starts, from the local stack's own plan: bf16, not eager (CUDA graphs; no attention
    backend forced), decode's host tier and fork window in its connector config, both modes bi-directional."""
    args = argparse.Namespace(cuda_devices="0", gpu_memory_utilization=0.25, startup_timeout=240.0)
    overrides = gpu_smoke.stack_overrides(args)
    for mode in Mode:
        config = stack.StackConfig(state_dir=tmp_path, mode=mode, **overrides)
        engines = [p for p in stack.plan(config) if p.kind != "router"]
        assert {p.name for p in engines} == {"prefill-0", "decode-0"}
        for proc in engines:
            argv = proc.argv
            assert "--enforce-eager" not in argv and "--attention-backend" not in argv
            assert argv[argv.index("--dtype") + 1] == "bfloat16"
            assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.25"
            assert proc.env["CUDA_VISIBLE_DEVICES"] == "0"
            extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
            assert extra["bidirectional_kv_xfer"] is True and extra["fork_window"] == gpu_smoke.FORK_WINDOW_S
            budget = gpu_smoke.HOST_KV_BUDGET_MIB if proc.name == "decode-0" else 0  # prefill retains nothing
            assert extra["host_kv_budget_mib"] == budget
    assert gpu_smoke.HOST_ONLY["retained_kv_share"] == 0 and gpu_smoke.HOST_ONLY["host_kv_budget_mib"] > 0


def test_a_mode_that_would_pass_the_eight_minute_budget_is_reported_not_run():
    assert gpu_smoke.BUDGET_S == 480
    assert gpu_smoke.fits(0.0) and gpu_smoke.fits(200.0)
    assert not gpu_smoke.fits(300.0)
    assert gpu_smoke.fits(0.0, budget_s=10)  # the first mode always runs


def test_the_backend_and_the_graph_capture_are_read_from_the_engine_log():
    log = ("INFO 12-06 cuda.py:507] Using FLASH_ATTN attention backend out of potential backends: "
           "['FLASH_ATTN', 'FLASHINFER'].\nINFO gpu_model_runner.py:6582] Graph capturing finished in 7 secs, "
           "took 0.31 GiB\n")
    assert gpu_smoke.engine_log_facts(log) == {"attention_backend": "FLASH_ATTN",
                                               "cuda_graphs": "captured in 7 s, 0.31 GiB", "model_runner": "V1"}
    assert gpu_smoke.engine_log_facts("eager\n") == {"attention_backend": "", "cuda_graphs": "", "model_runner": "V1"}
    v2 = "INFO 12-06 gpu_worker.py:518] Using V2 Model Runner\n"  # vLLM 0.32's line when it builds V2
    assert gpu_smoke.engine_log_facts(log + v2)["model_runner"] == "V2"


def test_the_report_gives_ttft_and_transfer_time_per_stage_and_what_did_not_run():
    row = shapes.ShapeRun("equal", "P TP1 / D TP1", "pull", started=True, passed=True,
                          turns=[{"turn": 1, "ttft_off_ms": 50.0, "ttft_on_ms": 52.0, "outcome": "miss",
                                  "reused_tokens": 0, "same_answer": True},
                                 {"turn": 2, "ttft_off_ms": 90.0, "ttft_on_ms": 30.0, "outcome": "hit",
                                  "reused_tokens": 241, "same_answer": True}],
                          extra={"conversation_transfers": {"count": 2.0, "seconds": 0.004, "bytes": 3 * 2**20},
                                 "forks": {"mode": "pull", "stage": "forks", "ran": True, "passed": False,
                                           "detail": "2/3 forks pulled, 3 answers equal to reuse off",
                                           "ttft_off_ms": 80.0, "ttft_on_ms": 40.0, "reused": 2, "of": 3,
                                           "same_answers": 3,
                                           "transfers": {"count": 2.0, "seconds": 0.002, "bytes": 2**20}}})
    stages = gpu_smoke.stage_rows(Mode.PULL, row)
    assert [s.stage for s in stages] == ["conversation", "forks", "host", "faults"]
    assert not stages[2].ran and stages[2].detail == "the mode stopped before it"
    stages += [gpu_smoke.StageRun("push", s.key, detail="the time budget") for s in gpu_smoke.STAGES]
    engines = {"pull": {"decode-0": {"attention_backend": "FLASH_ATTN", "cuda_graphs": "captured in 7 s, 0.31 GiB",
                                     "model_runner": "V2"}}}
    text = gpu_smoke.table(GPU, stages, engines, ["push: its 210 s would pass the 480 s budget"])
    assert "1 x NVIDIA H100 80GB HBM3" in text and "model bfloat16" in text
    assert "- pull decode-0: attention FLASH_ATTN, CUDA graphs captured in 7 s, 0.31 GiB, model runner V2" in text
    assert "| pull | conversation | 90.0 | 30.0 | 3.00x | 1/1 | 2 | 2 | 2.00 | 3.0 | passed |" in text
    assert "| pull | forks | 80.0 | 40.0 | 2.00x | 2/3 | 3 | 2 | 1.00 | 1.0 | FAILED: 2/3 forks pulled" in text
    assert "| push | host | - | - | - | - | - | - | - | - | not run: the time budget |" in text
    assert "- push: its 210 s would pass the 480 s budget" in text and f"- {gpu_smoke.OUT_OF_REACH[0]}" in text


def test_a_mode_whose_engines_did_not_start_reports_every_stage_not_run():
    row = shapes.ShapeRun("equal", "x", "push", started=False, failure="did not start: decode-0 exited")
    stages = gpu_smoke.stage_rows(Mode.PUSH, row)
    assert [(s.ran, s.detail) for s in stages] == [(False, "engines did not start: did not start: decode-0 exited")] * 4


def test_a_play_that_raises_reports_its_error_as_the_stages_not_run(tmp_path):
    play = gpu_smoke.play_stages(Mode.PULL, tmp_path, 1.0)
    extra = play({})  # no engine URLs: the first read fails
    assert extra["error"].startswith("KeyError")
    row = shapes.ShapeRun("equal", "x", "pull", started=True, passed=True, extra=extra)
    stages = gpu_smoke.stage_rows(Mode.PULL, row)
    assert [(s.stage, s.ran, s.detail) for s in stages[1:]] == [("forks", False, extra["error"]),
                                                                ("host", False, extra["error"]),
                                                                ("faults", False, extra["error"])]


def test_the_faults_stage_passes_only_when_every_answer_holds_and_misaddressed_reads_are_caught(monkeypatch,
                                                                                                 tmp_path):
    from bench import engine_metrics
    from turnkv import smoke

    caught = iter([0.0, 3.0, 3.0, 5.0, 5.0, 5.0, 5.0, 5.0])  # mismatches before/after each fault, in FAULTS' order
    seen: list[str] = []
    monkeypatch.setattr(engine_metrics, "fetch_sync", lambda url: None)
    monkeypatch.setattr(engine_metrics, "total", lambda page, name, **labels: next(caught))

    async def run(url, timeout_s):
        seen.append((tmp_path / "fault").read_text())
        return None

    monkeypatch.setattr(smoke, "run", run)
    monkeypatch.setattr(smoke, "summary_rows", lambda result: [{"same_answer": True}] * 4)
    stage = gpu_smoke.faults_stage("pull", {"prefill-0": "p", "router": "r"}, tmp_path / "fault", 1.0)
    assert seen == list(gpu_smoke.FAULTS) and (tmp_path / "fault").read_text() == ""
    assert stage.passed and stage.same_answers == stage.of == 16
    caught = iter([0.0, 0.0] * 4)  # nothing caught
    monkeypatch.setattr(engine_metrics, "total", lambda page, name, **labels: next(caught))
    stage = gpu_smoke.faults_stage("pull", {"prefill-0": "p", "router": "r"}, tmp_path / "fault", 1.0)
    assert not stage.passed and "block: no block caught by the KV seal" in stage.detail
