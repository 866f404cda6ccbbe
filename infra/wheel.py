"""Build the turnkv wheel the AMI installs (component parameter ``TurnkvWheelS3Uri``).

Reproducible (``SOURCE_DATE_EPOCH``), so an unchanged tree gives the same bytes, the same S3 key and the
same image recipe. No network: ``--no-build-isolation`` uses the running interpreter's setuptools.

The image's wheel (``build_node_wheel``) holds only what an engine node runs: the ``turnkv`` package (CLI, node
agent, doctor, engine launch, params sync, metrics bridge) and the ``connector`` package, with the project's
name, version, dependencies and entry points. Not the router, the benchmark, the CDK app, the AMI recipes or the
README (the long description): a change there makes the same wheel, so the same recipe, and no bake and no roll
of the GPU nodes (issue 46).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SOURCE_DATE_EPOCH = "315532800"  # 1980-01-01, the earliest a zip can say


class WheelError(RuntimeError):
    pass


def build_wheel(out_dir: Path, repo_root: Path = REPO_ROOT) -> Path:
    out_dir = Path(out_dir)
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    # setuptools reuses build/lib: a module deleted from the tree would otherwise linger in the wheel.
    for stale in ("build/lib", "build/bdist.linux-x86_64"):
        shutil.rmtree(repo_root / stale, ignore_errors=True)
    env = {**os.environ, "SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH}
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--disable-pip-version-check",
         "-q", str(repo_root), "-w", str(out_dir)],
        env=env, capture_output=True, text=True, check=False)
    wheels = sorted(out_dir.glob("turnkv-*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        raise WheelError(f"building the turnkv wheel failed (pip wheel exit {done.returncode}):\n{done.stderr[-3000:]}")
    return wheels[0]


#: The packages an engine node runs (the rest of the repository never reaches the image).
NODE_PACKAGES = ("turnkv", "connector")
#: Fields of ``[project]`` the node wheel keeps (the readme and the extras' requirement files stay out).
_NODE_PROJECT_FIELDS = ("name", "version", "description", "requires-python", "license", "license-files",
                        "dependencies", "scripts", "entry-points")


def node_pyproject(pyproject: str) -> str:
    """The node wheel's ``pyproject.toml``, derived from the repository's (one source for the name, version,
    dependencies and entry points): its kept ``[project]`` fields, only ``NODE_PACKAGES``, their package data."""
    data = tomllib.loads(pyproject)
    project = {k: data["project"][k] for k in _NODE_PROJECT_FIELDS if k in data["project"]}
    setuptools = data.get("tool", {}).get("setuptools", {})
    package_data = {k: v for k, v in setuptools.get("package-data", {}).items() if k in NODE_PACKAGES}
    tables: list[tuple[str, dict]] = [
        ("build-system", data["build-system"]),
        ("project", {k: v for k, v in project.items() if not isinstance(v, dict)}),
        *((f"project.{k}", v) for k, v in project.items() if k == "scripts"),
        *((f'project.entry-points."{group}"', v) for group, v in project.get("entry-points", {}).items()),
        ("tool.setuptools.packages.find", {"where": ["."], "include": [f"{p}*" for p in NODE_PACKAGES]}),
        ("tool.setuptools.package-data", package_data),
    ]
    lines: list[str] = []
    for name, table in tables:
        lines.append(f"[{name}]")
        # JSON strings and lists of strings are valid TOML (basic strings, arrays)
        lines += [f"{json.dumps(k) if not k.replace('-', '').isalnum() else k} = {json.dumps(v)}"
                  for k, v in table.items()]
        lines.append("")
    return "\n".join(lines)


def build_node_wheel(out_dir: Path, repo_root: Path = REPO_ROOT) -> Path:
    """The image's wheel: ``NODE_PACKAGES`` (and LICENSE) from ``repo_root``, built from a staging copy."""
    repo_root = Path(repo_root)
    with tempfile.TemporaryDirectory(prefix="turnkv-node-wheel-") as tmp:
        stage = Path(tmp) / "turnkv"
        stage.mkdir()
        for package in NODE_PACKAGES:
            shutil.copytree(repo_root / package, stage / package,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
        shutil.copy2(repo_root / "LICENSE", stage / "LICENSE")
        (stage / "pyproject.toml").write_text(node_pyproject((repo_root / "pyproject.toml").read_text()))
        return build_wheel(out_dir, stage)


def digest(path: Path, length: int = 16) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:length]
