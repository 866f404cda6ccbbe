"""`turnkv params list | get | set | history | sync` against moto in server mode (HTTP on 127.0.0.1)."""

from __future__ import annotations

import json
import re

import boto3
import pytest
from typer.testing import CliRunner

from turnkv import params
from turnkv.aws_params import allowed_pattern, change_label
from turnkv.cli import app

DEPLOYMENT = "unit"
REGION = "us-east-2"


@pytest.fixture
def aws(moto_url, monkeypatch):
    """Environment pointing boto3 at moto; a clean SSM per test."""
    for key, value in {"AWS_ENDPOINT_URL": moto_url, "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": REGION,
                       "AWS_DEFAULT_REGION": REGION}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(f"{moto_url}/moto-api/reset", method="POST")).read()
    ssm = boto3.client("ssm", region_name=REGION, endpoint_url=moto_url)
    # The deployment exists (its params stack would have created the parameters): one non-tunable parameter.
    ssm.put_parameter(Name=f"/turnkv/{DEPLOYMENT}/ami/gpu", Value="ami-0123456789abcdef0", Type="String")
    return ssm


def run(*args: str):
    return CliRunner().invoke(app, ["params", *args, "--deployment", DEPLOYMENT])


def _seed(ssm, name: str, value: str) -> None:
    t = params.get(name)
    ssm.put_parameter(Name=t.ssm_path(DEPLOYMENT), Value=value, Type="String", Overwrite=True)


def test_get_falls_back_to_catalog_default_when_unset(aws):
    result = run("get", "decoder_kv_blocks_ttl")
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(params.get("decoder_kv_blocks_ttl").default)


def test_set_writes_ssm_records_who_and_when_and_list_shows_it(aws):
    result = CliRunner().invoke(app, ["params", "set", "kv_recompute_threshold", "128", "--deployment", DEPLOYMENT,
                                      "--who", "alice@example.com"])
    assert result.exit_code == 0, result.output
    path = params.get("kv_recompute_threshold").ssm_path(DEPLOYMENT)
    stored = aws.get_parameter(Name=path)["Parameter"]
    assert stored["Value"] == "128"
    history = aws.get_parameter_history(Name=path)["Parameters"]
    assert history[-1]["Labels"][0].startswith("by-alice-example.com-")
    assert "set by alice@example.com at" in history[-1]["Description"] and "was unset" in history[-1]["Description"]

    listed = run("list", "--json")
    assert listed.exit_code == 0, listed.output
    table = json.loads(listed.output)
    assert table["kv_recompute_threshold"]["value"] == 128
    assert table["kv_recompute_threshold"]["version"] == stored["Version"]
    assert table["decoder_kv_blocks_ttl"]["stored"] is None

    hist = run("history", "kv_recompute_threshold")
    assert hist.exit_code == 0 and "alice" in hist.output
    as_json = run("history", "kv_recompute_threshold", "--json")
    assert as_json.exit_code == 0, as_json.output
    [version] = json.loads(as_json.output)
    assert version["value"] == "128" and version["version"] == stored["Version"]
    assert version["labels"][0].startswith("by-alice-example.com-") and "alice" in version["description"]
    assert version["modified"][:4].isdigit()  # ISO 8601


def test_set_records_previous_value_in_second_version(aws):
    assert run("set", "kv_lease_duration=40").exit_code == 0
    assert run("set", "kv_lease_duration=50").exit_code == 0
    history = aws.get_parameter_history(Name=params.get("kv_lease_duration").ssm_path(DEPLOYMENT))["Parameters"]
    assert [h["Value"] for h in history] == ["40", "50"]
    assert "was 40" in history[-1]["Description"]


@pytest.mark.parametrize(("args", "reason"), [
    (("set", "decoder_kv_blocks_ttl", "5"), "out of range"),
    (("set", "kv_recompute_threshold", "lots"), "not an integer"),
    (("set", "no_such_knob", "1"), "unknown tunable"),
    (("set", "conversation_ttl", "475"), "must stay below decoder_kv_blocks_ttl"),
    (("set", "conversation_ttl=100", "oops"), "expected NAME=VALUE"),
    (("get", "no_such_knob"), "unknown tunable"),
])
def test_wrong_values_are_refused_with_reason_and_exit_2(aws, args, reason):
    result = run(*args)
    assert result.exit_code == 2, result.output
    assert reason in " ".join(result.output.split())
    names = [p["Name"] for p in aws.get_parameters_by_path(Path=f"/turnkv/{DEPLOYMENT}", Recursive=True)["Parameters"]]
    assert names == [f"/turnkv/{DEPLOYMENT}/ami/gpu"]  # only the seed: nothing written


def test_cross_check_uses_stored_values_of_other_tunables(aws):
    _seed(aws, "decoder_kv_blocks_ttl", "300")
    # the default conversation_ttl (450) no longer fits; raising the engine TTL in the same call does
    assert run("set", "kv_lease_duration=31").exit_code == 2
    ok = run("set", "decoder_kv_blocks_ttl=900", "conversation_ttl=600")
    assert ok.exit_code == 0, ok.output


def test_dry_run_writes_nothing(aws):
    result = run("set", "kv_lease_duration", "60", "--dry-run")
    assert result.exit_code == 0 and "30 -> 60" in result.output
    names = [p["Name"] for p in aws.get_parameters_by_path(Path=f"/turnkv/{DEPLOYMENT}", Recursive=True)["Parameters"]]
    assert names == [f"/turnkv/{DEPLOYMENT}/ami/gpu"]  # only the seed


def test_allowed_pattern_accepts_every_default_and_refuses_junk():
    # SSM enforces AllowedPattern on writes from the console too (moto does not check it on overwrite)
    for t in params.CATALOG:
        pattern = re.compile(allowed_pattern(t))
        assert pattern.match(str(t.default)) and pattern.match(str(t.maximum)), t.name
        for junk in ("-1", "1e3", "", " 1", "1 ", "0x10", str(int(t.maximum)) + "0"):
            assert not pattern.match(junk), (t.name, junk)


def test_sync_writes_engine_tunables_atomically_and_only_on_change(aws, tmp_path):
    out = tmp_path / "etc" / "tunables.json"
    _seed(aws, "decoder_kv_blocks_ttl", "600")
    _seed(aws, "conversation_ttl", "300")
    first = run("sync", "--out", str(out))
    assert first.exit_code == 0, first.output
    assert "updated" in first.output
    data = json.loads(out.read_text())
    assert data == {**params.defaults(params.Scope.ENGINE), "decoder_kv_blocks_ttl": 600}
    second = run("sync", "--out", str(out))
    assert second.exit_code == 0 and "unchanged" in second.output


def test_sync_refuses_bad_stored_values_and_keeps_the_last_good_file(aws, tmp_path):
    out = tmp_path / "tunables.json"
    assert run("sync", "--out", str(out)).exit_code == 0
    before = out.read_text()
    _seed(aws, "kv_lease_duration", "9999")  # written around the CLI, e.g. in the console
    result = run("sync", "--out", str(out))
    assert result.exit_code == 2
    assert "kv_lease_duration" in result.output and "left as it was" in " ".join(result.output.split())
    assert out.read_text() == before
    listed = run("list")
    assert listed.exit_code == 0 and "invalid" in listed.output


def test_change_label_is_valid_for_ssm():
    from datetime import UTC, datetime

    label = change_label("arn:aws:sts::1:assumed-role/Admin/bob smith", datetime(2026, 11, 29, 20, 0, tzinfo=UTC))
    assert label == "by-arn-aws-sts-1-assumed-role-Admin-bob-smith-20261129T200000Z"


@pytest.mark.parametrize("command", [["list"], ["get", "decoder_kv_blocks_ttl"],
                                     ["set", "kv_recompute_threshold", "128"], ["history", "decoder_kv_blocks_ttl"],
                                     ["sync", "--out", "/dev/null"]])
def test_a_deployment_without_parameters_is_refused_and_named(aws, command):
    """A typo in -d must not silently create (or read defaults for) a deployment that does not exist."""
    result = CliRunner().invoke(app, ["params", *command, "--deployment", "unti"])
    assert result.exit_code == 2, result.output
    out = " ".join(result.output.split())
    assert "deployment 'unti' has no parameters under /turnkv/unti/" in out
    assert f"deployments with parameters there: {DEPLOYMENT}" in out and "--create" in out
    names = [p["Name"] for p in aws.describe_parameters()["Parameters"]]
    assert not any(n.startswith("/turnkv/unti/") for n in names), names


def test_set_create_makes_a_new_deployments_parameters(aws):
    result = CliRunner().invoke(app, ["params", "set", "kv_recompute_threshold", "128", "--deployment", "fresh",
                                      "--who", "alice", "--create"])
    assert result.exit_code == 0, result.output
    path = params.get("kv_recompute_threshold").ssm_path("fresh")
    assert aws.get_parameter(Name=path)["Parameter"]["Value"] == "128"
    assert CliRunner().invoke(app, ["params", "get", "kv_recompute_threshold", "-d", "fresh"]).output.strip() == "128"


def test_set_dry_run_without_a_deployment_checks_offline(monkeypatch, tmp_path):
    """No deployment, no credentials, no region: the ranges and cross-checks still run (over the catalog's
    defaults), exit 2 with the reason on a bad value, and nothing reaches AWS."""
    for key in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE", "AWS_ACCESS_KEY_ID", "TURNKV_DEPLOYMENT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setattr(boto3.session, "Session", lambda *a, **k: pytest.fail("AWS reached"))
    ok = CliRunner().invoke(app, ["params", "set", "decoder_kv_blocks_ttl=180", "--dry-run"])
    assert ok.exit_code == 0, ok.output
    assert "decoder_kv_blocks_ttl: 480 -> 180 (dry run, offline" in ok.output
    assert "conversation_ttl: 450 -> 170" in ok.output  # fitted, as docs/parameters.md says
    bad = CliRunner().invoke(app, ["params", "set", "decoder_kv_blocks_ttl=99999", "--dry-run"])
    assert bad.exit_code == 2 and "out of range" in bad.output
    no_deployment = CliRunner().invoke(app, ["params", "set", "decoder_kv_blocks_ttl=180"])
    assert no_deployment.exit_code == 2 and "--deployment" in no_deployment.output
    # with a deployment too (issue 46: it exited 1, "no credentials", before the range check that needs no AWS)
    named = CliRunner().invoke(app, ["params", "set", "decoder_kv_blocks_ttl=99999", "-d", "prod", "--dry-run",
                                     "--region", "us-east-2"])
    assert named.exit_code == 2 and "out of range" in named.output


def test_diff_reports_stored_values_that_differ_from_the_defaults(aws):
    """`turnkv params diff`: deploys never overwrite a stored value (infra/lambdas/keep_tunables.py), so a value
    the operator set, or a default an upgrade changed, shows here."""
    assert CliRunner().invoke(app, ["params", "set", "retained_kv_share=0.3", "-d", DEPLOYMENT, "--create",
                                    "--who", "t"]).exit_code == 0
    for tunable in params.CATALOG:  # the rest as the params stack creates them
        path = tunable.ssm_path(DEPLOYMENT)
        ssm = boto3.client("ssm")
        if not ssm.get_parameters(Names=[path])["Parameters"]:
            ssm.put_parameter(Name=path, Value=str(tunable.default), Type="String")
    done = CliRunner().invoke(app, ["params", "diff", "-d", DEPLOYMENT, "--json"])
    assert done.exit_code == 0, done.output
    assert json.loads(done.output) == {"retained_kv_share": {
        "stored": "0.3", "default": params.get("retained_kv_share").default,
        "reason": "kept: deploys never overwrite a stored value; `turnkv params set` applies the default"}}
    text = CliRunner().invoke(app, ["params", "diff", "-d", DEPLOYMENT]).output
    assert text.startswith("retained_kv_share: stored 0.3, default ")


def test_set_fits_the_router_ttl_over_the_stored_values(aws):
    """docs/parameters.md: decoder_kv_blocks_ttl alone lowers conversation_ttl to fit (it exited 2 before)."""
    done = CliRunner().invoke(app, ["params", "set", "decoder_kv_blocks_ttl=180", "-d", DEPLOYMENT, "--create",
                                    "--who", "t"])
    assert done.exit_code == 0, done.output
    ssm = boto3.client("ssm")
    assert ssm.get_parameter(Name=params.get("conversation_ttl").ssm_path(DEPLOYMENT))["Parameter"]["Value"] == "170"


def test_the_catalog_lists_offline(monkeypatch):
    monkeypatch.setattr(boto3.session, "Session", lambda *a, **k: pytest.fail("AWS reached"))
    done = CliRunner().invoke(app, ["params", "catalog", "--json"])
    assert done.exit_code == 0
    assert set(json.loads(done.output)) == {t.name for t in params.CATALOG}
    table = CliRunner().invoke(app, ["params", "catalog"])
    assert table.exit_code == 0 and "decoder_kv_blocks_ttl" in table.output


def test_a_region_that_is_no_region_name_is_refused_not_a_traceback(aws):
    done = CliRunner().invoke(app, ["params", "list", "-d", DEPLOYMENT, "--region", "us east"])
    assert done.exit_code == 2 and "not an AWS region name" in done.output and done.exception is not None
    assert isinstance(done.exception, SystemExit)


def test_the_offline_dry_run_previews_what_set_does(aws):
    """Issue #49: `set decoder_kv_blocks_ttl=600 --dry-run` offline previewed `conversation_ttl: 450 -> 590`, a raise
    the real command never makes (it only lowers a stored value that no longer fits). Offline, the catalog's
    defaults stand in for the stored values: the preview is a dry run against a deployment that holds them."""
    for change in ("decoder_kv_blocks_ttl=600", "decoder_kv_blocks_ttl=300"):
        offline = CliRunner().invoke(app, ["params", "set", change, "--dry-run"])
        stored = run("set", change, "--dry-run")
        assert offline.exit_code == stored.exit_code == 0, (offline.output, stored.output)
        assert ([line.split(" (dry run")[0] for line in offline.output.splitlines()]
                == [line.split(" (dry run")[0] for line in stored.output.splitlines()]), (offline.output, stored.output)
    assert "conversation_ttl" not in CliRunner().invoke(app, ["params", "set", "decoder_kv_blocks_ttl=600",
                                                              "--dry-run"]).output
