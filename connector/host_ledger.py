"""The host's ledger of host-tier pools (I/O): one small JSON file per host that every engine's ranks read and
write under an exclusive lock, so that pools planned at the same time, by engines of one node or of several local
stacks, split what the host can back (``host_pool_plan.host_room``) instead of each counting the same free memory.

An entry is a pool's bytes, planned (not yet out of MemAvailable) or allocated, keyed by the owning process; the
entries of processes that are gone are dropped on every read, so a killed engine's claim does not outlive it."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from connector import host_pool_plan

#: Where the ledger lives: shared memory, so a reboot clears it (``TURNKV_HOST_LEDGER`` moves it, for tests).
DEFAULT_PATH = "/dev/shm/turnkv-host-tier.json"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class HostLedger:
    def __init__(self, path: str | os.PathLike[str] | None = None, pid: int | None = None) -> None:
        self.path = Path(path or os.environ.get("TURNKV_HOST_LEDGER") or DEFAULT_PATH)
        self.pid = os.getpid() if pid is None else pid

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, dict]]:
        """The live entries, under the lock; what the block leaves in the dict is written back."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                try:
                    entries = json.loads(self.path.read_text() or "{}")
                except (OSError, ValueError):
                    entries = {}
                entries = {k: v for k, v in entries.items() if _alive(int(v.get("pid", 0)))}
                yield entries
                tmp = self.path.with_suffix(f".{self.pid}.tmp")
                tmp.write_text(json.dumps(entries))
                tmp.replace(self.path)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def reserve(self, pools: int, total: int, available: int | None, plan: Callable[[int | None], int]) -> int:
        """Under the lock: the room this process's pool may take (``host_room`` over the other live claims), then
        ``plan(room)`` -> the bytes the pool will take, recorded as this process's planned claim. ``available`` None
        (not known): ``plan(None)``, no cap, nothing recorded. Returns the bytes claimed."""
        if available is None:
            return int(plan(None))
        with self._locked() as entries:
            others = [host_pool_plan.Claim(int(v["bytes"]), bool(v["allocated"]))
                      for k, v in entries.items() if k != str(self.pid)]
            claimed = int(plan(host_pool_plan.host_room(available, total, pools, others)))
            entries[str(self.pid)] = {"pid": self.pid, "bytes": claimed, "allocated": False}
            return claimed

    def settle(self, nbytes: int) -> None:
        """This process's pool is allocated with ``nbytes`` (0: none, the claim is dropped)."""
        with self._locked() as entries:
            if nbytes > 0:
                entries[str(self.pid)] = {"pid": self.pid, "bytes": int(nbytes), "allocated": True}
            else:
                entries.pop(str(self.pid), None)

    def claims(self) -> dict[int, host_pool_plan.Claim]:
        """Every live claim by process (for reports and tests)."""
        with self._locked() as entries:
            return {int(v["pid"]): host_pool_plan.Claim(int(v["bytes"]), bool(v["allocated"]))
                    for v in entries.values()}
