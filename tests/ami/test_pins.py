"""Pinned versions agree across the AMI (component parameters), the package and the infra code.

turnkv/versions.py is the one place a version is written down. The AMI gets it through ami/recipes.py
(component parameters), the package through requirements/*.txt (generated) and pyproject, the infra by
importing turnkv.versions / ami.recipes. These tests fail when a version is typed anywhere else.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import yaml

from ami import recipes
from turnkv import versions

REPO = Path(__file__).resolve().parents[2]
PINS = versions.as_dict()
#: Pin values that look like versions (a bare "580" or "13.0" would match too much unrelated text).
VERSION_LIKE = {name: value for name, value in PINS.items()
                if isinstance(value, str) and (re.fullmatch(r"v?\d+\.\d+\.\d+\S*", value) or "amzn" in value)}
DESCRIBED = re.compile(r"\(turnkv\.versions\.(\w+)\)")


def test_there_are_pins_to_check():
    assert {"EFA_INSTALLER", "NIXL", "VLLM_GPU", "LIBFABRIC", "VLLM_NEURON", "CLOUDWATCH_AGENT",
            "TURNKV"} <= set(VERSION_LIKE)


@pytest.mark.parametrize("flavor", sorted(recipes.IMAGES))
def test_component_parameters_are_the_pins_their_documents_name(flavor):
    checked = 0
    for component in recipes.IMAGES[flavor].components:
        doc = yaml.safe_load(component.path.read_text())
        for entry in doc.get("parameters", []):
            ((name, spec),) = entry.items()
            match = DESCRIBED.search(spec["description"])
            if match is None:
                assert name in recipes.ASSET_PARAMETERS or name == "Flavor", f"{component.name}.{name} names no pin"
                continue
            assert component.parameters[name] == getattr(versions, match.group(1)), f"{component.name}.{name}"
            checked += 1
    assert checked >= (9 if flavor == "gpu" else 6)


def test_recipes_take_every_value_from_turnkv_versions():
    source = (REPO / "ami/recipes.py").read_text()
    for name, value in VERSION_LIKE.items():
        assert f'"{value}"' not in source, f"ami/recipes.py types {name}'s value; use versions.{name}"
    values = {str(v) for v in PINS.values()}
    for spec in recipes.IMAGES.values():
        for component in spec.components:
            for name, value in component.parameters.items():
                assert name == "Flavor" or value in values, f"{component.name}.{name}={value} is not a pin"


def _files(*patterns: str) -> list[Path]:
    out = []
    for pattern in patterns:
        out += [p for p in REPO.glob(pattern) if ".venv" not in p.parts and "cdk.out" not in p.parts]
    return sorted(set(out))


def test_no_script_or_document_hard_codes_a_version():
    files = _files("ami/scripts/**/*", "ami/components/*.yml")
    assert len(files) > 15
    for path in files:
        if path.is_dir():
            continue
        text = path.read_text()
        for name, value in VERSION_LIKE.items():
            assert not re.search(rf"(?<![\w.]){re.escape(value)}(?![\w.])", text), f"{path} hard-codes {name}"


def test_no_python_module_outside_versions_types_a_pin():
    """Package and infra code (and the connector, router, bench) import pins; they never retype them."""
    files = [p for p in _files("turnkv/**/*.py", "infra/**/*.py", "connector/**/*.py", "router/**/*.py",
                               "bench/**/*.py", "ami/**/*.py") if p.name != "versions.py"]
    assert files
    for path in files:
        text = path.read_text()
        for name, value in VERSION_LIKE.items():
            assert f'"{value}"' not in text and f"'{value}'" not in text, f"{path} types {name}={value}"


def test_package_metadata_agrees():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pyproject["project"]["version"] == versions.TURNKV
    for extra in versions.REQUIREMENTS:
        text = (REPO / "requirements" / f"{extra}.txt").read_text()
        assert text.endswith(versions.requirement_text(extra)), "regenerate: python -m turnkv.versions --write"
    assert f"vllm=={versions.VLLM_GPU}\n" in (REPO / "requirements/engines-gpu.txt").read_text()
    dev = (REPO / "requirements/dev.txt").read_text()
    for line in dev.splitlines():
        if line.startswith("moto"):
            assert line.endswith(f"=={versions.MOTO}")


def test_pins_are_printable_for_shell_and_cdk():
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "turnkv.versions", "--json"], capture_output=True, text=True,
                         cwd=REPO, check=True).stdout
    pins = json.loads(out)
    for name in ("EFA_INSTALLER", "EFA_INSTALLER_SHA256", "CLOUDWATCH_AGENT", "VLLM_NEURON", "NIXL_GIT_TAG"):
        assert pins[name] == getattr(versions, name)
