"""The GPU and Neuron image recipes: which Image Builder components, in which order, with which parameters.

This is the interface the CDK image stack codes against. Pure data, no I/O at import (stdlib only):

- ``IMAGES["gpu"]`` / ``IMAGES["neuron"]``: an ``ImageSpec`` per flavor (parent image SSM parameter, ordered
  components, build instance type, root volume size).
- ``ComponentSpec.path``: the absolute path of the component document (YAML, schemaVersion 1.0); give its text
  to ``CfnComponent(data=...)``. ``ComponentSpec.version`` is the semantic version Image Builder needs
  (components are immutable per version: ``ami/components.lock.json`` bumps it whenever the document, its
  scripts or its parameters change, and a test keeps that lock fresh).
- ``ComponentSpec.parameters``: the pinned values, all taken from ``turnkv.versions``; pass them as the recipe's
  component parameters. Two more parameters are known only at deploy time (``ASSET_PARAMETERS``): every
  component takes ``ScriptsS3Uri`` (the ``s3://`` URL of a zip of ``SCRIPTS_DIR``, e.g. the ``s3_object_url``
  of ``aws_s3_assets.Asset(path=str(SCRIPTS_DIR))``) and the connector component takes ``TurnkvWheelS3Uri``
  (the turnkv wheel built from this repo). ``deploy_parameters()`` merges and checks them.
- ``recipe_version(flavor)``: a semantic version for the image recipe that changes whenever a component
  version or a parameter does.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from turnkv import versions

AMI_DIR = Path(__file__).resolve().parent
COMPONENTS_DIR = AMI_DIR / "components"
#: Upload this folder as one zip asset; its URL is the ``ScriptsS3Uri`` parameter of every component.
SCRIPTS_DIR = AMI_DIR / "scripts"
LOCK_FILE = AMI_DIR / "components.lock.json"

GPU_PARENT_SSM = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-24.04/latest/ami-id"
NEURON_PARENT_SSM = "/aws/service/neuron/dlami/multi-framework/ubuntu-24.04/latest/image_id"

#: Deploy-time parameters (not pins): name -> what the image stack must pass.
ASSET_PARAMETERS: dict[str, str] = {
    "ScriptsS3Uri": "s3:// URL of a zip of ami/scripts (the component scripts, systemd units, env templates)",
    "TurnkvWheelS3Uri": "s3:// URL of the turnkv wheel built from this repo (pip wheel --no-deps .)",
}
#: Which components take the wheel parameter (every component takes ScriptsS3Uri).
_WHEEL_COMPONENTS = frozenset({"turnkv-connector"})


@dataclass(frozen=True)
class ComponentSpec:
    name: str
    path: Path
    version: str
    parameters: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ImageSpec:
    flavor: str
    parent_image_ssm_parameter: str
    components: tuple[ComponentSpec, ...]
    build_instance_type: str
    volume_size_gib: int


def _pins(flavor: str) -> dict[str, dict[str, str]]:
    """Component name -> pinned parameters (every value comes from turnkv.versions)."""
    return {
        "turnkv-base": {"Flavor": flavor},
        "turnkv-efa": {
            "EfaInstallerVersion": versions.EFA_INSTALLER,
            "EfaInstallerSha256": versions.EFA_INSTALLER_SHA256,
            "LibfabricVersion": versions.LIBFABRIC,
            "EfaPrefix": versions.EFA_PREFIX,
        },
        "turnkv-nixl": {
            "NixlVersion": versions.NIXL,
            "NixlCudaPackage": versions.NIXL_CUDA_PACKAGE,
            "NixlGitTag": versions.NIXL_GIT_TAG,
            "EfaPrefix": versions.EFA_PREFIX,
        },
        "turnkv-vllm-gpu": {"VllmVersion": versions.VLLM_GPU},
        "turnkv-vllm-neuron": {"VllmNeuronVersion": versions.VLLM_NEURON},
        "turnkv-connector": {"TurnkvVersion": versions.TURNKV, "Flavor": flavor},
        "turnkv-cloudwatch-agent": {"CloudWatchAgentVersion": versions.CLOUDWATCH_AGENT},
        "turnkv-doctor": {"Flavor": flavor},
    }


#: Component order per flavor (the bake runs them in this order; ami/scripts/lib.sh lists the same steps).
ORDER: dict[str, tuple[str, ...]] = {
    "gpu": ("turnkv-base", "turnkv-efa", "turnkv-nixl", "turnkv-vllm-gpu", "turnkv-connector",
            "turnkv-cloudwatch-agent", "turnkv-doctor"),
    "neuron": ("turnkv-base", "turnkv-efa", "turnkv-vllm-neuron", "turnkv-connector",
               "turnkv-cloudwatch-agent", "turnkv-doctor"),
}

_BUILD = {
    # Image Builder builds on an instance without EFA interfaces; any NVIDIA GPU lets doctor check driver/CUDA.
    "gpu": ("g6.2xlarge", 200, GPU_PARENT_SSM),
    "neuron": ("trn1.2xlarge", 200, NEURON_PARENT_SSM),
}


def _lock() -> dict[str, dict[str, str]]:
    try:
        return json.loads(LOCK_FILE.read_text())
    except FileNotFoundError:
        return {}


def component_path(name: str) -> Path:
    return COMPONENTS_DIR / f"{name}.yml"


def _component(name: str, flavor: str, lock: Mapping[str, Mapping[str, str]]) -> ComponentSpec:
    key = f"{name}@{flavor}" if name in _FLAVORED else name
    return ComponentSpec(name=name, path=component_path(name), version=lock.get(key, {}).get("version", "1.0.0"),
                         parameters=dict(_pins(flavor)[name]))


#: Components whose pinned parameters differ per flavor (one lock entry each).
_FLAVORED = frozenset({"turnkv-base", "turnkv-connector", "turnkv-doctor"})


def build_images() -> dict[str, ImageSpec]:
    lock = _lock()
    images = {}
    for flavor, names in ORDER.items():
        instance_type, volume, parent = _BUILD[flavor]
        images[flavor] = ImageSpec(
            flavor=flavor, parent_image_ssm_parameter=parent,
            components=tuple(_component(name, flavor, lock) for name in names),
            build_instance_type=instance_type, volume_size_gib=volume)
    return images


IMAGES: dict[str, ImageSpec] = build_images()


def asset_parameters(component: ComponentSpec) -> tuple[str, ...]:
    """Deploy-time parameter names this component declares (beyond its pins)."""
    return ("ScriptsS3Uri", "TurnkvWheelS3Uri") if component.name in _WHEEL_COMPONENTS else ("ScriptsS3Uri",)


def deploy_parameters(component: ComponentSpec, assets: Mapping[str, str]) -> dict[str, str]:
    """The component's full parameter set: its pins plus the asset URLs it needs (KeyError names a missing one)."""
    out = dict(component.parameters)
    for name in asset_parameters(component):
        value = assets.get(name)
        if not value:
            raise KeyError(f"{component.name}: deploy-time parameter {name} is missing ({ASSET_PARAMETERS[name]})")
        out[name] = value
    return out


# --- content hashes and versions -----------------------------------------------------------------------------


def referenced_scripts(text: str) -> list[str]:
    """Script paths (relative to SCRIPTS_DIR) a component document runs: every ``scripts/<name>`` token."""
    import re

    return sorted(set(re.findall(r"scripts/([A-Za-z0-9_.\-/]+\.(?:sh|service|timer|env|json|template))", text)))


def content_hash(component: ComponentSpec) -> str:
    """Hash of the document, the scripts it references, the shared library and its pinned parameters."""
    digest = hashlib.sha256()
    text = component.path.read_text()
    digest.update(text.encode())
    paths = {SCRIPTS_DIR / rel for rel in referenced_scripts(text)} | {SCRIPTS_DIR / "lib.sh"}
    paths |= set((SCRIPTS_DIR / "files").glob("*")) if (SCRIPTS_DIR / "files").is_dir() else set()
    for path in sorted(paths):
        digest.update(path.relative_to(SCRIPTS_DIR).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() if path.is_file() else b"<missing>")
    digest.update(json.dumps(component.parameters, sort_keys=True).encode())
    return digest.hexdigest()


def _bump(version: str) -> str:
    major, minor, patch = (int(part) for part in version.split("."))
    return f"{major}.{minor}.{patch + 1}"


def fresh_lock(current: Mapping[str, Mapping[str, str]] | None = None) -> dict[str, dict[str, str]]:
    """The lock as it should be: unchanged entries kept, changed ones bumped one patch version."""
    current = _lock() if current is None else current
    out: dict[str, dict[str, str]] = {}
    for flavor, names in ORDER.items():
        for name in names:
            key = f"{name}@{flavor}" if name in _FLAVORED else name
            spec = _component(name, flavor, current)
            sha = content_hash(spec)
            old = current.get(key)
            if old and old.get("sha256") == sha:
                out[key] = dict(old)
            else:
                out[key] = {"version": _bump(old["version"]) if old else "1.0.0", "sha256": sha}
    return out


def recipe_version(flavor: str, lock: Mapping[str, Mapping[str, str]] | None = None) -> str:
    """A recipe version that moves with the lock: 1.0.<sum of component patch levels>."""
    lock = _lock() if lock is None else lock
    total = 0
    for name in ORDER[flavor]:
        key = f"{name}@{flavor}" if name in _FLAVORED else name
        major, minor, patch = (int(p) for p in lock.get(key, {}).get("version", "1.0.0").split("."))
        total += patch + 1000 * minor + 1_000_000 * (major - 1)
    return f"1.0.{total}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ami.recipes", description="Show or refresh the AMI recipes.")
    parser.add_argument("--lock", action="store_true", help="rewrite ami/components.lock.json (bumps changed ones)")
    args = parser.parse_args(argv)
    if args.lock:
        LOCK_FILE.write_text(json.dumps(fresh_lock(), indent=2, sort_keys=True) + "\n")
        print(LOCK_FILE)
        return 0
    out = {
        flavor: {
            "parent_image_ssm_parameter": spec.parent_image_ssm_parameter,
            "build_instance_type": spec.build_instance_type,
            "volume_size_gib": spec.volume_size_gib,
            "recipe_version": recipe_version(flavor),
            "components": [{"name": c.name, "path": str(c.path), "version": c.version, "parameters": c.parameters,
                            "asset_parameters": list(asset_parameters(c))} for c in spec.components],
        }
        for flavor, spec in IMAGES.items()
    }
    json.dump(out, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
