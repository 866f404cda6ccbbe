"""The first things a new user hits (issue #28): clear errors (exit 2, the fix named) instead of tracebacks,
and `turnkv --version`."""

from __future__ import annotations

from typer.testing import CliRunner

from turnkv.cli import app

runner = CliRunner()


def flat(text: str) -> str:
    return " ".join(text.split())


def test_version():
    from importlib.metadata import version

    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0, res.output
    assert res.output.startswith(f"turnkv {version('turnkv')} (vLLM ") and "NIXL" in res.output


def test_params_without_a_region_names_the_fix(monkeypatch, tmp_path):
    for key in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    res = runner.invoke(app, ["params", "list", "-d", "demo"])
    assert res.exit_code == 2, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)
    assert "no AWS region" in flat(res.output) and "--region" in res.output


def test_router_refuses_an_engine_without_a_scheme_before_starting():
    res = runner.invoke(app, ["router", "serve", "--prefill", "127.0.0.1:9", "--decode", "http://127.0.0.1:10"])
    assert res.exit_code == 2, res.output
    assert isinstance(res.exception, SystemExit)
    assert "http://127.0.0.1:9" in flat(res.output)


def test_router_config_named_yaml_or_malformed_is_refused(tmp_path):
    yaml = tmp_path / "deploy.yaml"
    yaml.write_text("name: prod\n")
    res = runner.invoke(app, ["router", "serve", "--config", str(yaml)])
    assert res.exit_code == 2 and "turnkv config validate" in flat(res.output)
    bad = tmp_path / "router.toml"
    bad.write_text("x = [\n")
    res = runner.invoke(app, ["router", "serve", "--config", str(bad)])
    assert res.exit_code == 2 and "malformed TOML" in flat(res.output) and str(bad) in flat(res.output)


def test_malformed_deploy_yaml_is_one_line_naming_the_place(tmp_path):
    for text, words in (("name: [oops\n  bad: :", "malformed YAML at line 2"),
                        ("\t name: x\n", "malformed YAML at line 1"),
                        ("- a\n- b\n", "must hold a mapping")):
        f = tmp_path / "deploy.yaml"
        f.write_text(text)
        res = runner.invoke(app, ["config", "validate", str(f)])
        assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
        assert words in flat(res.output)


def test_params_without_credentials_names_the_fix(monkeypatch, tmp_path):
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    res = runner.invoke(app, ["params", "list", "-d", "demo", "--region", "us-east-2"])
    assert res.exit_code == 1, res.output
    assert "Unable to locate credentials" in flat(res.output) and "aws configure" in flat(res.output)
