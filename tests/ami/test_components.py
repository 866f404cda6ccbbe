"""Structure of the Image Builder component documents and their link to recipes.py and the scripts."""

from __future__ import annotations

import re

import pytest
import yaml

from ami import recipes
from turnkv import versions

DOCS = sorted(recipes.COMPONENTS_DIR.glob("*.yml"))
ALL_COMPONENTS = {c.name: c for spec in recipes.IMAGES.values() for c in spec.components}

#: Actions of the Image Builder component manager (AWSTOE) for Linux.
VALID_ACTIONS = {
    "ExecuteBash", "ExecuteBinary", "ExecuteDocument", "Reboot", "S3Download", "S3Upload", "WebDownload",
    "CreateFile", "DeleteFile", "CopyFile", "CreateFolder", "DeleteFolder", "CopyFolder", "MoveFile",
    "MoveFolder", "ReadFile", "ListFiles", "SetFileOwner", "SetFolderOwner", "SetFilePermissions",
    "SetFolderPermissions", "Assert", "UpdateOS",
}
PHASES = ("build", "validate", "test")
STEP_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9]{0,127}$")
SCRIPT_REF = re.compile(r"/var/tmp/turnkv-ami/scripts/([\w.-]+\.sh)")
PARAM_REF = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def load(path):
    return yaml.safe_load(path.read_text())


def test_every_recipe_component_has_a_document_and_every_document_is_used():
    assert {p.stem for p in DOCS} == set(ALL_COMPONENTS)
    for component in ALL_COMPONENTS.values():
        assert component.path.is_absolute() and component.path.is_file()


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.stem)
def test_document_shape(path):
    doc = load(path)
    assert doc["name"] == path.stem
    assert doc["schemaVersion"] == 1.0
    assert isinstance(doc["description"], str) and doc["description"]
    names = [phase["name"] for phase in doc["phases"]]
    assert names == [p for p in PHASES if p in names], "phases in Image Builder order, no duplicates"
    assert "validate" in names and "test" in names, "every component checks what it built"
    for phase in doc["phases"]:
        step_names = [step["name"] for step in phase["steps"]]
        assert len(step_names) == len(set(step_names)), f"duplicate step names in {phase['name']}"
        for step in phase["steps"]:
            assert STEP_NAME.match(step["name"]), step["name"]
            assert step["action"] in VALID_ACTIONS, step["action"]
            assert step.get("onFailure", "Abort") in {"Abort", "Continue", "Ignore"}
            inputs = step["inputs"]
            if step["action"] == "ExecuteBash":
                assert isinstance(inputs["commands"], list) and all(isinstance(c, str) for c in inputs["commands"])
                body = "\n".join(inputs["commands"])
                assert body.lstrip().startswith("set -euo pipefail"), "commands fail on the first error"
            elif step["action"] == "S3Download":
                assert isinstance(inputs, list) and inputs
                for item in inputs:
                    assert item["source"].startswith(("s3://", "{{")) and item["destination"].startswith("/")
            elif step["action"] == "Reboot":
                assert isinstance(inputs.get("delaySeconds", 0), int)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.stem)
def test_parameters_declared_are_used_and_used_are_declared(path):
    doc = load(path)
    declared = []
    for entry in doc.get("parameters", []):
        ((name, spec),) = entry.items()
        assert spec["type"] == "string" and spec["description"]
        assert "default" not in spec, "no defaults: every value comes from ami/recipes.py (turnkv/versions.py)"
        declared.append(name)
    used = set(PARAM_REF.findall(yaml.safe_dump(doc["phases"])))
    assert set(declared) == used
    component = ALL_COMPONENTS[path.stem]
    assert set(component.parameters) | set(recipes.asset_parameters(component)) == set(declared)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.stem)
def test_scripts_referenced_exist_and_parameters_reach_them_as_env(path):
    doc = load(path)
    text = yaml.safe_dump(doc["phases"], width=1000)
    for script in SCRIPT_REF.findall(text):
        assert (recipes.SCRIPTS_DIR / script).is_file(), f"{path.name} runs missing script {script}"
    for phase in doc["phases"]:
        for step in phase["steps"]:
            if step["action"] != "ExecuteBash":
                continue
            body = "\n".join(step["inputs"]["commands"])
            for env, param in re.findall(r"export (\w+)='\{\{ (\w+) \}\}'", body):
                assert recipes.ENV_NAMES[param] == env
                script = SCRIPT_REF.search(body)
                assert script, "exports feed a script"
                assert env in (recipes.SCRIPTS_DIR / script.group(1)).read_text(), f"{script.group(1)} ignores {env}"


def test_every_script_is_used():
    texts = [p.read_text() for p in DOCS] + [p.read_text() for p in recipes.SCRIPTS_DIR.glob("*.sh")]
    for script in recipes.SCRIPTS_DIR.glob("*.sh"):
        if script.name in {"build.sh"}:
            continue  # the operator's entry point
        assert any(script.name in t for t in texts), f"{script.name} is never run"
    for extra in (recipes.SCRIPTS_DIR / "files").iterdir():
        templated = re.sub(r"-(gpu|neuron)\.", "-$TURNKV_FLAVOR.", extra.name)
        assert any(extra.name in t or templated in t for t in texts), f"files/{extra.name} is never installed"


def test_doctor_runs_in_validate_and_test():
    doc = load(recipes.component_path("turnkv-doctor"))
    for phase in ("validate", "test"):
        steps = next(p for p in doc["phases"] if p["name"] == phase)["steps"]
        body = "\n".join(c for s in steps for c in s["inputs"]["commands"])
        assert "/opt/turnkv/venv/bin/turnkv doctor --flavor '{{ Flavor }}' --image" in body


def test_order_of_components_matches_build_sh_steps():
    lib = (recipes.SCRIPTS_DIR / "lib.sh").read_text()
    for flavor, names in recipes.ORDER.items():
        steps = re.search(rf"^STEPS_{flavor}=\(([^)]*)\)", lib, re.M).group(1).split()
        scripts = []
        for name in names:
            refs = SCRIPT_REF.findall(recipes.component_path(name).read_text())
            scripts += sorted({r.removesuffix(".sh") for r in refs})
        assert scripts == steps, flavor
        assert [c.name for c in recipes.IMAGES[flavor].components] == list(names)


def test_images():
    gpu, neuron = recipes.IMAGES["gpu"], recipes.IMAGES["neuron"]
    assert gpu.parent_image_ssm_parameter == (
        "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-24.04/latest/ami-id")
    assert neuron.parent_image_ssm_parameter == (
        f"/aws/service/neuron/dlami/pytorch-inference-vllm-{versions.VLLM_NEURON}/ubuntu-24.04/latest/image_id")
    assert "turnkv-nixl" in [c.name for c in gpu.components] and "turnkv-vllm-gpu" in [c.name for c in gpu.components]
    assert "turnkv-vllm-neuron" in [c.name for c in neuron.components]
    for spec in (gpu, neuron):
        assert spec.components[-1].name == "turnkv-doctor" and spec.volume_size_gib >= 100
        with pytest.raises(AttributeError):
            spec.flavor = "x"  # frozen


def test_deploy_parameters_require_the_asset_urls():
    connector = next(c for c in recipes.IMAGES["gpu"].components if c.name == "turnkv-connector")
    with pytest.raises(KeyError, match="TurnkvWheelS3Uri"):
        recipes.deploy_parameters(connector, {"ScriptsS3Uri": "s3://b/s.zip"})
    full = recipes.deploy_parameters(connector, {"ScriptsS3Uri": "s3://b/s.zip", "TurnkvWheelS3Uri": "s3://b/w.whl"})
    assert full["TurnkvVersion"] == recipes.versions.TURNKV and full["TurnkvWheelS3Uri"] == "s3://b/w.whl"


def test_lock_is_fresh():
    """Component versions change whenever a document or its scripts do (Image Builder versions are immutable)."""
    current = recipes._lock()
    assert current == recipes.fresh_lock(current), "run: python -m ami.recipes --lock (and commit the lock)"


def test_lock_bumps_a_changed_component():
    current = recipes._lock()
    stale = {name: {**entry, "sha256": "0" * 64} if name == "turnkv-efa" else entry for name, entry in current.items()}
    fresh = recipes.fresh_lock(stale)
    major, minor, patch = map(int, current["turnkv-efa"]["version"].split("."))
    assert fresh["turnkv-efa"]["version"] == f"{major}.{minor}.{patch + 1}"
    assert fresh["turnkv-nixl"] == current["turnkv-nixl"]


def test_recipe_fingerprint_moves_with_assets():
    a = recipes.recipe_fingerprint("gpu", {"ScriptsS3Uri": "s3://b/1.zip"})
    b = recipes.recipe_fingerprint("gpu", {"ScriptsS3Uri": "s3://b/2.zip"})
    assert a != b and len(a) == 12 and a == recipes.recipe_fingerprint("gpu", {"ScriptsS3Uri": "s3://b/1.zip"})
    assert recipes.recipe_fingerprint("gpu") != recipes.recipe_fingerprint("neuron")
