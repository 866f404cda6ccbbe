"""`turnkv doctor` checks, each passing and failing, on canned command outputs (no EFA, GPU or vLLM needed)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from turnkv import doctor, node_env, versions
from turnkv.doctor import Completed, Options, Status

EFA = versions.EFA_PREFIX
PLUGIN_DIR = "/opt/turnkv/venv/lib/python3.12/site-packages/nixl_cu13.libs/nixl"
FI_VERSION = f"fi_info: {versions.LIBFABRIC}1.0\nlibfabric: {versions.LIBFABRIC}1.0\nlibfabric api: 2.7\n"
FI_EFA = "provider: efa\n    fabric: efa\n    domain: rdmap79s0-rdm\nprovider: efa\n    domain: rdmap80s0-rdm\n"
LDCONFIG = (f"\tlibfabric.so.1 (libc6,x86-64) => {EFA}/lib/libfabric.so.1\n"
            "\tlibfabric.so.1 (libc6,x86-64) => /lib/x86_64-linux-gnu/libfabric.so.1\n")
SMI_HEADER = "| NVIDIA-SMI 580.95.05   Driver Version: 580.95.05   CUDA Version: 13.0 |\n"
VRAM_PROBE = "python -c \nimport json, sys, time"


class FakeNode:
    """Answers commands from a table keyed by the start of the command line; records every call."""

    def __init__(self, responses=None, files=None, kernel="6.8.0-1015-aws"):
        self.responses = {
            f"{EFA}/bin/fi_info --version": Completed(0, FI_VERSION),
            f"{EFA}/bin/fi_info -p efa": Completed(0, FI_EFA),
            "ldconfig -p": Completed(0, LDCONFIG),
            f"ldd {PLUGIN_DIR}/libplugin_LIBFABRIC.so": Completed(
                0, f"\tlibfabric.so.1 => {EFA}/lib/libfabric.so.1 (0x00007f)\n"),
            "python -c \nimport json, sys\nfrom nixl": Completed(
                0, json.dumps({"plugins": ["LIBFABRIC", "POSIX", "UCX"], "backends": ["LIBFABRIC"],
                               "mems": {"LIBFABRIC": ["DRAM", "VRAM"]}}) + "\n"),
            "nvidia-smi --query-gpu": Completed(0, "580.95.05\n580.95.05\n"),
            "nvidia-smi": Completed(0, SMI_HEADER),
            "python -c import torch": Completed(0, "13.0\n"),
            "python -c \nimport importlib": Completed(0, json.dumps({
                "versions": {"vllm": versions.VLLM_GPU, "nixl": versions.NIXL, "turnkv": versions.TURNKV,
                             "vllm-neuron": versions.VLLM_NEURON}, "errors": {}}) + "\n"),
            "neuron-ls --json-output": Completed(0, json.dumps([{"neuron_device": 0}, {"neuron_device": 1}])),
            VRAM_PROBE: Completed(0, json.dumps({"cuda": True, "gpu": "NVIDIA H200", "gpus": 8,
                                                 "plugins": ["LIBFABRIC", "UCX"], "backends": ["LIBFABRIC"],
                                                 "registered": True, "seconds": 0.42}) + "\n"),
            "python -m turnkv.vllm_files": Completed(0, "vLLM 0.32.0 at /opt/turnkv/venv: 20 connector files "
                                                        "identical to the recorded wheel\n"),
            **(responses or {}),
        }
        self.files = {
            doctor.NIXL_ENV_FILE: f"NIXL_PLUGIN_DIR={PLUGIN_DIR}\nLD_LIBRARY_PATH={EFA}/lib\n",
            "/proc/modules": "efa 184320 0 - Live 0x0\nnvidia 1 0 - Live 0x0\n",
            "/proc/driver/nvidia/version": "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05\n",
            **(files or {}),
        }
        self.kernel = kernel
        self.calls: list[tuple[str, dict | None]] = []
        self.clock = 0.0
        self.sleeps: list[float] = []

    def run(self, argv, env=None, timeout=0.0):
        line = " ".join(argv)
        self.calls.append((line, dict(env) if env else None))
        for prefix in sorted(self.responses, key=len, reverse=True):
            response = self.responses[prefix]
            if line.startswith(prefix):
                return response(self) if callable(response) else response
        return Completed(127, "", f"{argv[0]}: not found")

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.clock += seconds

    def node(self):
        return doctor.Node(run=self.run, read_text=lambda p: self.files.get(p), sleep=self.sleep,
                           monotonic=lambda: self.clock, kernel_release=lambda: self.kernel, python="python")


def run(check, fake=None, **opts):
    fake = fake or FakeNode()
    return check(fake.node(), Options(**opts)), fake


# --- EFA libfabric ------------------------------------------------------------------------------------------


def test_libfabric_passes():
    result, _ = run(doctor.check_libfabric)
    assert result.status is Status.PASS and versions.LIBFABRIC in result.detail


def test_libfabric_fails_without_the_efa_installer():
    result, _ = run(doctor.check_libfabric, FakeNode({f"{EFA}/bin/fi_info --version": Completed(127, "", "nope")}))
    assert result.status is Status.FAIL and versions.EFA_INSTALLER in result.fix


def test_libfabric_fails_on_another_version():
    old = Completed(0, "libfabric: 1.22.0amzn4.0\n")
    result, _ = run(doctor.check_libfabric, FakeNode({f"{EFA}/bin/fi_info --version": old}))
    assert result.status is Status.FAIL and "1.22.0amzn4.0" in result.detail


def test_libfabric_fails_when_a_distro_copy_shadows_efa():
    shadow = Completed(0, "\tlibfabric.so.1 (libc6,x86-64) => /lib/x86_64-linux-gnu/libfabric.so.1\n" + LDCONFIG)
    result, _ = run(doctor.check_libfabric, FakeNode({"ldconfig -p": shadow}))
    assert result.status is Status.FAIL and "/lib/x86_64-linux-gnu/libfabric.so.1" in result.detail
    assert "apt-get remove libfabric1" in result.fix


# --- EFA device -----------------------------------------------------------------------------------------------


def test_efa_device_passes():
    result, _ = run(doctor.check_efa_device)
    assert result.status is Status.PASS and "2 EFA domain(s)" in result.detail


def test_efa_device_waits_for_a_late_device():
    def late(fake):
        tries = sum(line.endswith("-p efa") for line, _ in fake.calls)
        return Completed(0, FI_EFA) if tries >= 4 else Completed(61, "", "fi_getinfo: -61 (No data available)")

    result, fake = run(doctor.check_efa_device, FakeNode({f"{EFA}/bin/fi_info -p efa": late}), retry_seconds=60)
    assert result.status is Status.PASS and "attempt 4" in result.detail
    assert fake.sleeps == [5.0, 5.0, 5.0]


def test_efa_device_fails_after_the_retry_window():
    none = Completed(61, "", "fi_getinfo: -61 (No data available)")
    result, fake = run(doctor.check_efa_device, FakeNode({f"{EFA}/bin/fi_info -p efa": none}), retry_seconds=12)
    assert result.status is Status.FAIL
    assert "after 12s (4 tries)" in result.detail and "No data available" in result.detail
    assert "efa-only" in result.fix and sum(fake.sleeps) == 12


def test_efa_device_fails_at_once_when_fi_info_is_not_installed():
    missing = Completed(127, "", f"{EFA}/bin/fi_info: No such file or directory")
    result, fake = run(doctor.check_efa_device, FakeNode({f"{EFA}/bin/fi_info -p efa": missing}), retry_seconds=60)
    assert result.status is Status.FAIL and "is not installed" in result.detail and versions.EFA_INSTALLER in result.fix
    assert fake.sleeps == [] and len(fake.calls) == 1  # no 60 s of retries for a program that is not there


def test_efa_device_is_skipped_on_an_image_build():
    result, fake = run(doctor.check_efa_device, image=True)
    assert result.status is Status.SKIP and fake.calls == []


# --- NIXL ---------------------------------------------------------------------------------------------------


def test_nixl_passes_and_runs_with_the_plugin_env():
    result, fake = run(doctor.check_nixl)
    assert result.status is Status.PASS and "backend instantiated" in result.detail
    probe = next((line, env) for line, env in fake.calls if line.startswith("python"))
    assert probe[0].endswith(" node") and probe[1]["NIXL_PLUGIN_DIR"] == PLUGIN_DIR
    assert probe[1]["LD_LIBRARY_PATH"] == f"{EFA}/lib"


def test_nixl_image_mode_only_needs_the_plugin_to_load():
    fake = FakeNode({"python -c \nimport json, sys\nfrom nixl": Completed(
        0, json.dumps({"plugins": ["LIBFABRIC", "UCX"], "backends": []}))})
    result, fake = run(doctor.check_nixl, fake, image=True)
    assert result.status is Status.PASS and "plugin loads" in result.detail
    assert any(line.endswith(" image") for line, _ in fake.calls)


def test_nixl_fails_when_the_plugin_links_another_libfabric():
    wrong = Completed(0, "\tlibfabric.so.1 => /lib/x86_64-linux-gnu/libfabric.so.1 (0x1)\n")
    result, _ = run(doctor.check_nixl, FakeNode({f"ldd {PLUGIN_DIR}/libplugin_LIBFABRIC.so": wrong}))
    assert result.status is Status.FAIL and "/lib/x86_64-linux-gnu/libfabric.so.1" in result.detail
    assert "turnkv-nixl" in result.fix


def test_nixl_fails_when_libfabric_is_not_found():
    missing = Completed(0, "\tlibfabric.so.1 => not found\n")
    result, _ = run(doctor.check_nixl, FakeNode({f"ldd {PLUGIN_DIR}/libplugin_LIBFABRIC.so": missing}))
    assert result.status is Status.FAIL and "not found" in result.detail


def test_nixl_fails_when_the_backend_is_not_instantiated():
    no_backend = Completed(0, json.dumps({"plugins": ["LIBFABRIC", "UCX"], "backends": []}))
    result, _ = run(doctor.check_nixl, FakeNode({"python -c \nimport json, sys\nfrom nixl": no_backend}))
    assert result.status is Status.FAIL and "no LIBFABRIC backend" in result.detail


def test_nixl_fails_when_the_agent_crashes():
    crash = Completed(1, "", "Traceback ...\nRuntimeError: No plugins available for NIXL, cannot start transfers!")
    result, _ = run(doctor.check_nixl, FakeNode({"python -c \nimport json, sys\nfrom nixl": crash}))
    assert result.status is Status.FAIL and "No plugins available" in result.detail


def test_nixl_fails_without_its_env_file():
    result, _ = run(doctor.check_nixl, FakeNode(files={doctor.NIXL_ENV_FILE: None}))
    assert result.status is Status.FAIL and doctor.NIXL_ENV_FILE in result.detail


def test_nixl_is_checked_on_neuron_too():
    """The Neuron image ships NIXL's LIBFABRIC plugin (the Neuron disaggregated-inference setup)."""
    result, fake = run(doctor.check_nixl, flavor="neuron")
    assert result.status is Status.PASS and any(line.startswith("ldd ") for line, _ in fake.calls)
    assert "offers DRAM/VRAM" in result.detail


def test_nixl_fails_on_neuron_when_libfabric_offers_no_device_memory():
    """Without a Neuron runtime NIXL's LIBFABRIC plugin offers DRAM only, and vLLM registers the KV cache as VRAM:
    every engine would stop at start (connector.worker.registration_refusal)."""
    dram_only = Completed(0, json.dumps({"plugins": ["LIBFABRIC"], "backends": ["LIBFABRIC"],
                                         "mems": {"LIBFABRIC": ["DRAM"]}}))
    fake = FakeNode({"python -c \nimport json, sys\nfrom nixl": dram_only})
    result, _ = run(doctor.check_nixl, fake, flavor="neuron")
    assert result.status is Status.FAIL and "not VRAM" in result.detail and "libnrt.so.1" in result.fix
    result, _ = run(doctor.check_nixl, fake)  # a GPU node's VRAM is checked by gpu-memory-registration
    assert result.status is Status.PASS


def test_the_nixl_probe_reports_libfabric_memory_types_through_nixls_api(monkeypatch, capsys):
    """The probe as it runs on a node, through NIXL's real Python API over a fake of its C++ agent
    (tests.unit.fake_nixl): the memory types come back as the bindings name them, normalised."""
    pytest.importorskip("nixl")
    import sys

    import nixl._api as nixl_api

    from tests.unit import fake_nixl

    for runtime, mems in (("neuron", ["DRAM", "VRAM"]), ("system", ["DRAM"])):
        monkeypatch.setattr(nixl_api, "nixlBind", fake_nixl.FakeBindings(nixl_api.nixlBind, fake_nixl.Fabric(runtime)))
        monkeypatch.setattr(sys, "argv", ["-c", "node"])
        exec(compile(doctor.NIXL_PROBE, "<probe>", "exec"), {})  # the probe as the node runs it
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert out["backends"] == ["LIBFABRIC"] and out["mems"] == {"LIBFABRIC": mems}


# --- GPUDirect RDMA ---------------------------------------------------------------------------------------


def test_gdr_passes_with_dma_buf():
    result, _ = run(doctor.check_gdr)
    assert result.status is Status.PASS and "dma-buf" in result.detail


def test_gdr_passes_with_peermem_on_an_old_kernel():
    fake = FakeNode(files={"/proc/modules": "efa_nv_peermem 16384 0 - Live 0x0\n",
                           "/proc/driver/nvidia/version": "NVRM version: NVIDIA UNIX x86_64 Kernel Module 580.95\n"},
                    kernel="5.10.0-1-aws")
    result, _ = run(doctor.check_gdr, fake)
    assert result.status is Status.PASS and "efa_nv_peermem" in result.detail


def test_gdr_fails_on_an_old_kernel_without_peermem():
    result, _ = run(doctor.check_gdr, FakeNode(kernel="5.10.220-209.869.amzn2.x86_64"))
    assert result.status is Status.FAIL and "kernel 5.10.220" in result.detail and "efa_nv_peermem" in result.fix


def test_gdr_fails_with_the_proprietary_module_and_no_peermem():
    fake = FakeNode(files={"/proc/driver/nvidia/version": "NVRM version: NVIDIA UNIX x86_64 Kernel Module 580\n"})
    result, _ = run(doctor.check_gdr, fake)
    assert result.status is Status.FAIL and "not the open one" in result.detail


def test_gdr_is_skipped_on_neuron():
    assert run(doctor.check_gdr, flavor="neuron")[0].status is Status.SKIP


# --- driver and CUDA / Neuron devices --------------------------------------------------------------------


def test_driver_and_cuda_agree():
    result, _ = run(doctor.check_driver)
    assert result.status is Status.PASS and "driver 580.95.05" in result.detail and "torch CUDA 13.0" in result.detail


def test_driver_too_old_for_torch_cuda():
    fake = FakeNode({"nvidia-smi --query-gpu": Completed(0, "570.86.15\n"),
                     "nvidia-smi": Completed(0, "| Driver Version: 570.86.15   CUDA Version: 12.8 |\n")})
    result, _ = run(doctor.check_driver, fake)
    assert result.status is Status.FAIL
    assert "older than 580" in result.detail and "supports CUDA up to 12.8, torch needs 13.0" in result.detail


def test_torch_built_for_another_cuda_major():
    result, _ = run(doctor.check_driver, FakeNode({"python -c import torch": Completed(0, "12.8\n")}))
    assert result.status is Status.FAIL and "torch is built for CUDA 12.8" in result.detail


def test_no_nvidia_driver():
    result, _ = run(doctor.check_driver, FakeNode({"nvidia-smi --query-gpu": Completed(127, "", "not found")}))
    assert result.status is Status.FAIL and "nvidia-smi failed" in result.detail


def test_neuron_devices_pass_and_fail():
    ok, _ = run(doctor.check_driver, flavor="neuron")
    assert ok.status is Status.PASS and ok.name == "neuron-devices" and "2 Neuron" in ok.detail
    bad, _ = run(doctor.check_driver, FakeNode({"neuron-ls --json-output": Completed(0, "[]")}), flavor="neuron")
    assert bad.status is Status.FAIL and "aws-neuronx-dkms" in bad.fix


# --- CUDA memory registered with LIBFABRIC ------------------------------------------------------------------


def vram(answer: dict | None = None, returncode: int = 0, stderr: str = "") -> FakeNode:
    return FakeNode({VRAM_PROBE: Completed(returncode, json.dumps(answer) + "\n" if answer else "", stderr)})


def test_gpu_memory_registration_passes_and_registers_a_gibibyte_with_the_plugin_env():
    result, fake = run(doctor.check_gpu_memory)
    assert result.status is Status.PASS and result.name == "gpu-memory-registration"
    assert "LIBFABRIC registered 1024 MiB of CUDA memory on NVIDIA H200" in result.detail
    assert "dma-buf: kernel 6.8.0-1015-aws" in result.detail
    line, env = next((line, env) for line, env in fake.calls if line.startswith(VRAM_PROBE))
    assert line.endswith(f" {1024 << 20}") and env["NIXL_PLUGIN_DIR"] == PLUGIN_DIR
    assert "backends=[\"LIBFABRIC\"]" in line and "\"VRAM\"" in line and "register_memory" in line


def test_gpu_memory_registration_size_is_an_option():
    _, fake = run(doctor.check_gpu_memory, vram_mib=64)
    assert any(line.startswith(VRAM_PROBE) and line.endswith(f" {64 << 20}") for line, _ in fake.calls)


def test_gpu_memory_registration_fails_with_the_dma_buf_and_peer_memory_fix():
    refused = {"cuda": True, "gpu": "NVIDIA H200", "backends": ["LIBFABRIC"], "registered": False,
               "error": "nixlBackendError: NIXL_ERR_BACKEND"}
    fake = vram(refused)
    fake.kernel = "5.10.220-209.869.amzn2.x86_64"
    result, _ = run(doctor.check_gpu_memory, fake)
    assert result.status is Status.FAIL and "could not register 1024 MiB" in result.detail
    assert "NIXL_ERR_BACKEND" in result.detail and "kernel 5.10.220-209.869.amzn2.x86_64 < 5.12" in result.detail
    assert "kernel >= 5.12" in result.fix and "efa_nv_peermem" in result.fix and "nvidia-peermem" in result.fix
    # with dma-buf seemingly present the fix points further
    result, _ = run(doctor.check_gpu_memory, vram(refused))
    assert result.status is Status.FAIL and "looks present" in result.fix


def test_gpu_memory_registration_fails_when_the_probe_crashes():
    result, _ = run(doctor.check_gpu_memory, vram(returncode=1, stderr="Traceback\nRuntimeError: CUDA error: OOM"))
    assert result.status is Status.FAIL and "CUDA error: OOM" in result.detail


@pytest.mark.parametrize("answer, reason", [
    ({"cuda": False, "reason": "torch.cuda.is_available() is False"}, "no CUDA device: torch.cuda.is_available()"),
    ({"cuda": True, "gpu": "H200", "plugins": ["UCX"], "backends": []}, "no LIBFABRIC backend to register with "
                                                                         "(plugins: UCX"),
    ({"cuda": True, "gpu": "H200", "backends": [], "backend_error": "RuntimeError: fi_getinfo -61"},
     "no LIBFABRIC backend to register with (RuntimeError: fi_getinfo -61"),
])
def test_gpu_memory_registration_is_skipped_without_a_gpu_or_libfabric(answer, reason):
    result, _ = run(doctor.check_gpu_memory, vram(answer))
    assert result.status is Status.SKIP and reason in result.detail


def test_gpu_memory_registration_is_skipped_without_the_plugin_env_on_neuron_and_in_image_builds():
    for fake, opts in ((FakeNode(files={doctor.NIXL_ENV_FILE: None}), {}), (None, {"flavor": "neuron"}),
                       (None, {"image": True})):
        result, fake = run(doctor.check_gpu_memory, fake, **opts)
        assert result.status is Status.SKIP and not any(line.startswith(VRAM_PROBE) for line, _ in fake.calls)


def test_the_registration_probe_skips_on_this_machine():
    """The probe itself, run here (no CUDA device, or no torch): it says why, quickly, and exits 0."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", doctor.VRAM_PROBE, str(1 << 20)], capture_output=True, text=True,
                         timeout=120)
    answer = doctor._last_json(out.stdout)
    assert out.returncode == 0, out.stderr
    if answer.get("cuda"):
        pytest.skip("a CUDA device is present here: the probe ran for real")
    assert answer["reason"]


# --- pinned versions --------------------------------------------------------------------------------------


def test_versions_pass():
    result, fake = run(doctor.check_versions)
    assert result.status is Status.PASS and f"vllm {versions.VLLM_GPU}" in result.detail
    line = next(line for line, _ in fake.calls if "importlib" in line)
    assert line.endswith("vllm,nixl,turnkv vllm,connector.pull,connector.push,nixl")


def test_versions_fail_on_a_wrong_vllm_and_a_broken_connector():
    bad = Completed(0, "INFO vllm banner\n" + json.dumps({
        "versions": {"vllm": "0.31.0", "nixl": versions.NIXL, "turnkv": versions.TURNKV},
        "errors": {"connector": "ImportError: cannot import name 'NixlConnector'"}}))
    result, _ = run(doctor.check_versions, FakeNode({"python -c \nimport importlib": bad}))
    assert result.status is Status.FAIL
    assert f"vllm 0.31.0 (pinned {versions.VLLM_GPU})" in result.detail and "import connector" in result.detail


def test_versions_fail_when_the_interpreter_is_missing():
    result, _ = run(doctor.check_versions, FakeNode({"python -c \nimport importlib": Completed(127, "", "no python")}))
    assert result.status is Status.FAIL and "could not run" in result.detail


def test_neuron_versions_check_vllm_neuron_its_vllm_and_the_connector():
    probe = Completed(0, json.dumps({"versions": {"vllm": f"{versions.VLLM_NEURON_CORE}+neuron", "nixl": versions.NIXL,
                                                  "turnkv": versions.TURNKV, "vllm-neuron": versions.VLLM_NEURON},
                                     "errors": {}}) + "\n")
    result, fake = run(doctor.check_versions, FakeNode({"python -c \nimport importlib": probe}), flavor="neuron")
    assert result.status is Status.PASS, result.detail
    assert f"vllm {versions.VLLM_NEURON_CORE}" in result.detail
    assert f"vllm-neuron {versions.VLLM_NEURON}" in result.detail
    assert any(line.endswith("vllm,vllm-neuron,nixl,turnkv vllm,connector.pull,connector.push,nixl,vllm_neuron")
               for line, _ in fake.calls)


def test_neuron_refuses_the_gpu_images_vllm():
    result, _ = run(doctor.check_versions, flavor="neuron")  # the probe answers vllm 0.32.0
    assert result.status is Status.FAIL and f"(pinned {versions.VLLM_NEURON_CORE})" in result.detail


def test_connector_code_passes_and_fails_on_drift():
    result, fake = run(doctor.check_connector_code)
    assert result.status is Status.PASS and ("python -m turnkv.vllm_files", None) in fake.calls
    drift = Completed(1, "", "vLLM 0.32.0 at /x differs from the image wheel's connector files:\n"
                             "  vllm/v1/engine/core.py")
    result, _ = run(doctor.check_connector_code, FakeNode({"python -m turnkv.vllm_files": drift}))
    assert result.status is Status.FAIL and "core.py" in result.detail


ENGINE_ENV = ("TURNKV_ROLE=prefill\nTURNKV_ENGINE_ID=p-1\nTURNKV_MODEL=/m\nTURNKV_SIDE_CHANNEL_HOST=10.0.0.5\n"
              "TURNKV_TP_SIZE='8'\n")


def test_engine_env_is_validated_by_the_engines_own_spec():
    result, _ = run(doctor.check_engine_env, FakeNode(files={doctor.ENGINE_ENV_FILE: ENGINE_ENV}))
    assert result.status is Status.PASS and "TP 8" in result.detail
    bad = ENGINE_ENV.replace("10.0.0.5", "localhost")
    result, _ = run(doctor.check_engine_env, FakeNode(files={doctor.ENGINE_ENV_FILE: bad}))
    assert result.status is Status.FAIL and "is not routable" in result.detail
    result, _ = run(doctor.check_engine_env, image=True)
    assert result.status is Status.SKIP


def test_engine_env_on_neuron_names_what_is_unverified():
    fake = FakeNode(files={doctor.ENGINE_ENV_FILE: ENGINE_ENV})
    result, _ = run(doctor.check_engine_env, fake, flavor="neuron")
    assert result.status is Status.FAIL and "unverified on neuron" in result.detail
    allowed = FakeNode(files={doctor.ENGINE_ENV_FILE: ENGINE_ENV + "TURNKV_ALLOW_UNVERIFIED=neuron\n"})
    result, _ = run(doctor.check_engine_env, allowed, flavor="neuron")
    assert result.status is Status.PASS


# --- every engine of a node (engine.env, and a slot file per engine on a node of several) ----------------------

SHARED_ENV = ("TURNKV_ROLE=decode\nTURNKV_ENGINE_ID=i-0abc\nTURNKV_MODEL=/m\nTURNKV_SIDE_CHANNEL_HOST=10.0.0.5\n"
              "TURNKV_TP_SIZE=4\nTURNKV_PORT=8000\nTURNKV_SIDE_CHANNEL_PORT=5600\n")
EIGHT_GPUS = {"nvidia-smi --query-gpu=index": Completed(0, "".join(f"{k}\n" for k in range(8)))}


def write_node(root, shared: str = SHARED_ENV, engines: int = 0, tp: int = 4, gpu: bool = True,
               **overrides: dict[str, str]) -> None:
    """/etc/turnkv under ``root`` as an instance's user data leaves it: engine.env, and with ``engines`` the slot
    files of node_env.engine_slots (the bootstrap's one source); ``slot1={...}`` sets variables over slot 1's."""
    etc = root / node_env.ETC_DIR.lstrip("/")
    etc.mkdir(parents=True, exist_ok=True)
    (etc / "engine.env").write_text(shared)
    for slot in node_env.engine_slots(engines, tp, 8) if engines else ():
        variables = {**slot.variables(gpu), node_env.ENGINE_ID: "i-0abc" + node_env.slot_suffix(slot.index),
                     node_env.CLOUDMAP_INSTANCE_ID: "i-0abc" + node_env.slot_suffix(slot.index),
                     **overrides.get(f"slot{slot.index}", {})}
        (etc / f"engine-{slot.index}.env").write_text(node_env.render(variables))


def disk_node(root, fake=None):
    """A FakeNode whose /etc/turnkv files are real files under ``root`` (read by doctor's own reader)."""
    fake = fake or FakeNode(EIGHT_GPUS)

    def read_text(path):
        if path.startswith(node_env.ETC_DIR + "/"):
            return doctor._read_text(str(root / path.lstrip("/")))
        return fake.files.get(path)

    return dataclasses.replace(fake.node(), read_text=read_text)


def engine_results(node, **opts):
    return doctor.run_checks(node, Options(**opts), checks=(doctor.check_engine_env, doctor.check_engine_slots))


def test_one_engine_node_reports_as_before(tmp_path):
    """engine.env alone: one engine-env line, as before, and no per-engine lines."""
    write_node(tmp_path)
    results = engine_results(disk_node(tmp_path))
    assert [(r.name, r.status) for r in results] == [("engine-env", Status.PASS)]
    assert results[0].detail == "decode engine i-0abc: pull, TP 4, backends LIBFABRIC"
    assert doctor.slot_engines(disk_node(tmp_path)) == []


def test_every_engine_of_a_two_engine_node_is_checked(tmp_path):
    write_node(tmp_path, engines=2)
    results = engine_results(disk_node(tmp_path))
    assert [(r.name, r.status) for r in results] == [
        ("engine-env@0", Status.PASS), ("engine-env@1", Status.PASS),
        ("engine-slot@0", Status.PASS), ("engine-slot@1", Status.PASS)]
    by_name = {r.name: r.detail for r in results}
    assert by_name["engine-env@1"] == "engine 1 (i-0abc-1): decode engine i-0abc-1: pull, TP 4, backends LIBFABRIC"
    assert by_name["engine-slot@0"] == ("engine 0 (i-0abc): GPUs 0,1,2,3 of 8, HTTP port 8000, "
                                        "side-channel port(s) 5600-5603")
    assert by_name["engine-slot@1"] == ("engine 1 (i-0abc-1): GPUs 4,5,6,7 of 8, HTTP port 8001, "
                                        "side-channel port(s) 5604-5607")


def test_the_whole_run_adds_the_per_engine_lines_only_on_a_node_of_several(tmp_path):
    write_node(tmp_path / "one")
    write_node(tmp_path / "two", engines=2)
    one = [r.name for r in doctor.run_checks(disk_node(tmp_path / "one"), Options())]
    two = [r.name for r in doctor.run_checks(disk_node(tmp_path / "two"), Options())]
    assert one[-1] == "engine-env" and not any("@" in n for n in one)
    assert two[:-4] == one[:-1] and two[-4:] == ["engine-env@0", "engine-env@1", "engine-slot@0", "engine-slot@1"]


def test_engines_sharing_devices_or_ports_fail_naming_each_other(tmp_path):
    write_node(tmp_path, engines=2, slot1={"CUDA_VISIBLE_DEVICES": "3,4,5,6", "TURNKV_SIDE_CHANNEL_PORT": "5603"})
    results = {r.name: r for r in engine_results(disk_node(tmp_path))}
    assert results["engine-env@0"].status is Status.PASS and results["engine-env@1"].status is Status.PASS
    first, second = results["engine-slot@0"], results["engine-slot@1"]
    assert first.status is Status.FAIL and second.status is Status.FAIL
    assert first.detail == ("engine 0 (i-0abc): GPUs 3 are engine 1's too; port(s) 5603 are engine 1's too")
    assert second.detail.startswith("engine 1 (i-0abc-1): GPUs 3 are engine 0's too; port(s) 5603")
    assert "/etc/turnkv/engine-0.env" in first.fix and "engine_slots" in first.fix


def test_an_engine_with_devices_off_the_node_or_not_its_tp_size_fails(tmp_path):
    write_node(tmp_path, engines=2, slot1={"CUDA_VISIBLE_DEVICES": "4,5,6,7,8"})
    results = {r.name: r for r in engine_results(disk_node(tmp_path))}
    assert results["engine-slot@0"].status is Status.PASS
    assert results["engine-slot@1"].status is Status.FAIL
    assert "5 GPUs for TP 4" in results["engine-slot@1"].detail
    assert "GPUs 8 are not on this node (it has 8: 0-7)" in results["engine-slot@1"].detail
    # an engine with no device variable would take the whole node
    write_node(tmp_path, engines=2, slot0={"CUDA_VISIBLE_DEVICES": ""})
    results = {r.name: r for r in engine_results(disk_node(tmp_path))}
    assert results["engine-slot@0"].status is Status.FAIL and "every device" in results["engine-slot@0"].detail


def test_a_bad_slot_file_fails_its_engine_and_names_the_file(tmp_path):
    write_node(tmp_path, engines=2, slot1={"TURNKV_PORT": "0", "TURNKV_ENGINE_ID": "i-0abc"})
    results = {r.name: r for r in engine_results(disk_node(tmp_path))}
    assert results["engine-env@0"].status is Status.PASS
    bad = results["engine-env@1"]
    assert bad.status is Status.FAIL and bad.detail.startswith(
        "engine 1 (i-0abc): /etc/turnkv/engine-1.env over /etc/turnkv/engine.env: TURNKV_PORT=0 is out of range")
    assert "/etc/turnkv/engine-1.env" in bad.fix
    # its devices are still checked; its ports cannot be
    assert results["engine-slot@1"].status is Status.SKIP and "see engine-env@1" in results["engine-slot@1"].detail
    assert results["engine-slot@0"].status is Status.PASS


def test_a_slot_file_that_does_not_parse_fails_its_engine_only(tmp_path):
    write_node(tmp_path, engines=2)
    (tmp_path / "etc/turnkv/engine-1.env").write_text("TURNKV_PORT 8001\n")
    results = {r.name: r for r in engine_results(disk_node(tmp_path))}
    assert results["engine-env@1"].status is Status.FAIL
    assert results["engine-env@1"].detail.startswith("engine 1: /etc/turnkv/engine-1.env: line 1: expected NAME=value")
    assert results["engine-slot@1"].status is Status.SKIP and "does not parse" in results["engine-slot@1"].detail
    assert results["engine-env@0"].status is results["engine-slot@0"].status is Status.PASS


def test_two_engines_with_one_id_fail(tmp_path):
    write_node(tmp_path, engines=2, slot1={"TURNKV_ENGINE_ID": "i-0abc"})
    results = {r.name: r for r in engine_results(disk_node(tmp_path))}
    assert results["engine-slot@1"].status is Status.FAIL
    assert "engine id i-0abc is engine 0's too" in results["engine-slot@1"].detail


def test_a_neuron_node_of_several_engines_reads_core_ranges(tmp_path):
    write_node(tmp_path, engines=4, tp=2, gpu=False, shared=SHARED_ENV.replace("TP_SIZE=4", "TP_SIZE=2")
               + "TURNKV_ALLOW_UNVERIFIED=neuron\n")
    cores = Completed(0, json.dumps([{"neuron_device": 0, "nc_count": 4}, {"neuron_device": 1, "nc_count": 4}]))
    results = engine_results(disk_node(tmp_path, FakeNode({"neuron-ls --json-output": cores})), flavor="neuron")
    assert all(r.status is Status.PASS for r in results), results
    assert [r.detail for r in results if r.name == "engine-slot@3"] == [
        "engine 3 (i-0abc-3): NeuronCores 6,7 of 8, HTTP port 8003, side-channel port(s) 5606-5607"]


def test_the_node_device_count_unknown_is_said_not_failed(tmp_path):
    write_node(tmp_path, engines=2)
    fake = FakeNode({"nvidia-smi --query-gpu=index": Completed(9, "", "NVIDIA-SMI has failed")})
    results = {r.name: r for r in engine_results(disk_node(tmp_path, fake))}
    assert results["engine-slot@1"].status is Status.PASS and "not counted" in results["engine-slot@1"].detail


def test_the_slot_files_doctor_reads_are_the_ones_node_env_names(tmp_path):
    """Discovery goes through node_env.engine_env_file; it stops at the first missing slot."""
    read = []
    write_node(tmp_path, engines=2)
    node = disk_node(tmp_path)
    node = dataclasses.replace(node, read_text=lambda p, inner=node.read_text: read.append(p) or inner(p))
    assert [e.path for e in doctor.slot_engines(node)] == [node_env.engine_env_file(k) for k in range(2)]
    assert read == [doctor.ENGINE_ENV_FILE, *(node_env.engine_env_file(k) for k in range(3))]


# --- the whole run and the CLI ------------------------------------------------------------------------------


def test_a_crashing_check_is_a_failure_not_a_crash():
    def boom(node, opts):
        raise KeyError("x")

    results = doctor.run_checks(FakeNode().node(), Options(), checks=(boom,))
    assert results[0].status is Status.FAIL and "KeyError" in results[0].detail and doctor.failed(results)


def test_all_checks_pass_on_a_healthy_node():
    results = doctor.run_checks(FakeNode().node(), Options())
    assert [r.name for r in results] == ["efa-libfabric", "efa-device", "nixl-libfabric", "gpudirect-rdma",
                                         "driver-cuda", "gpu-memory-registration", "host-tier-registration",
                                         "neuron-platform", "pinned-versions", "connector-code", "engine-env"]
    assert all(r.status is not Status.FAIL for r in results) and not doctor.failed(results)


@pytest.fixture
def cli(monkeypatch):
    from turnkv.cli import app

    state = {"fake": FakeNode()}
    monkeypatch.setattr(doctor, "real_node", lambda python=None: state["fake"].node())
    return app, state


def test_cli_json_and_exit_code(cli):
    app, state = cli
    ok = CliRunner().invoke(app, ["doctor", "--json", "--flavor", "gpu"])
    assert ok.exit_code == 0, ok.output
    body = json.loads(ok.output)
    assert body["ok"] is True and len(body["checks"]) == 11

    state["fake"] = FakeNode({f"{EFA}/bin/fi_info -p efa": Completed(61, "", "fi_getinfo: -61")})
    bad = CliRunner().invoke(app, ["doctor", "--json", "--retry-seconds", "0"])
    assert bad.exit_code == 1
    failed = [c for c in json.loads(bad.output)["checks"] if c["status"] == "fail"]
    assert [c["name"] for c in failed] == ["efa-device"] and failed[0]["fix"]


def test_cli_table_and_image_mode(cli):
    app, _ = cli
    result = CliRunner().invoke(app, ["doctor", "--image", "--flavor", "gpu"])
    assert result.exit_code == 0, result.output
    assert "efa-device" in result.output and "skip" in result.output and "all checks passed" in result.output


def test_cli_flavor_from_the_image_and_a_bad_flavor(cli):
    app, state = cli
    neuron_probe = Completed(0, json.dumps({"versions": {"vllm": versions.VLLM_NEURON_CORE, "nixl": versions.NIXL,
                                                         "turnkv": versions.TURNKV,
                                                         "vllm-neuron": versions.VLLM_NEURON}, "errors": {}}))
    state["fake"] = FakeNode({"python -c \nimport importlib": neuron_probe,
                              "ldconfig -p": Completed(0, NEURON_LDCONFIG),
                              "python -c \nimport json, os": NEURON_PROBE_OK}, files={doctor.FLAVOR_FILE: "neuron\n"})
    result = CliRunner().invoke(app, ["doctor", "--json"])
    assert json.loads(result.output)["flavor"] == "neuron" and result.exit_code == 0
    bad = CliRunner().invoke(app, ["doctor", "--flavor", "tpu"])
    assert bad.exit_code == 2 and "tpu" in bad.output


def test_cli_names_each_engine_of_a_node_of_several(cli, tmp_path):
    app, state = cli
    write_node(tmp_path, engines=2, slot1={"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    node = disk_node(tmp_path)
    state["fake"] = type("Disk", (), {"node": lambda self: node})()
    result = CliRunner().invoke(app, ["doctor", "--json", "--flavor", "gpu"])
    assert result.exit_code == 1, result.output
    checks = {c["name"]: c for c in json.loads(result.output)["checks"]}
    assert checks["engine-env@0"]["status"] == checks["engine-env@1"]["status"] == "pass"
    assert checks["engine-slot@1"]["status"] == "fail" and "engine 1 (i-0abc-1)" in checks["engine-slot@1"]["detail"]


# --- Neuron platform (turnkv.neuron) ----------------------------------------------------------------------------

NEURON_LDCONFIG = LDCONFIG + "\tlibcuda.so.1 (libc6,x86-64) => /usr/local/lib/libcuda.so.1\n"
NEURON_PROBE_OK = Completed(0, json.dumps({"platform_plugins": ["neuron"], "device_type": "neuron"}) + "\n")


def neuron_node(**responses):
    return FakeNode({"ldconfig -p": Completed(0, NEURON_LDCONFIG), "python -c \nimport json, os": NEURON_PROBE_OK,
                     **responses})


def test_neuron_platform_passes_with_the_stub_the_plugin_and_the_platform():
    result, fake = run(doctor.check_neuron_platform, neuron_node(), flavor="neuron")
    assert result.status is Status.PASS and "libcuda.so.1" in result.detail and "'neuron'" in result.detail
    probe_env = next(env for line, env in fake.calls if line.startswith("python -c \nimport json, os"))
    assert probe_env["VLLM_PLUGINS"] == "turnkv,turnkv-leases,neuron"  # what engine_args.serve_env sets on Neuron


def test_neuron_platform_fails_without_libcuda_naming_the_setup_guide():
    result, fake = run(doctor.check_neuron_platform, neuron_node(**{"ldconfig -p": Completed(0, LDCONFIG)}),
                       flavor="neuron")
    assert result.status is Status.FAIL and "unsupported backend LIBFABRIC" in result.detail
    assert "setup guide" in result.fix
    assert not any(line.startswith("python") for line, _ in fake.calls)


def test_neuron_platform_fails_without_the_plugin_or_off_neuron():
    none = Completed(0, json.dumps({"platform_plugins": [], "device_type": "cpu"}) + "\n")
    result, _ = run(doctor.check_neuron_platform, neuron_node(**{"python -c \nimport json, os": none}),
                    flavor="neuron")
    assert result.status is Status.FAIL and "no vLLM platform plugin named 'neuron'" in result.detail
    cpu = Completed(0, json.dumps({"platform_plugins": ["neuron"], "device_type": "cpu"}) + "\n")
    result, _ = run(doctor.check_neuron_platform, neuron_node(**{"python -c \nimport json, os": cpu}),
                    flavor="neuron")
    assert result.status is Status.FAIL and "device type 'cpu'" in result.detail and "Trn2" in result.fix


def test_neuron_platform_is_skipped_on_gpu_images():
    assert run(doctor.check_neuron_platform)[0].status is Status.SKIP


# --- host tier (issue #37) ------------------------------------------------------------------------------------

DECODE_ENV = ENGINE_ENV.replace("prefill", "decode").replace("p-1", "d-1")
POOL_PROBE = "python -m connector.pool_probe"
GIB = 2**30


def pool_result(granted_gib: float, configured_gib: float = 512, **extra) -> Completed:
    ranks = [{"rank": r, "planned": f"rank {r}", "refused": extra.pop("refused", []) if r == 0 else [],
              "granted_bytes": int(granted_gib * GIB / 4), "read_descriptors": 2} for r in range(4)]
    return Completed(0, "NIXL INFO ...\n" + json.dumps({
        "cuda": True, "backend": "LIBFABRIC", "numa_node": 0, "page_size": 2 * 1024 * 1024, "ranks": ranks,
        "configured_bytes": int(configured_gib * GIB), "granted_bytes": int(granted_gib * GIB), **extra}) + "\n")


def decode_node(probe: Completed, tunables: str = '{"host_kv_budget_mib": 1048576}') -> FakeNode:
    return FakeNode({POOL_PROBE: probe}, files={doctor.ENGINE_ENV_FILE: DECODE_ENV,
                                                node_env.TUNABLES_FILE: tunables})


def test_host_tier_registers_the_decode_engines_budget_and_reads_it_back():
    result, fake = run(doctor.check_host_tier, decode_node(pool_result(512)))
    assert result.status is Status.PASS, result
    assert "registered 512.00 of 512.00 GiB" in result.detail and "READ back by a second agent" in result.detail
    line, env = next((c, e) for c, e in fake.calls if c.startswith(POOL_PROBE))
    assert "--budget-mib 1048576 --tp 8 --backend" in line and env["NIXL_PLUGIN_DIR"] == PLUGIN_DIR


def test_host_tier_says_when_the_node_grants_less_or_nothing():
    refused = ["rank 0: 128.00 GiB: NIXL_ERR_BACKEND: fi_mr_reg: Cannot allocate memory"]
    result, _ = run(doctor.check_host_tier, decode_node(pool_result(84, refused=refused)))
    assert result.status is Status.FAIL and result.detail.startswith("SHRUNK: ") and "84.00 of 512.00" in result.detail
    assert "Cannot allocate memory" in result.detail and "hugepages" in result.fix
    result, _ = run(doctor.check_host_tier, decode_node(pool_result(0)))
    assert result.status is Status.FAIL and result.detail.startswith("NO HOST TIER: ")


def test_host_tier_is_skipped_where_there_is_none_to_check():
    assert run(doctor.check_host_tier, decode_node(pool_result(0), '{"host_kv_budget_mib": 0}'))[0].status \
        is Status.SKIP
    prefill = FakeNode(files={doctor.ENGINE_ENV_FILE: ENGINE_ENV})
    assert "decode's" in run(doctor.check_host_tier, prefill)[0].detail
    assert run(doctor.check_host_tier, image=True)[0].status is Status.SKIP
    result, _ = run(doctor.check_host_tier, decode_node(pool_result(2, 2), '{"host_kv_budget_mib": 0}'),
                       host_tier_mib=2048)
    assert result.status is Status.PASS and "--host-tier-mib=2048" in result.detail
