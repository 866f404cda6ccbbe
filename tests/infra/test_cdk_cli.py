"""The pinned CDK CLI (package.json, turnkv.versions) reads what aws-cdk-lib writes, offline."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from infra.wheel import REPO_ROOT
from turnkv import versions

pytestmark = pytest.mark.infra
CLI = REPO_ROOT / "node_modules" / ".bin" / "cdk"


def test_package_json_pins_the_cli_from_versions():
    package = json.loads((REPO_ROOT / "package.json").read_text())
    assert package["devDependencies"] == {"aws-cdk": versions.AWS_CDK_CLI}
    lock = json.loads((REPO_ROOT / "package-lock.json").read_text())
    assert lock["packages"]["node_modules/aws-cdk"]["version"] == versions.AWS_CDK_CLI


def test_cdk_json_runs_the_python_app_offline():
    cdk_json = json.loads((REPO_ROOT / "cdk.json").read_text())
    assert cdk_json["app"].endswith("-m infra.app")
    assert cdk_json["notices"] is False and cdk_json["cli-telemetry"] is False


@pytest.mark.skipif(not CLI.exists(), reason="run `npm ci` to install the pinned CDK CLI")
def test_pinned_cli_reads_the_cloud_assembly(gpu):
    env = {**os.environ, "CDK_DISABLE_VERSION_CHECK": "1"}
    done = subprocess.run([str(CLI), "ls", "--app", str(gpu.outdir), "--no-notices"], capture_output=True,
                          text=True, env=env, timeout=120, cwd=gpu.outdir)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(done.stdout.split()) == sorted(gpu.templates)
