"""Lambda handlers, shipped inline (each file stays below CloudFormation's 4 KB ZipFile limit)."""

from pathlib import Path

DEREGISTER = Path(__file__).with_name("deregister.py")
KEEP_TUNABLES = Path(__file__).with_name("keep_tunables.py")
