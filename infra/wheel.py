"""Build the turnkv wheel the AMI installs (component parameter ``TurnkvWheelS3Uri``).

Reproducible (``SOURCE_DATE_EPOCH``), so an unchanged tree gives the same bytes, the same S3 key and the
same image recipe. No network: ``--no-build-isolation`` uses the running interpreter's setuptools.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SOURCE_DATE_EPOCH = "315532800"  # 1980-01-01, the earliest a zip can say


class WheelError(RuntimeError):
    pass


def build_wheel(out_dir: Path, repo_root: Path = REPO_ROOT) -> Path:
    out_dir = Path(out_dir)
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    # setuptools reuses build/lib: a module deleted from the tree would otherwise linger in the wheel.
    for stale in ("build/lib", "build/bdist.linux-x86_64"):
        shutil.rmtree(repo_root / stale, ignore_errors=True)
    env = {**os.environ, "SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH}
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--disable-pip-version-check",
         "-q", str(repo_root), "-w", str(out_dir)],
        env=env, capture_output=True, text=True, check=False)
    wheels = sorted(out_dir.glob("turnkv-*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        raise WheelError(f"building the turnkv wheel failed (pip wheel exit {done.returncode}):\n{done.stderr[-3000:]}")
    return wheels[0]


def digest(path: Path, length: int = 16) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:length]
