"""Bake the images into a fake root with stubbed commands, running the component documents' own commands.

Shows: the order of steps, idempotency (a second bake changes nothing on the root), and hard failures with
clear messages (checksum mismatch, bad GPG signature or key, missing or late EFA device, NIXL plugin linking the
wrong libfabric, missing variables).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ami import recipes
from tests.ami import stubs
from turnkv import neuron, versions


def component(flavor: str, name: str) -> recipes.ComponentSpec:
    return next(c for c in recipes.IMAGES[flavor].components if c.name == name)


def positions(calls: list[str], *prefixes: str) -> list[int]:
    """Where each prefix matches, in order: each search starts after the previous match, so the list is
    increasing exactly when the calls happened in this order (fails naming the first one out of order)."""
    out, start = [], 0
    for prefix in prefixes:
        hits = [i for i, call in enumerate(calls) if i >= start and call.startswith(prefix)]
        assert hits, f"no call starting with {prefix!r} after call {start} in:\n" + "\n".join(calls)
        out.append(hits[0])
        start = hits[0] + 1
    return out


def test_gpu_bake_runs_the_steps_in_order(bake):
    bake.bake("gpu")
    calls = bake.calls()
    order = positions(
        calls,
        "apt-get -o DPkg::Lock::Timeout=600 update", "apt-get -o DPkg::Lock::Timeout=600 install", "python3 -m venv",
        f"curl -fsSL --retry 3 -o {bake.env['TURNKV_WORK_DIR']}/efa/aws-efa-installer-{versions.EFA_INSTALLER}",
        "sha256sum", "tar -xzf", "efa_installer.sh -y", "fi_info --version", "Reboot",
        f"pip install --no-cache-dir --no-deps nixl=={versions.NIXL} {versions.NIXL_CUDA_PACKAGE}=={versions.NIXL}",
        "readelf -d", "ldd",
        f"pip install --no-cache-dir vllm=={versions.VLLM_GPU} nixl=={versions.NIXL}",
        f"aws s3 cp --only-show-errors s3://assets-bucket/turnkv-{versions.TURNKV}-py3-none-any.whl",
        "pip install --no-cache-dir", "systemctl --root=",
        f"curl -fsSL --retry 3 -o {bake.env['TURNKV_WORK_DIR']}/cloudwatch/amazon-cloudwatch-agent.deb "
        f"https://amazoncloudwatch-agent.s3.amazonaws.com/ubuntu/amd64/{versions.CLOUDWATCH_AGENT}/",
        "dpkg --root=", "python -m turnkv.versions --json", "turnkv doctor --flavor gpu --image",
    )
    assert len(order) == 20 and order == sorted(set(order))
    # The wheel's plugin linked the EFA libfabric: nothing was built from source.
    assert not any(c.startswith(("git clone", "meson", "ninja")) for c in calls)
    # vLLM's install pulled the other CUDA variant too (its plugin links a distro libfabric): not the one used.
    assert (bake.root / "opt/turnkv/venv/lib/python3.12/site-packages/nixl_cu12.libs").is_dir()
    nixl_env = (bake.root / "etc/turnkv/nixl.env").read_text()
    assert "NIXL_PLUGIN_DIR=/opt/turnkv/venv/lib/python3.12/site-packages/nixl_cu13.libs/nixl\n" in nixl_env
    assert f"LD_LIBRARY_PATH={versions.EFA_PREFIX}/lib\n" in nixl_env
    assert (bake.root / "etc/systemd/system/timers.target.wants/turnkv-params-sync.timer").is_symlink()
    assert (bake.root / "opt/turnkv/bin/turnkv-efa-wait").stat().st_mode & 0o111
    pins = (bake.root / "etc/turnkv/versions.json").read_text()
    assert f'"VLLM_GPU": "{versions.VLLM_GPU}"' in pins


def test_second_bake_changes_nothing(bake):
    bake.bake("gpu")
    before = bake.manifest()
    first_calls = len(bake.calls())
    bake.bake("gpu")
    after = bake.manifest()
    assert after == before
    again = bake.calls()[first_calls:]
    installs = [c for c in again if c.startswith(("apt-get", "curl", "efa_installer", "pip install", "aws s3",
                                                   "dpkg --root", "systemctl", "python3 -m venv", "tar"))]
    assert installs == [], installs
    assert any(c.startswith("fi_info --version") for c in again), "the second run still verifies"
    assert len(before) > 40


#: What the pinned plugin's DLAMI venv carries (the setup guide's Option B): the SDK's compiler, torch-neuronx and nki,
#: the plugin and the vLLM it is built on.
DLAMI_PACKAGES = {"neuronx-cc": "2.22.0", "torch-neuronx": "2.14.0", "nki": "0.3.0",
                  "vllm-neuron": versions.VLLM_NEURON, "vllm": versions.VLLM_NEURON_CORE}


def dlami(bake, packages: dict[str, str] | None = None) -> Path:
    """The parent's vLLM venv, as the Neuron DLAMI of the pinned plugin ships it."""
    venv = bake.root / neuron.dlami_vllm_venv(versions.VLLM_NEURON).lstrip("/")
    (venv / "bin").mkdir(parents=True)
    (venv / "lib/python3.12/site-packages").mkdir(parents=True)
    for tool in ("python", "pip"):
        shutil.copy(bake.stub_dir / f"venv-{tool}", venv / "bin" / tool)
    (venv / ".fake-pip").mkdir()
    for name, version in (DLAMI_PACKAGES if packages is None else packages).items():
        (venv / ".fake-pip" / name).write_text(f"{version}\n")
    return venv


def test_neuron_bake_extends_the_dlami_venv(bake):
    venv = dlami(bake)
    bake.bake("neuron")
    calls = bake.calls()
    # /opt/turnkv/venv is the DLAMI's venv (relative link), extended with NIXL and the connector; the plugin is the
    # DLAMI's own: nothing is installed from a git tag.
    link = bake.root / "opt/turnkv/venv"
    assert link.is_symlink() and os.readlink(link) == f"../{venv.name}" and link.resolve() == venv.resolve()
    assert not any("git+" in c or c.startswith("python3 -m venv") for c in calls), calls
    assert (venv / ".fake-pip/nixl").read_text().strip() == versions.NIXL
    order = positions(calls, "efa_installer.sh -y",
                      f"pip install --no-cache-dir --no-deps nixl=={versions.NIXL}",
                      "ldconfig -p", "curl -fsSL --retry 3 -o", "dpkg -i",
                      "apt-get -o DPkg::Lock::Timeout=600 install -y --no-install-recommends cuda-cudart-dev-12-6",
                      "apt-get -o DPkg::Lock::Timeout=600 install -y --no-install-recommends cuda-cudart-13-0",
                      "aws s3 cp", "dpkg --root=", "turnkv doctor --flavor neuron --image")
    assert order == sorted(set(order))
    # NIXL's LIBFABRIC plugin dlopens libcuda.so.1 (the setup guide's stub) and links libcudart.so.13.
    assert os.readlink(bake.root / "usr/local/lib/libcuda.so.1").endswith("stubs/libcuda.so")
    assert os.readlink(bake.root / "usr/local/lib/libcudart.so.13").endswith("lib/libcudart.so.13")
    assert (bake.root / "etc/turnkv/nixl.env").exists()  # NIXL's LIBFABRIC plugin, as on the GPU image
    assert "nvidia_gpu" not in (bake.root / "opt/aws/amazon-cloudwatch-agent/etc/turnkv.json").read_text()
    before = bake.manifest()
    bake.bake("neuron")
    assert bake.manifest() == before


def test_a_neuron_image_that_has_the_libraries_gets_none_installed(bake):
    dlami(bake)
    bake.bake("neuron", extra_env={"FAKE_LIBCUDA": "1", "FAKE_LIBCUDART": "1"})
    assert not any("cuda-keyring" in c or "cuda-cudart" in c for c in bake.calls())
    assert not (bake.root / "usr/local/lib/libcuda.so.1").exists()


def test_a_dlami_venv_without_the_plugin_gets_it_from_neurons_pip_repository(bake):
    dlami(bake, {k: v for k, v in DLAMI_PACKAGES.items() if k not in ("vllm-neuron", "vllm")})
    bake.bake("neuron")
    assert any(c.startswith(f"pip install --no-cache-dir --extra-index-url https://pip.repos.neuron.amazonaws.com "
                            f"vllm-neuron=={versions.VLLM_NEURON} vllm=={versions.VLLM_NEURON_CORE}")
               for c in bake.calls())


def test_a_dlami_venv_without_the_neuron_compiler_is_refused(bake):
    dlami(bake, {k: v for k, v in DLAMI_PACKAGES.items() if k != "neuronx-cc"})
    for name in ("turnkv-base", "turnkv-efa", "turnkv-nixl"):
        bake.run_phase(component("neuron", name), "build")
    result = bake.run_phase(component("neuron", "turnkv-vllm-neuron"), "build", check=False)
    assert result.returncode != 0 and "neuronx-cc is missing" in result.stderr


def test_a_nixl_plugin_that_does_not_load_fails_the_bake(bake):
    """The load check itself: with libcudart.so.13 neither in the image nor linkable, the step stops."""
    dlami(bake)
    for name in ("turnkv-base", "turnkv-efa", "turnkv-nixl"):
        bake.run_phase(component("neuron", name), "build")
    (bake.root / "usr/local/lib").mkdir(parents=True, exist_ok=True)
    result = bake.run_phase(component("neuron", "turnkv-vllm-neuron"), "build", check=True)
    assert result.returncode == 0  # linked, then loaded
    (bake.root / "usr/local/lib/libcudart.so.13").unlink()
    check = bake.run_phase(component("neuron", "turnkv-vllm-neuron"), "validate", check=False)
    assert check.returncode != 0 and "libcudart.so.13: cannot open shared object file" in check.stdout + check.stderr


def test_a_parent_of_another_neuron_release_is_refused(bake):
    """A parent without the pinned plugin's venv stops the bake, naming the versioned SSM parameter's release."""
    for name in ("turnkv-base", "turnkv-efa", "turnkv-nixl"):
        bake.run_phase(component("neuron", name), "build")
    result = bake.run_phase(component("neuron", "turnkv-vllm-neuron"), "build", check=False)
    assert result.returncode != 0
    assert f"not the Neuron DLAMI of vllm-neuron {versions.VLLM_NEURON}" in result.stderr
    assert "image.ami_id" in result.stderr
    assert not any(c.startswith("pip install --no-cache-dir --extra-index-url") for c in bake.calls())


def test_the_parent_is_the_pinned_plugins_versioned_dlami_parameter():
    assert recipes.IMAGES["neuron"].parent_image_ssm_parameter == (
        f"/aws/service/neuron/dlami/pytorch-inference-vllm-{versions.VLLM_NEURON}/ubuntu-24.04/latest/image_id")


def test_the_bake_names_the_dlami_venv_as_turnkv_neuron_does():
    script = (recipes.SCRIPTS_DIR / "31-vllm-neuron.sh").read_text()
    assert f'dlami_venv="{neuron.DLAMI_VLLM_VENV_PREFIX}${{version//./_}}"' in script
    assert neuron.dlami_vllm_venv("0.21.0.1.0.0").endswith("_vllm_0_21_0_1_0_0")  # the setup guide's example


def test_test_phase_verifies_the_image(bake):
    bake.bake("gpu")
    bake.bake("gpu", phases=("test",))
    assert bake.calls()[-1] == "turnkv doctor --flavor gpu --image --retry-seconds 120 --json"


def test_checksum_mismatch_is_a_hard_failure(bake):
    bake.overrides["EfaInstallerSha256"] = "0" * 64
    efa = component("gpu", "turnkv-efa")
    bake.run_phase(component("gpu", "turnkv-base"), "build")
    result = bake.run_phase(efa, "build", check=False)
    assert result.returncode != 0
    assert (f"checksum mismatch for aws-efa-installer-{versions.EFA_INSTALLER}.tar.gz: expected {'0' * 64}, "
            f"got {bake.efa_sha256}. Not installing it.") in result.stderr
    assert not any(c.startswith(("tar", "efa_installer")) for c in bake.calls())
    assert not (bake.root / "opt/amazon/efa").exists()
    assert not (bake.root / "var/lib/turnkv/ami/efa-installer").exists()
    assert not list((bake.work / "downloads/efa").glob("*.tar.gz")), "the bad download is removed"


def test_the_real_pin_does_not_match_a_different_tarball(bake):
    bake.overrides["EfaInstallerSha256"] = versions.EFA_INSTALLER_SHA256
    bake.run_phase(component("gpu", "turnkv-base"), "build")
    result = bake.run_phase(component("gpu", "turnkv-efa"), "build", check=False)
    assert result.returncode != 0 and f"expected {versions.EFA_INSTALLER_SHA256}" in result.stderr


def test_efa_pin_is_the_published_installer():
    assert versions.EFA_INSTALLER == "1.50.0" and versions.LIBFABRIC == "2.6.0amzn"
    assert versions.EFA_INSTALLER_SHA256 == "fa6dff8593d866866c13cb4640d9059835cd4efa427971f100ab40c97bef2841"


# --- GPG signatures (real gpg, a throwaway key standing in for AWS's) -------------------------------------------


def _gpg(home, *args, **kw):
    return subprocess.run(["gpg", "--homedir", str(home), "--batch", "--quiet", *args], check=True,
                          capture_output=True, **kw)


@pytest.fixture
def signer(tmp_path):
    """A signing key of our own: (sign(file, as_name), fingerprint, the directory curl serves from)."""
    if not shutil.which("gpg"):
        pytest.skip("gpg is needed for the signature tests")
    home, served = tmp_path / "gnupg", tmp_path / "served"
    home.mkdir(mode=0o700)
    served.mkdir()
    _gpg(home, "--passphrase", "", "--quick-gen-key", "turnkv-test <test@example.invalid>", "ed25519", "sign",
         "never")
    colons = _gpg(home, "--with-colons", "--fingerprint", text=True).stdout
    fingerprint = next(line.split(":")[9] for line in colons.splitlines() if line.startswith("fpr:"))
    (served / "aws-efa-installer.key").write_bytes(_gpg(home, "--armor", "--export", fingerprint).stdout)

    def sign(path, as_name):
        _gpg(home, "--yes", "--detach-sign", "-o", str(served / as_name), str(path))

    yield sign, fingerprint, served
    # Key generation and signing start a gpg-agent for this home: stop it, no process outlives the test.
    subprocess.run(["gpgconf", "--homedir", str(home), "--kill", "all"], check=False, capture_output=True)


def _efa_build(bake):
    bake.run_phase(component("gpu", "turnkv-base"), "build")
    return bake.run_phase(component("gpu", "turnkv-efa"), "build", check=False)


def test_efa_tarball_signature_is_checked_with_the_pinned_key(bake, signer):
    sign, fingerprint, served = signer
    sign(bake.env["FAKE_EFA_TARBALL"], f"aws-efa-installer-{versions.EFA_INSTALLER}.tar.gz.sig")
    bake.env["FAKE_SIGNING_DIR"] = str(served)
    bake.overrides["EfaGpgFingerprint"] = fingerprint
    result = _efa_build(bake)
    assert result.returncode == 0, result.stderr
    assert f"GPG signature ok: aws-efa-installer-{versions.EFA_INSTALLER}.tar.gz (key {fingerprint})" in result.stderr
    calls = bake.calls()
    assert positions(calls, "sha256sum", "curl -fsSL --retry 2 -o", "efa_installer.sh -y")


def test_a_bad_efa_signature_is_a_hard_failure(bake, signer, tmp_path):
    sign, fingerprint, served = signer
    other = tmp_path / "other.tar.gz"
    other.write_bytes(b"not the installer")
    sign(other, f"aws-efa-installer-{versions.EFA_INSTALLER}.tar.gz.sig")
    bake.env["FAKE_SIGNING_DIR"] = str(served)
    bake.overrides["EfaGpgFingerprint"] = fingerprint
    result = _efa_build(bake)
    assert result.returncode != 0
    assert f"bad GPG signature on aws-efa-installer-{versions.EFA_INSTALLER}.tar.gz" in result.stderr
    assert not any(c.startswith("efa_installer") for c in bake.calls())


def test_a_key_other_than_the_pinned_one_is_a_hard_failure(bake, signer):
    sign, fingerprint, served = signer
    sign(bake.env["FAKE_EFA_TARBALL"], f"aws-efa-installer-{versions.EFA_INSTALLER}.tar.gz.sig")
    bake.env["FAKE_SIGNING_DIR"] = str(served)  # the pinned fingerprint stays AWS's
    result = _efa_build(bake)
    assert result.returncode != 0
    assert f"has fingerprint {fingerprint}, not the pinned {versions.EFA_GPG_FINGERPRINT}" in result.stderr
    assert not any(c.startswith("efa_installer") for c in bake.calls())


def test_an_unreachable_key_falls_back_to_the_pinned_checksum(bake):
    result = _efa_build(bake)
    assert result.returncode == 0, result.stderr
    assert "rests on its pinned SHA-256" in result.stderr
    assert any(c.startswith("efa_installer.sh -y") for c in bake.calls())


# --- an EFA installation the base image already has -----------------------------------------------------------


def _base_image_efa(bake, version: str, libfabric: str, device: bool) -> None:
    """Lay the base image's own EFA installation (the fake installer's output) on the root."""
    script = bake.root.parent / "base-efa.sh"
    script.write_text(stubs.EFA_INSTALLER.replace("@VERSION@", version).replace("@LIBFABRIC@", libfabric))
    subprocess.run(["bash", str(script)], env=bake.env, check=True)
    bake.env["FAKE_EFA_DEVICE"] = "1" if device else "0"
    bake.log.write_text("")


def _newer(version: str) -> str:
    major, minor, patch = (int(x) for x in version.split("."))
    return f"{major}.{minor + 1}.{patch}"


@pytest.mark.parametrize("device", [True, False])
def test_a_newer_efa_in_the_base_image_is_kept_with_or_without_a_device(bake, device):
    """The build instance has no EFA interfaces: `fi_info -p efa` fails there, and must not trigger a reinstall
    (a downgrade, once the base image ships a newer EFA). The installer's recorded version decides."""
    _base_image_efa(bake, _newer(versions.EFA_INSTALLER), "9.9.0amzn", device=device)
    result = _efa_build(bake)
    assert result.returncode == 0, result.stderr
    assert "or newer): keeping it" in result.stderr
    assert not any(c.startswith(("curl", "efa_installer", "tar", "fi_info -p")) for c in bake.calls())
    assert bake.run_script("10-efa.sh", "--verify", env=_efa_env(bake)).returncode == 0


def test_the_base_image_efa_is_reinstalled_when_older(bake):
    major, minor, patch = (int(x) for x in versions.EFA_INSTALLER.split("."))
    older = f"{major - 1}.{minor}.{patch}" if major else f"{major}.{minor}.{max(patch - 1, 0)}"
    _base_image_efa(bake, older, "1.0.0amzn", device=True)
    assert _efa_build(bake).returncode == 0
    assert any(c.startswith("efa_installer.sh -y") for c in bake.calls())


def _efa_env(bake):
    efa = component("gpu", "turnkv-efa")
    params = bake.parameters(efa)
    return {recipes.ENV_NAMES[k]: v for k, v in params.items() if k in recipes.ENV_NAMES}


def test_cloudwatch_agent_checksum_mismatch_is_a_hard_failure(bake):
    bake.overrides["CloudWatchAgentSha256"] = "0" * 64
    bake.run_phase(component("gpu", "turnkv-base"), "build")
    result = bake.run_phase(component("gpu", "turnkv-cloudwatch-agent"), "build", check=False)
    assert result.returncode != 0
    assert f"checksum mismatch for the CloudWatch agent {versions.CLOUDWATCH_AGENT}" in result.stderr
    assert not any(c.startswith("dpkg --root") for c in bake.calls())


def run_installed_efa_wait(bake, env):
    """The copy the image runs before every engine start (ExecStartPre=/opt/turnkv/bin/turnkv-efa-wait)."""
    import subprocess

    return subprocess.run([str(bake.root / "opt/turnkv/bin/turnkv-efa-wait")], env={**bake.env, **env},
                          capture_output=True, text=True, timeout=60)


def test_missing_efa_device_is_a_hard_failure(bake):
    bake.bake("gpu")
    result = run_installed_efa_wait(bake, {"FAKE_EFA_DEVICE": "0", "TURNKV_EFA_WAIT_SECONDS": "10",
                                           "TURNKV_EFA_WAIT_INTERVAL": "5"})
    assert result.returncode == 1
    assert "ERROR: no EFA device visible to libfabric after 10s" in result.stderr
    assert "fi_getinfo: -61 (No data available)" in result.stderr
    calls = bake.calls()
    assert sum(c == "fi_info -p efa" for c in calls) == 3 and sum(c == "sleep 5" for c in calls) == 2


def test_late_efa_device_is_waited_for(bake):
    bake.bake("gpu")
    result = run_installed_efa_wait(bake, {"FAKE_EFA_DEVICE_AFTER": "3", "TURNKV_EFA_WAIT_SECONDS": "60"})
    assert result.returncode == 0, result.stderr
    assert "EFA visible to libfabric (attempt 3)" in result.stderr


def test_efa_wait_can_be_turned_off_for_nodes_without_efa(bake):
    bake.bake("gpu")
    result = run_installed_efa_wait(bake, {"FAKE_EFA_DEVICE": "0", "TURNKV_EFA_REQUIRED": "false"})
    assert result.returncode == 0 and "not waiting for EFA" in result.stderr
    assert not any(c.startswith("fi_info -p") for c in bake.calls())


def test_efa_step_requires_a_device_when_asked(bake):
    bake.run_phase(component("gpu", "turnkv-base"), "build")
    result = bake.run_phase(component("gpu", "turnkv-efa"), "build", check=False,
                            extra_env={"TURNKV_REQUIRE_EFA_DEVICE": "true", "FAKE_EFA_DEVICE": "0",
                                       "TURNKV_EFA_WAIT_SECONDS": "0"})
    assert result.returncode != 0 and "no EFA device visible to libfabric" in result.stderr


def test_nixl_is_built_from_source_when_the_wheel_bundles_its_own_libfabric(bake):
    bake.env["FAKE_NIXL_WHEEL_PLUGIN"] = "bundled"
    bake.bake("gpu")
    calls = bake.calls()
    order = positions(calls, f"git clone --depth 1 --branch {versions.NIXL_GIT_TAG}",
                      "meson setup", "ninja -C")
    assert order == sorted(set(order))
    meson = next(c for c in calls if c.startswith("meson setup"))
    assert f"-Dlibfabric_path={versions.EFA_PREFIX}" in meson
    assert "NIXL_PLUGIN_DIR=/opt/turnkv/nixl/lib/x86_64-linux-gnu/plugins\n" in (
        bake.root / "etc/turnkv/nixl.env").read_text()
    before = bake.manifest()
    bake.bake("gpu")
    assert bake.manifest() == before


def test_nixl_plugin_linking_a_distro_libfabric_is_a_hard_failure(bake):
    bake.env["FAKE_NIXL_WHEEL_PLUGIN"] = "none"
    bake.env["FAKE_NIXL_BUILT_PLUGIN"] = "distro"
    for name in ("turnkv-base", "turnkv-efa"):
        bake.run_phase(component("gpu", name), "build")
    result = bake.run_phase(component("gpu", "turnkv-nixl"), "build", check=False)
    assert result.returncode != 0
    assert "resolves libfabric elsewhere: \tlibfabric.so.1 => /usr/lib/x86_64-linux-gnu/libfabric.so.1" in result.stderr
    assert (f"ERROR: the NIXL LIBFABRIC plugin built from source does not link "
            f"{versions.EFA_PREFIX}/lib/libfabric.so.1") in result.stderr
    assert not (bake.root / "etc/turnkv/nixl.env").exists()


def test_a_distro_fi_info_shadowing_efa_is_caught(bake):
    for name in ("turnkv-base", "turnkv-efa"):
        bake.run_phase(component("gpu", name), "build")
    (bake.root / "opt/amazon/efa/bin/fi_info").unlink()
    distro = bake.stub_dir / "fi_info"
    distro.write_text("#!/usr/bin/env bash\necho 'libfabric: 1.18.2'\n")
    distro.chmod(0o755)
    result = bake.run_phase(component("gpu", "turnkv-efa"), "validate", check=False)
    assert result.returncode != 0 and "a distro libfabric shadows EFA's" in result.stderr


def test_missing_variables_are_named(bake):
    result = bake.run_script("10-efa.sh", env={"TURNKV_EFA_INSTALLER_VERSION": versions.EFA_INSTALLER})
    assert result.returncode == 1
    assert ("missing required variable(s): TURNKV_EFA_INSTALLER_SHA256 TURNKV_LIBFABRIC_VERSION "
            "TURNKV_EFA_PREFIX") in result.stderr


def test_a_new_wheel_of_the_same_version_is_installed_over_the_old(bake):
    bake.bake("gpu")
    first = len(bake.calls())
    bake.assets = lambda: {"ScriptsS3Uri": "s3://assets-bucket/scripts.zip",
                           "TurnkvWheelS3Uri": f"s3://assets-bucket/wheels/d1g35t/turnkv-{versions.TURNKV}-py3-none-any.whl"}
    bake.bake("gpu")
    again = [c for c in bake.calls()[first:] if c.startswith(("aws s3", "pip install"))]
    assert again[0].startswith("aws s3 cp --only-show-errors s3://assets-bucket/wheels/d1g35t/")
    assert again[2].startswith("pip install --no-cache-dir --no-deps --force-reinstall") and len(again) == 3


def test_wheel_of_another_version_is_refused(bake):
    result = bake.run_script("40-connector.sh", env={"TURNKV_WHEEL_S3_URI": "s3://b/turnkv-9.9.9-py3-none-any.whl",
                                                     "TURNKV_VERSION": versions.TURNKV, "TURNKV_FLAVOR": "gpu"})
    assert result.returncode == 1 and "is not turnkv " + versions.TURNKV in result.stderr


def test_build_sh_runs_every_step_with_pins_from_recipes(bake):
    env = {k: v for k, v in recipes.step_env("gpu").items()}
    env.update(TURNKV_EFA_INSTALLER_SHA256=bake.efa_sha256,
               TURNKV_CLOUDWATCH_AGENT_SHA256=hashlib.sha256(
                   stubs.fake_cloudwatch_deb(versions.CLOUDWATCH_AGENT)).hexdigest(),
               TURNKV_WHEEL_S3_URI=f"s3://b/turnkv-{versions.TURNKV}-py3-none-any.whl")
    result = bake.run_script("build.sh", "gpu", env=env)
    assert result.returncode == 0, result.stderr
    assert "all 6 steps done for gpu" in result.stderr
    verify = bake.run_script("build.sh", "gpu", "--verify", env=env)
    assert verify.returncode == 0, verify.stderr
