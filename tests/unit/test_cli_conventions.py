"""The command line's conventions (issue #28): one flag name per concept with the old names as hidden aliases,
--json output that json.loads reads, and help text that says what it means."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from turnkv.cli import app


def test_local_status_json_lists_every_component(monkeypatch, tmp_path):
    from turnkv.local import stack

    rows = [{"name": "router", "pid": 11, "url": "http://127.0.0.1:8000", "alive": True, "healthy": True,
             "log": tmp_path / "logs" / "router.log"},
            {"name": "decode-0", "pid": 12, "url": "http://127.0.0.1:8200", "alive": False, "healthy": False,
             "log": tmp_path / "logs" / "decode-0.log"}]
    monkeypatch.setattr(stack.Supervisor, "status", lambda self: iter(rows))
    result = CliRunner().invoke(app, ["local", "status", "--json", "--state-dir", str(tmp_path)])
    assert result.exit_code == 1  # decode-0 is down: the exit code says so, as without --json
    listed = json.loads(result.stdout)
    assert [c["name"] for c in listed] == ["router", "decode-0"]
    assert listed[1] == {"name": "decode-0", "pid": 12, "alive": False, "healthy": False,
                         "url": "http://127.0.0.1:8200", "log": str(tmp_path / "logs" / "decode-0.log")}

    monkeypatch.setattr(stack.Supervisor, "status", lambda self: iter(rows[:1]))
    result = CliRunner().invoke(app, ["local", "status", "--json", "--state-dir", str(tmp_path)])
    assert result.exit_code == 0 and json.loads(result.stdout)[0]["healthy"] is True

    monkeypatch.setattr(stack.Supervisor, "status", lambda self: iter(()))
    result = CliRunner().invoke(app, ["local", "status", "--json", "--state-dir", str(tmp_path)])
    assert result.exit_code == 1 and json.loads(result.stdout) == []
