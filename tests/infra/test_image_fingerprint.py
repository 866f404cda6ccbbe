"""The image fingerprint follows what a node runs (issue 46): a README or router edit bakes nothing, a connector edit
bakes a new image. No synth: two wheel builds from a copy of the tree."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.infra


def _tree(root, tmp_path):
    import shutil

    tree = tmp_path / "tree"
    for part in ("turnkv", "connector", "router"):
        shutil.copytree(root / part, tree / part, ignore=shutil.ignore_patterns("__pycache__"))
    for part in ("LICENSE", "pyproject.toml", "README.md"):
        shutil.copy2(root / part, tree / part)
    return tree


def test_the_image_fingerprint_changes_only_with_what_a_node_runs(tmp_path):
    """The image's wheel holds the turnkv and connector packages only: an edit to the README (the wheel's long
    description before) or the router bakes nothing and rolls no GPU node; an edit to the connector does both."""
    from ami import recipes
    from infra.wheel import REPO_ROOT, build_node_wheel, digest

    tree = _tree(REPO_ROOT, tmp_path)

    def fingerprint(name: str) -> str:
        wheel = digest(build_node_wheel(tmp_path / name, tree))
        return recipes.recipe_fingerprint("gpu", {"ScriptsS3Uri": "scripts", "TurnkvWheelS3Uri": wheel})

    before = fingerprint("before")
    (tree / "README.md").write_text((tree / "README.md").read_text() + " \n")
    (tree / "router" / "app.py").write_text((tree / "router" / "app.py").read_text() + "\n# edited\n")
    assert fingerprint("readme") == before
    (tree / "connector" / "policy.py").write_text((tree / "connector" / "policy.py").read_text() + "\n# edited\n")
    assert fingerprint("connector") != before
