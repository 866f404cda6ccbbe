"""The product's Python sources, for the tests that read them as text (layering, literals, wire keys, env names)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: The product's packages (what ships; tests and generated output are not scanned).
PACKAGES = ("router", "connector", "infra", "bench", "turnkv", "ami")


def python_files(names: tuple[str, ...] = PACKAGES) -> list[Path]:
    """Every ``.py`` file under each name (a folder, or one file), in order; never inside ``node_modules``."""
    files: list[Path] = []
    for name in names:
        path = REPO / name
        files += [path] if path.suffix == ".py" else sorted(path.rglob("*.py"))
    return [p for p in files if "node_modules" not in p.parts and "__pycache__" not in p.parts]


def relative(path: Path) -> str:
    """``path`` as the tests name it: relative to the repository, with forward slashes."""
    return path.relative_to(REPO).as_posix()
