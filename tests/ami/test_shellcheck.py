"""Every AMI script is bash with `set -euo pipefail` (directly or through lib.sh) and shellcheck clean."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from ami import recipes

SCRIPTS = sorted(recipes.SCRIPTS_DIR.glob("*.sh"))
INSTALL_HINT = "install it with: apt-get update && apt-get install -y shellcheck"


def test_there_are_scripts():
    names = {p.name for p in SCRIPTS}
    assert {"lib.sh", "00-base.sh", "10-efa.sh", "20-nixl.sh", "efa-wait.sh", "build.sh"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_strict_mode(script):
    text = script.read_text()
    if script.name == "lib.sh":
        assert "\nset -euo pipefail\n" in text
    else:
        assert text.startswith("#!/usr/bin/env bash\n"), "bash shebang"
        assert 'source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"' in text, "sources lib.sh (which sets -euo pipefail)"


def test_shellcheck_clean():
    binary = shutil.which("shellcheck")
    if binary is None:
        print(f"shellcheck is not installed: {INSTALL_HINT}")
        pytest.skip(f"shellcheck missing: {INSTALL_HINT}")
    result = subprocess.run([binary, "--external-sources", "--severity=style", *map(str, SCRIPTS)],
                            cwd=recipes.AMI_DIR.parent, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_shellcheck_catches_a_bad_script(tmp_path):
    """The check above is only worth something if shellcheck really flags problems here."""
    binary = shutil.which("shellcheck")
    if binary is None:
        pytest.skip(f"shellcheck missing: {INSTALL_HINT}")
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/usr/bin/env bash\nrm -rf $DIR/*\n")
    result = subprocess.run([binary, str(bad)], capture_output=True, text=True)
    assert result.returncode != 0 and "SC2086" in result.stdout
