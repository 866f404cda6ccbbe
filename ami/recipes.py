"""The GPU and Neuron image recipes: which Image Builder components, in which order, with which parameters.

This is the interface the CDK image stack codes against. Stdlib only; the one read at import is
``ami/components.lock.json`` (the component versions):

- ``IMAGES["gpu"]`` / ``IMAGES["neuron"]``: an ``ImageSpec`` per flavor (parent image SSM parameter, ordered
  components, build instance type, root volume size).
- ``ComponentSpec.path``: the absolute path of the component document (YAML, schemaVersion 1.0); give its text
  to ``CfnComponent(data=...)``. ``ComponentSpec.version`` is the semantic version Image Builder needs
  (components are immutable per version: ``python -m ami.recipes --lock`` bumps it whenever the document or
  the scripts it runs change, and a test keeps that lock fresh). One version serves both flavors.
- ``ComponentSpec.parameters``: the pinned values, all taken from ``turnkv.versions``; pass them as the recipe's
  component parameters. Two more parameters are known only at deploy time (``ASSET_PARAMETERS``): every
  component takes ``ScriptsS3Uri`` (the ``s3://`` URL of a zip of ``SCRIPTS_DIR``, e.g. the ``s3_object_url``
  of ``aws_s3_assets.Asset(path=str(SCRIPTS_DIR))``) and the connector component takes ``TurnkvWheelS3Uri``
  (the turnkv wheel built from this repo); ``turnkv-doctor`` takes neither. ``deploy_parameters()`` merges
  and checks them.
- ``recipe_fingerprint(flavor, assets)``: a short hash of everything in a recipe (parent, component versions,
  pins, asset URLs). Image Builder recipes are immutable per name and version: put the fingerprint in the
  recipe name (version "1.0.0") so any change makes a new recipe instead of a failed update.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from turnkv import neuron, versions

AMI_DIR = Path(__file__).resolve().parent
COMPONENTS_DIR = AMI_DIR / "components"
#: Upload this folder as one zip asset; its URL is the ``ScriptsS3Uri`` parameter of every component.
SCRIPTS_DIR = AMI_DIR / "scripts"
LOCK_FILE = AMI_DIR / "components.lock.json"

GPU_PARENT_SSM = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-24.04/latest/ami-id"
#: The single-framework vLLM DLAMI of the pinned plugin (turnkv.neuron.dlami_parent_parameter): its image moves only
#: within that plugin release, never to another Neuron SDK, unlike the multi-framework DLAMI's ``latest``.
NEURON_PARENT_SSM = neuron.dlami_parent_parameter(versions.VLLM_NEURON)

#: Deploy-time parameters (not pins): name -> what the image stack must pass.
ASSET_PARAMETERS: dict[str, str] = {
    "ScriptsS3Uri": "s3:// URL of a zip of ami/scripts (the component scripts, systemd units, env templates)",
    "TurnkvWheelS3Uri": "s3:// URL of the turnkv wheel built from this repo (pip wheel --no-deps .)",
}
#: Which components take the wheel parameter; every component but turnkv-doctor takes ScriptsS3Uri.
_WHEEL_COMPONENTS = frozenset({"turnkv-connector"})
_NO_SCRIPTS_COMPONENTS = frozenset({"turnkv-doctor"})

#: Component parameter -> the environment variable its script reads (the documents export them so).
ENV_NAMES: dict[str, str] = {
    "Flavor": "TURNKV_FLAVOR",
    "EfaInstallerVersion": "TURNKV_EFA_INSTALLER_VERSION",
    "EfaInstallerSha256": "TURNKV_EFA_INSTALLER_SHA256",
    "LibfabricVersion": "TURNKV_LIBFABRIC_VERSION",
    "EfaPrefix": "TURNKV_EFA_PREFIX",
    "EfaGpgFingerprint": "TURNKV_EFA_GPG_FINGERPRINT",
    "NixlVersion": "TURNKV_NIXL_VERSION",
    "NixlCudaPackage": "TURNKV_NIXL_CUDA_PACKAGE",
    "NixlGitTag": "TURNKV_NIXL_GIT_TAG",
    "VllmVersion": "TURNKV_VLLM_VERSION",
    "VllmNeuronVersion": "TURNKV_VLLM_NEURON_VERSION",
    "TurnkvVersion": "TURNKV_VERSION",
    "TurnkvWheelS3Uri": "TURNKV_WHEEL_S3_URI",
    "CloudWatchAgentVersion": "TURNKV_CLOUDWATCH_AGENT_VERSION",
    "CloudWatchAgentSha256": "TURNKV_CLOUDWATCH_AGENT_SHA256",
    "CloudWatchAgentGpgFingerprint": "TURNKV_CLOUDWATCH_AGENT_GPG_FINGERPRINT",
}


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
    #: Image Builder tries these in order when the first has no capacity or quota (G/VT On-Demand for gpu).
    fallback_build_instance_types: tuple[str, ...] = ()

    @property
    def build_instance_types(self) -> tuple[str, ...]:
        return (self.build_instance_type, *self.fallback_build_instance_types)


def _pins(flavor: str) -> dict[str, dict[str, str]]:
    """Component name -> pinned parameters (every value comes from turnkv.versions)."""
    return {
        "turnkv-base": {"Flavor": flavor},
        "turnkv-efa": {
            "EfaInstallerVersion": versions.EFA_INSTALLER,
            "EfaInstallerSha256": versions.EFA_INSTALLER_SHA256,
            "LibfabricVersion": versions.LIBFABRIC,
            "EfaPrefix": versions.EFA_PREFIX,
            "EfaGpgFingerprint": versions.EFA_GPG_FINGERPRINT,
        },
        "turnkv-nixl": {
            "NixlVersion": versions.NIXL,
            "NixlCudaPackage": versions.NIXL_CUDA_PACKAGE,
            "NixlGitTag": versions.NIXL_GIT_TAG,
            "EfaPrefix": versions.EFA_PREFIX,
        },
        "turnkv-vllm-gpu": {"VllmVersion": versions.VLLM_GPU},
        "turnkv-vllm-neuron": {"VllmNeuronVersion": versions.VLLM_NEURON, "VllmVersion": versions.VLLM_NEURON_CORE,
                               "NixlVersion": versions.NIXL},
        "turnkv-connector": {"TurnkvVersion": versions.TURNKV, "Flavor": flavor},
        "turnkv-cloudwatch-agent": {"CloudWatchAgentVersion": versions.CLOUDWATCH_AGENT,
                                    "CloudWatchAgentSha256": versions.CLOUDWATCH_AGENT_SHA256,
                                    "CloudWatchAgentGpgFingerprint": versions.CLOUDWATCH_AGENT_GPG_FINGERPRINT,
                                    "Flavor": flavor},
        "turnkv-doctor": {"Flavor": flavor},
    }


#: Component order per flavor (the bake runs them in this order; ami/scripts/lib.sh lists the same steps).
ORDER: dict[str, tuple[str, ...]] = {
    "gpu": ("turnkv-base", "turnkv-efa", "turnkv-nixl", "turnkv-vllm-gpu", "turnkv-connector",
            "turnkv-cloudwatch-agent", "turnkv-doctor"),
    # NIXL with its LIBFABRIC plugin on EFA, as the Neuron disaggregated-inference tutorial sets it up.
    "neuron": ("turnkv-base", "turnkv-efa", "turnkv-nixl", "turnkv-vllm-neuron", "turnkv-connector",
               "turnkv-cloudwatch-agent", "turnkv-doctor"),
}

_BUILD = {
    # Image Builder builds on an instance without EFA interfaces; any NVIDIA GPU lets doctor check driver/CUDA.
    "gpu": ("g6.2xlarge", 200, GPU_PARENT_SSM),
    # The plugin targets Trainium2 (its DI docs name Trn2 and Trn3): the smallest trn2, with Neuron devices for
    # the image test's neuron-ls, then the one size offered in more regions.
    "neuron": ("trn2.3xlarge", 200, NEURON_PARENT_SSM),
}
#: Fallbacks after the first build type: same family of quota (G/VT for gpu), NVIDIA GPUs the DLAMI drives.
_BUILD_FALLBACKS = {"gpu": ("g6.4xlarge", "g5.2xlarge", "g6e.2xlarge"), "neuron": ("trn2.48xlarge",)}


def _lock() -> dict[str, dict[str, str]]:
    try:
        return json.loads(LOCK_FILE.read_text())
    except FileNotFoundError:
        return {}


def component_path(name: str) -> Path:
    return COMPONENTS_DIR / f"{name}.yml"


def _component(name: str, flavor: str, lock: Mapping[str, Mapping[str, str]]) -> ComponentSpec:
    return ComponentSpec(name=name, path=component_path(name), version=lock.get(name, {}).get("version", "1.0.0"),
                         parameters=dict(_pins(flavor)[name]))


def build_images() -> dict[str, ImageSpec]:
    lock = _lock()
    images = {}
    for flavor, names in ORDER.items():
        instance_type, volume, parent = _BUILD[flavor]
        images[flavor] = ImageSpec(
            flavor=flavor, parent_image_ssm_parameter=parent,
            components=tuple(_component(name, flavor, lock) for name in names),
            build_instance_type=instance_type, volume_size_gib=volume,
            fallback_build_instance_types=_BUILD_FALLBACKS[flavor])
    return images


IMAGES: dict[str, ImageSpec] = build_images()


def asset_parameters(component: ComponentSpec) -> tuple[str, ...]:
    """Deploy-time parameter names this component declares (beyond its pins)."""
    names = () if component.name in _NO_SCRIPTS_COMPONENTS else ("ScriptsS3Uri",)
    return (*names, "TurnkvWheelS3Uri") if component.name in _WHEEL_COMPONENTS else names


def step_env(flavor: str) -> dict[str, str]:
    """Every pinned parameter of a flavor as the environment its scripts read (for ami/scripts/build.sh)."""
    env: dict[str, str] = {}
    for component in IMAGES[flavor].components:
        for name, value in component.parameters.items():
            env[ENV_NAMES[name]] = value
    return env


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
    return sorted(set(re.findall(r"scripts/([A-Za-z0-9_.\-/]+\.(?:sh|service|timer|env|json|template))", text)))


def content_hash(component: ComponentSpec) -> str:
    """Hash of the document, the scripts it references and the shared script files (not the parameters:
    one component version serves both flavors; parameters belong to the recipe)."""
    digest = hashlib.sha256()
    text = component.path.read_text()
    digest.update(text.encode())
    paths = {SCRIPTS_DIR / rel for rel in referenced_scripts(text)} | {SCRIPTS_DIR / "lib.sh"}
    paths |= set((SCRIPTS_DIR / "files").glob("*")) if (SCRIPTS_DIR / "files").is_dir() else set()
    for path in sorted(paths):
        digest.update(path.relative_to(SCRIPTS_DIR).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() if path.is_file() else b"<missing>")
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
            sha = content_hash(_component(name, flavor, current))
            old = current.get(name)
            if old and old.get("sha256") == sha:
                out[name] = dict(old)
            else:
                out[name] = {"version": _bump(old["version"]) if old else "1.0.0", "sha256": sha}
    return out


def recipe_fingerprint(flavor: str, assets: Mapping[str, str] | None = None) -> str:
    """12 hex characters that change whenever anything in the flavor's recipe does (asset URLs included)."""
    spec = IMAGES[flavor]
    payload = {
        "parent": spec.parent_image_ssm_parameter,
        "instance": spec.build_instance_type,
        "volume": spec.volume_size_gib,
        "components": [[c.name, c.version, c.parameters] for c in spec.components],
        "assets": dict(sorted((assets or {}).items())),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ami.recipes", description="Show or refresh the AMI recipes.")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--lock", action="store_true", help="rewrite ami/components.lock.json (bumps changed ones)")
    group.add_argument("--env", choices=sorted(ORDER), help="print the pins as `export` lines for build.sh")
    args = parser.parse_args(argv)
    if args.env:
        import shlex

        for name, value in sorted(step_env(args.env).items()):
            print(f"export {name}={shlex.quote(value)}")
        return 0
    if args.lock:
        LOCK_FILE.write_text(json.dumps(fresh_lock(), indent=2, sort_keys=True) + "\n")
        print(LOCK_FILE)
        return 0
    out = {
        flavor: {
            "parent_image_ssm_parameter": spec.parent_image_ssm_parameter,
            "build_instance_type": spec.build_instance_type,
            "volume_size_gib": spec.volume_size_gib,
            "recipe_fingerprint": recipe_fingerprint(flavor),
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
