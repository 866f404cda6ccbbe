"""The pinned CDK CLI (package.json, turnkv.versions) reads what aws-cdk-lib writes, offline."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from infra.wheel import REPO_ROOT
from tests.infra.configs import ACCOUNT
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
def test_pinned_cli_synthesizes_with_an_account_set(tmp_path):
    """`cdk synth` as a user with credentials runs it (what `make synth` does): the CLI sets CDK_DEFAULT_ACCOUNT
    and CDK_DEFAULT_REGION, runs cdk.json's app on its inline config, with CDK's built-in CloudFormation
    validation and cdk-nag on. Nothing may be left to look up (no credentials here), nothing unacknowledged."""
    out = tmp_path / "cdk.out"
    env = {**os.environ, "CDK_DISABLE_VERSION_CHECK": "1", "CDK_DEFAULT_ACCOUNT": ACCOUNT,
           "CDK_DEFAULT_REGION": "us-east-2", "PYTHONPATH": str(REPO_ROOT),
           "JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION": "20"}
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        env.pop(var, None)
    done = subprocess.run([str(CLI), "synth", "--quiet", "--no-notices", "-o", str(out)], capture_output=True,
                          text=True, env=env, timeout=540, cwd=REPO_ROOT)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest.get("missing") is None, manifest["missing"]
    stacks = {name: a for name, a in manifest["artifacts"].items() if a["type"] == "aws:cloudformation:stack"}
    assert len(stacks) >= 5
    assert {a["environment"] for a in stacks.values()} == {f"aws://{ACCOUNT}/us-east-2"}
    report = json.loads((out / "validation-report.json").read_text())
    conclusions = {p["pluginName"]: p["conclusion"] for p in report["pluginReports"]}
    assert "AwsSolutions" in conclusions and set(conclusions.values()) == {"success"}, conclusions
    # The account number itself appears in the acknowledged ARNs (not only <AWS::AccountId>).
    (nag,) = [p for p in report["pluginReports"] if p["pluginName"] == "AwsSolutions"]
    assert any(ACCOUNT in v["acknowledgedId"] for v in nag["suppressedViolations"])


@pytest.mark.skipif(not CLI.exists(), reason="run `npm ci` to install the pinned CDK CLI")
def test_pinned_cli_reads_the_cloud_assembly(gpu):
    env = {**os.environ, "CDK_DISABLE_VERSION_CHECK": "1"}
    done = subprocess.run([str(CLI), "ls", "--app", str(gpu.outdir), "--no-notices"], capture_output=True,
                          text=True, env=env, timeout=120, cwd=gpu.outdir)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(done.stdout.split()) == sorted(gpu.templates)
