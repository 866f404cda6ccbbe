"""What `pip install turnkv` gets (issue #28): the license as an SPDX expression with its text, classifiers, and
the package data the CLI reads at run time (`turnkv plan`'s default workload)."""

from __future__ import annotations

import tomllib
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]


def test_license_is_an_spdx_expression_with_its_text():
    assert PROJECT["license"] == "Apache-2.0"
    assert PROJECT["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    # PEP 639: no license classifier next to an expression (setuptools refuses the pair); needs setuptools >= 77.
    assert not [c for c in PROJECT["classifiers"] if c.startswith("License ::")]
    assert any(r.replace(" ", "").startswith("setuptools>=77") for r in PYPROJECT["build-system"]["requires"])


def test_classifiers_say_what_it_runs_on():
    classifiers = PROJECT["classifiers"]
    assert "Programming Language :: Python :: 3.11" in classifiers
    assert "Operating System :: POSIX :: Linux" in classifiers
    assert len(PROJECT["keywords"]) >= 3


def test_package_data_holds_every_file_the_cli_reads():
    from turnkv.commands.plan import DEFAULT_WORKLOAD

    data = PYPROJECT["tool"]["setuptools"]["package-data"]
    shipped = [f"{pkg}/{glob}" for pkg, globs in data.items() for glob in globs]
    workloads = sorted((ROOT / "bench" / "workloads").glob("*.json"))
    assert DEFAULT_WORKLOAD in workloads
    for path in workloads:
        rel = path.relative_to(ROOT).as_posix()
        assert any(fnmatch(rel, g) for g in shipped), f"{rel} is not package data: a wheel install lacks it"


def test_project_urls_are_real_addresses_or_absent():
    """The repository has no public address yet (README and docs name none), so pyproject has no [project.urls]:
    a made-up one would be a broken link on the package index. Once the project has one, every entry must be an
    https URL with a real host (setuptools would take ``docs/`` as a link to a host named "docs")."""
    from urllib.parse import urlparse

    urls = PROJECT.get("urls", {})
    assert set(urls) <= {"Homepage", "Documentation", "Source", "Issues", "Changelog"}
    for name, url in urls.items():
        parts = urlparse(url)
        assert parts.scheme == "https" and "." in parts.netloc, (name, url)
        assert not any(w in url.lower() for w in ("example.", "your-", "<", "todo", "changeme", "placeholder")), url
