"""A fake NIXL fabric that moves labelled blocks (pure: no vLLM, no connector).

Each engine rank has an agent (a new name per process: a restarted engine is a new agent) with registered
memories: its device KV cache (VRAM) and, on decode, its host pool (DRAM). A descriptor list is prepared against
the addresses an engine's handshake metadata (or an offer's host-tier field) names; the fabric resolves them to the
registered memory that covers them, or refuses, as NIXL does. A READ is posted with descriptor ids that encode
(region, block) with the per-region block count the *reader* believed (upstream's ``_compute_desc_ids``): if that
count is not the layout of the memory read, the ids land in another region or block, and the fabric records a
layout fault. The bytes (labels) move when the READ completes (not when it is posted), so anything freed and
rewritten in between is what the reader gets.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests.sim.model import Label

#: Bytes of one block in one region (what the cost model's transfer samples count).
BLOCK_LEN = 4096
#: KV regions (layers) per engine rank: enough for a wrong per-region count to land in another region.
REGIONS = 2


class NixlError(RuntimeError):
    """What the NIXL agent raises (NOT_FOUND, INVALID_PARAM, a dead peer)."""


@dataclass
class Memory:
    """One engine rank's blocks of one kind (the label each holds), laid out as ``REGIONS`` regions of ``blocks``,
    with when each block was written (a READ copies what its source held when the READ ended)."""

    owner: str  # engine id / boot / rank, for the trace
    kind: str  # "device" or "host"
    blocks: int
    base: int
    clock: Callable[[], float]
    labels: dict[int, Label] = field(default_factory=dict)
    history: dict[int, list[tuple[float, Label | None]]] = field(default_factory=dict)

    def write(self, block: int, label: Label | None) -> None:
        if label is None:
            self.labels.pop(block, None)
        else:
            self.labels[block] = label
        self.history.setdefault(block, []).append((self.clock(), label))

    def at(self, block: int, instant: float) -> Label | None:
        """What ``block`` held at ``instant``."""
        held = None
        for when, label in self.history.get(block, ()):
            if when > instant:
                break
            held = label
        return held

    def written_between(self, block: int, start: float, end: float) -> bool:
        return any(start < when <= end for when, _ in self.history.get(block, ()))

    @property
    def mem(self) -> str:
        return "VRAM" if self.kind == "device" else "DRAM"

    def region_bases(self) -> list[int]:
        return [self.base + r * self.blocks * BLOCK_LEN for r in range(REGIONS)]


@dataclass
class DList:
    agent: str  # "" for local
    memory: Memory
    per_region: int


@dataclass
class Xfer:
    reader: str
    remote_agent: str
    local: DList
    remote: DList
    pairs: list[tuple[int, int]]
    notif: bytes
    started: float
    done_at: float
    fail: bool
    tag: str  # the reading request, for the trace
    state: str = "PROC"


@dataclass
class Agent:
    name: str
    memories: list[Memory] = field(default_factory=list)
    inbox: list[tuple[str, bytes]] = field(default_factory=list)
    alive: bool = True


class Fabric:
    """Every agent of one simulated deployment, its prepared lists and transfers."""

    def __init__(self, clock: Callable[[], float], on_event: Callable[[str], None]) -> None:
        self.clock = clock
        self.on_event = on_event  # trace lines and faults
        self.agents: dict[str, Agent] = {}
        self.lists: dict[int, DList] = {}
        self.xfers: dict[int, Xfer] = {}
        self._next = 100
        #: reader agent -> fault modes for its next READs ("fail", "slow", "hang")
        self.faults: dict[str, list[str]] = {}
        #: (reading request, fault) seen while copying: layout faults and torn reads
        self.copy_faults: list[tuple[str, str]] = []
        #: told (reading request, agent, local blocks) whenever a READ's bytes land
        self.on_land: Callable[[str, str, list[int]], None] = lambda tag, agent, blocks: None
        self.latency: Callable[[], float] = lambda: 0.004
        #: seconds a READ with an injected delay takes, by fault mode
        self.slow: dict[str, Callable[[], float]] = {"slow": lambda: 0.5}

    def _id(self) -> int:
        self._next += 1
        return self._next

    def agent(self, name: str) -> Agent:
        if name not in self.agents:
            self.agents[name] = Agent(name)
        return self.agents[name]

    def register(self, name: str, memory: Memory) -> None:
        self.agent(name).memories.append(memory)

    def kill(self, name: str) -> None:
        if name in self.agents:
            self.agents[name].alive = False

    def prep(self, agent: str, bases: list[int], per_region: int, mem: str) -> int:
        """A prepared descriptor list of ``agent`` ("" for the local memory of ``local_of``): every region's
        ``per_region`` blocks must lie in one registered memory of type ``mem`` (NIXL: NOT_FOUND otherwise)."""
        owner = self.agents.get(agent)
        if owner is None or not owner.alive:
            raise NixlError(f"NOT_FOUND: agent {agent}")
        for memory in owner.memories:
            if memory.mem != mem:
                continue
            lo, hi = memory.base, memory.base + REGIONS * memory.blocks * BLOCK_LEN
            if all(lo <= b and b + per_region * BLOCK_LEN <= hi for b in bases):
                handle = self._id()
                self.lists[handle] = DList(agent, memory, per_region)
                return handle
        raise NixlError(f"NOT_FOUND: {mem} {[hex(b) for b in bases]} x {per_region} not registered by {agent}")

    def local_list(self, memory: Memory) -> int:
        handle = self._id()
        self.lists[handle] = DList("", memory, memory.blocks)
        return handle

    def post(self, reader: str, local: int, local_ids: list[int], remote: int, remote_ids: list[int],
             notif: bytes, tag: str) -> int:
        """A READ of ``remote_ids`` of the remote list into ``local_ids`` of the local one (INVALID_PARAM on
        unequal or out-of-range ids)."""
        dst, src = self.lists.get(local), self.lists.get(remote)
        if dst is None or src is None or dst.agent != "" or src.agent == "":
            raise NixlError("INVALID_PARAM: handles")
        if len(local_ids) != len(remote_ids) or not local_ids:
            raise NixlError("INVALID_PARAM: descriptor counts")
        for ids, dlist in ((local_ids, dst), (remote_ids, src)):
            if any(i < 0 or i >= REGIONS * dlist.per_region for i in ids):
                raise NixlError("INVALID_PARAM: descriptor id out of range")
        owner = self.agents.get(src.agent)
        if owner is None or not owner.alive:
            raise NixlError(f"REMOTE_DISCONNECT: {src.agent}")
        faults = self.faults.get(reader) or []
        fault = faults.pop(0) if faults else ""
        now = self.clock()
        delay = self.slow[fault]() if fault in self.slow else self.latency()
        handle = self._id()
        pairs = list(zip(local_ids, remote_ids, strict=True))
        self.xfers[handle] = Xfer(reader, src.agent, dst, src, pairs, notif, now, now + delay, fault == "fail", tag)
        if fault:
            self.on_event(f"fabric: READ {handle} of {tag} by {reader}: injected '{fault}'")
        return handle

    def state(self, handle: int) -> str:
        xfer = self.xfers.get(handle)
        if xfer is None:
            raise NixlError("INVALID_PARAM: unknown transfer")
        if xfer.state != "PROC":
            return xfer.state
        owner = self.agents.get(xfer.remote_agent)
        if owner is None or not owner.alive:
            xfer.state = "ERR"
        elif self.clock() >= xfer.done_at:
            xfer.state = "ERR" if xfer.fail else "DONE"
            if xfer.state == "DONE":
                self._complete(xfer)
        return xfer.state

    def release(self, handle: int) -> None:
        """``releaseXferReq`` on a READ still in flight: NIXL aborts it (its bytes never land)."""
        xfer = self.xfers.get(handle)
        if xfer is not None and xfer.state == "PROC" and self.clock() < xfer.done_at:
            xfer.state = "ERR"
            self.on_event(f"fabric: READ {handle} of {xfer.tag} released in flight: aborted")

    def _complete(self, xfer: Xfer) -> None:
        """The bytes land: what the source blocks held when the READ ended (``done_at``), however late its
        completion is polled; a source block written while the READ was in flight makes it torn."""
        torn = False
        source = xfer.remote.memory
        first: dict[int, int] = {}  # local block -> the remote block region 0 read into it
        for ld, rd in xfer.pairs:
            l_region, l_block = divmod(ld, xfer.local.per_region)
            r_region, r_block = divmod(rd, xfer.remote.per_region)
            if l_region == 0:
                first[l_block] = r_block
            # Every region of a local block must read the same block of the same region: ids laid out with another
            # per-region count than the memory's land elsewhere from region 1 on.
            if l_region != r_region or r_block >= source.blocks or first.get(l_block, r_block) != r_block:
                self.copy_faults.append((xfer.tag, f"desc {rd} read region {r_region} block {r_block} of "
                                                   f"{source.kind} memory into local region {l_region} block "
                                                   f"{l_block} (region 0 read block {first.get(l_block)})"))
            torn |= source.written_between(r_block, xfer.started, xfer.done_at)
            if l_region == 0:
                xfer.local.memory.write(l_block, source.at(r_block, xfer.done_at))
        if torn:
            self.on_event(f"fabric: READ of {xfer.tag}: source blocks changed while it was in flight")
        self.on_land(xfer.tag, xfer.reader, sorted({ld % xfer.local.per_region for ld, _ in xfer.pairs}))
        self.agent(xfer.remote_agent).inbox.append((xfer.reader, xfer.notif))

    def telemetry(self, handle: int) -> Any:
        xfer = self.xfers[handle]
        from types import SimpleNamespace

        return SimpleNamespace(xferDuration=max(1.0, (xfer.done_at - xfer.started) * 1e6), postDuration=1.0,
                               totalBytes=len(xfer.pairs) * BLOCK_LEN, descCount=len(xfer.pairs))

    def notify(self, sender: str, agent: str, msg: bytes) -> None:
        owner = self.agents.get(agent)
        if owner is None or not owner.alive:
            raise NixlError(f"REMOTE_DISCONNECT: {agent}")
        owner.inbox.append((sender, msg))

    def take_notifs(self, agent: str) -> dict[str, list[bytes]]:
        owner = self.agent(agent)
        out: dict[str, list[bytes]] = {}
        for sender, msg in owner.inbox:
            out.setdefault(sender, []).append(msg)
        owner.inbox = []
        return out


class AgentView:
    """``nixl_wrapper`` of one worker: NIXL's Python agent API, as far as upstream's worker and the mixin call it."""

    def __init__(self, fabric: Fabric, name: str, local: Memory) -> None:
        self.fabric, self.name, self.local_memory = fabric, name, local
        self.loaded: set[str] = set()

    # descriptor lists
    def get_xfer_descs(self, descs: Any, mem: str) -> Any:
        return (descs, mem)

    def prep_xfer_dlist(self, agent: str, descs: Any) -> int:
        (bases, per_region), mem = descs
        if agent not in self.loaded:
            raise NixlError(f"NOT_FOUND: no metadata of {agent} loaded")
        return self.fabric.prep(agent, list(bases), int(per_region), mem)

    def release_dlist_handle(self, handle: int) -> None:
        self.fabric.lists.pop(handle, None)

    # transfers
    def make_prepped_xfer(self, op: str, local: int, local_ids: list[int], remote: int, remote_ids: list[int],
                          notif_msg: bytes = b"", tag: str = "") -> int:
        assert op == "READ"
        return self.fabric.post(self.name, local, list(local_ids), remote, list(remote_ids), notif_msg, tag)

    def transfer(self, handle: int) -> str:
        return "PROC"

    def check_xfer_state(self, handle: int) -> str:
        return self.fabric.state(handle)

    def get_xfer_telemetry(self, handle: int) -> Any:
        return self.fabric.telemetry(handle)

    def release_xfer_handle(self, handle: int) -> None:
        self.fabric.release(handle)

    # notifications and peers
    def send_notif(self, agent: str, notif_msg: bytes) -> None:
        self.fabric.notify(self.name, agent, notif_msg)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        return self.fabric.take_notifs(self.name)

    def add_remote_agent(self, agent: str) -> str:
        self.loaded.add(agent)
        return agent

    def remove_remote_agent(self, agent: str) -> None:
        self.loaded.discard(agent)

    def check_remote_metadata(self, agent: str) -> bool:
        return agent in self.loaded  # local existence of the metadata, not the peer's health (as NIXL)
