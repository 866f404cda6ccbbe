"""A stand-in for ``ami.recipes`` used only while that module is absent from the tree (the infra branch
before the AMI branch is merged). Same shape: ImageSpec/ComponentSpec, deploy_parameters, recipe_fingerprint.
With ``ami/recipes.py`` present, the tests use the real recipes and this file is not read."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

_DOC = """name: {name}
description: 'test stand-in for {name}'
schemaVersion: 1.0
parameters:
  - ScriptsS3Uri:
      type: string
{extra}phases:
  - name: build
    steps:
      - name: Run
        action: ExecuteBash
        inputs:
          commands:
            - echo {name}
"""


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


def build(root: Path) -> dict:
    (root / "components").mkdir(parents=True, exist_ok=True)
    scripts = root / "scripts"
    scripts.mkdir(exist_ok=True)
    (scripts / "lib.sh").write_text("#!/bin/bash\n")
    def component(name: str, wheel: bool = False) -> ComponentSpec:
        extra = "  - TurnkvWheelS3Uri:\n      type: string\n" if wheel else ""
        path = root / "components" / f"{name}.yml"
        path.write_text(_DOC.format(name=name, extra=extra))
        return ComponentSpec(name, path, "1.0.0", {})
    images = {
        "gpu": ImageSpec("gpu", "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-24.04/"
                         "latest/ami-id", (component("turnkv-base"), component("turnkv-connector", wheel=True)),
                         "g6.2xlarge", 200),
        "neuron": ImageSpec("neuron", "/aws/service/neuron/dlami/multi-framework/ubuntu-24.04/latest/image_id",
                            (component("turnkv-base"), component("turnkv-connector", wheel=True)),
                            "trn1.2xlarge", 200),
    }

    def deploy_parameters(c: ComponentSpec, assets: dict) -> dict:
        out = dict(c.parameters, ScriptsS3Uri=assets["ScriptsS3Uri"])
        if c.name == "turnkv-connector":
            out["TurnkvWheelS3Uri"] = assets["TurnkvWheelS3Uri"]
        return out

    def recipe_fingerprint(flavor: str, assets: dict | None = None) -> str:
        payload = {"flavor": flavor, "assets": dict(sorted((assets or {}).items()))}
        return hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:12]

    return {"images": images, "scripts_dir": scripts, "deploy_parameters": deploy_parameters,
            "recipe_fingerprint": recipe_fingerprint}
