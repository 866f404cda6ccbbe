"""Fixtures for the AMI tests: a fake root, stubbed commands, and a small Image Builder document runner."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from ami import recipes
from tests.ami import stubs

#: Absolute paths the documents use on an image, mapped into the fake root / work folder by the runner.
AMI_WORK = "/var/tmp/turnkv-ami"


@dataclass
class Bake:
    """One fake image: a root, a work folder, the stub log, and a runner for component documents."""

    root: Path
    work: Path
    log: Path
    stub_dir: Path
    env: dict[str, str]
    efa_sha256: str
    overrides: dict[str, str] = field(default_factory=dict)

    def assets(self) -> dict[str, str]:
        return {"ScriptsS3Uri": "s3://assets-bucket/scripts.zip",
                "TurnkvWheelS3Uri": f"s3://assets-bucket/turnkv-{recipes.versions.TURNKV}-py3-none-any.whl"}

    def parameters(self, component: recipes.ComponentSpec) -> dict[str, str]:
        params = recipes.deploy_parameters(component, self.assets())
        # The fake downloads' own hashes stand in for the real pins (turnkv/versions.py).
        if "EfaInstallerSha256" in params:
            params["EfaInstallerSha256"] = self.efa_sha256
        if "CloudWatchAgentSha256" in params:
            params["CloudWatchAgentSha256"] = hashlib.sha256(
                stubs.fake_cloudwatch_deb(params["CloudWatchAgentVersion"])).hexdigest()
        for name, value in self.overrides.items():
            if name in params:
                params[name] = value
        return params

    def map_paths(self, text: str) -> str:
        text = text.replace(AMI_WORK, str(self.work / "ami"))
        return re.sub(r"(?<![\w/.-])/(opt/turnkv|etc/turnkv)", lambda m: f"{self.root}/{m.group(1)}", text)

    def run_phase(self, component: recipes.ComponentSpec, phase: str, extra_env: dict[str, str] | None = None,
                  check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run one phase of a component document the way Image Builder would, against the fake root."""
        doc = yaml.safe_load(component.path.read_text())
        params = self.parameters(component)
        result = subprocess.CompletedProcess(args=[], returncode=0, stdout="", stderr="")
        for step in next(p for p in doc["phases"] if p["name"] == phase)["steps"]:
            action = step["action"]
            if action == "S3Download":
                for item in step["inputs"]:
                    source = substitute(item["source"], params)
                    assert source == params["ScriptsS3Uri"], source
                    dest = Path(self.map_paths(item["destination"]))
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    zip_dir(recipes.SCRIPTS_DIR, dest)
                    self.append_log(f"S3Download {source}")
            elif action == "Reboot":
                self.append_log("Reboot")
            elif action == "ExecuteBash":
                script = self.map_paths(substitute("\n".join(step["inputs"]["commands"]), params))
                result = subprocess.run(["bash", "-c", script], env={**self.env, **(extra_env or {})},
                                        capture_output=True, text=True, timeout=120)
                if check and result.returncode != 0:
                    raise AssertionError(f"{component.name}/{phase}/{step['name']} failed:\n{result.stderr}")
                if result.returncode != 0:
                    return result
            else:
                raise AssertionError(f"the runner does not know action {action}")
        return result

    def bake(self, flavor: str, phases: tuple[str, ...] = ("build", "validate"), **kwargs) -> None:
        components = recipes.IMAGES[flavor].components
        for phase in phases:  # Image Builder: every component's build, then every component's validate
            for component in components:
                if any(p["name"] == phase for p in yaml.safe_load(component.path.read_text())["phases"]):
                    self.run_phase(component, phase, **kwargs)

    def run_script(self, name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", str(recipes.SCRIPTS_DIR / name), *args], env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=60)

    def append_log(self, line: str) -> None:
        with self.log.open("a") as fh:
            fh.write(line + "\n")

    def calls(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def manifest(self) -> dict[str, tuple]:
        """Every path under the root with its kind, mode, content hash or link target, and mtime."""
        out: dict[str, tuple] = {}
        for path in sorted(self.root.rglob("*")):
            rel = str(path.relative_to(self.root))
            st = path.lstat()
            if path.is_symlink():
                out[rel] = ("link", os.readlink(path))
            elif path.is_dir():
                out[rel] = ("dir", st.st_mode)
            else:
                out[rel] = ("file", st.st_mode, hashlib.sha256(path.read_bytes()).hexdigest(), st.st_mtime_ns)
        return out


def substitute(text: str, params: dict[str, str]) -> str:
    def repl(match: re.Match[str]) -> str:
        name = match.group(1)
        assert name in params, f"{{{{ {name} }}}} has no value"
        return params[name]

    out = re.sub(r"\{\{\s*(\w+)\s*\}\}", repl, text)
    assert "{{" not in out
    return out


def zip_dir(directory: Path, dest: Path) -> None:
    """What the image stack uploads: a zip of ami/scripts with paths relative to it (as a CDK asset is)."""
    with zipfile.ZipFile(dest, "w") as zf:
        for path in sorted(directory.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                zf.write(path, path.relative_to(directory).as_posix())


@pytest.fixture
def bake(tmp_path: Path) -> Bake:
    stub_dir, root, work, state = tmp_path / "stubs", tmp_path / "root", tmp_path / "work", tmp_path / "state"
    for d in (root, work, state):
        d.mkdir()
    stubs.write_stubs(stub_dir)
    tarball = stubs.make_efa_tarball(tmp_path / "efa-src", recipes.versions.EFA_INSTALLER, recipes.versions.LIBFABRIC)
    log = tmp_path / "calls.log"
    env = stubs.base_env(stub_dir, root, work, log, state)
    env["FAKE_EFA_TARBALL"] = str(tarball)
    return Bake(root=root, work=work, log=log, stub_dir=stub_dir, env=env,
                efa_sha256=hashlib.sha256(tarball.read_bytes()).hexdigest())
