"""`turnkv router serve` as a user runs it: the engines' offer secret from a file, a clear error for a bad one."""

from typer.testing import CliRunner

import router.app
from turnkv import wire
from turnkv.cli import app

runner = CliRunner()
ENGINES = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]


def test_the_offer_secret_file_reaches_the_router(tmp_path, monkeypatch):
    served = []
    monkeypatch.setattr(router.app, "serve", served.append)
    secret = tmp_path / "offer-secret"
    secret.write_text("abc123\n")
    res = runner.invoke(app, ["router", "serve", *ENGINES, "--offer-secret-file", str(secret)])
    assert res.exit_code == 0, res.output
    assert served[0].offer_secret == b"abc123"  # stripped, as the engines read the file


def test_without_a_flag_the_router_reads_the_secret_as_the_engines_do(tmp_path, monkeypatch):
    served = []
    monkeypatch.setattr(router.app, "serve", served.append)
    monkeypatch.delenv(wire.OFFER_SECRET_ENV, raising=False)
    (tmp_path / "s").write_text("from-env-file\n")
    monkeypatch.setenv(wire.OFFER_SECRET_FILE_ENV, str(tmp_path / "s"))
    assert runner.invoke(app, ["router", "serve", *ENGINES]).exit_code == 0
    assert served[0].offer_secret == b"from-env-file"


def test_an_empty_or_missing_offer_secret_file_is_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.setattr(router.app, "serve", lambda config: None)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    res = runner.invoke(app, ["router", "serve", *ENGINES, "--offer-secret-file", str(empty)])
    assert res.exit_code == 2 and f"{empty} is empty" in res.output
    res = runner.invoke(app, ["router", "serve", *ENGINES, "--offer-secret-file", str(tmp_path / "none")])
    assert res.exit_code == 2 and "none" in res.output
