"""A stand-in for NIXL's C++ agent (``nixl._bindings.nixlAgent``) under NIXL's real Python API.

Only the C++ agent is replaced: ``nixl._api.nixl_agent`` (vLLM's ``NixlWrapper``) runs as shipped, and the
descriptor lists it builds are NIXL's own ``nixlRegDList`` / ``nixlXferDList``. The fake refuses what NIXL
refuses, read in NIXL's source (ai-dynamo/nixl at 1.0.1, src/core/nixl_agent.cpp and
src/infra/nixl_memory_section.cpp; the LIBFABRIC plugin's memory types as the pinned 1.5.1 wheel's
``libplugin_LIBFABRIC.so`` reports them):

- ``registerMem``: no backend for the memory type -> NOT_FOUND; a backend whose plugin does not support the type
  (LIBFABRIC: DRAM always, VRAM only when it found a CUDA or Neuron runtime) -> that backend fails, and with none
  left -> BACKEND. Overlapping registrations are accepted (NIXL: "For now trusting the user").
- ``prepXferDlist``: an unknown remote agent -> NOT_FOUND; any descriptor not inside one registered region of the
  same memory type and device id (``nixlBasicDesc::covers``) -> NOT_FOUND for that backend.
- ``makeXferReq``: a local handle that is not local or a remote one that is not remote, unequal or empty index
  lists, an index out of range, or a local/remote pair of unequal lengths -> INVALID_PARAM.

A posted transfer copies the bytes (the test's memory is host memory), so a READ's result can be checked, and its
notification reaches the remote agent. Nothing here talks to a network.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import types
from dataclasses import dataclass, field
from typing import Any

#: Memory types each plugin reports, by the runtime NIXL's LIBFABRIC topology detects (hwloc: Neuron or NVIDIA
#: accelerators next to the EFA devices). 1.5.1's plugin logs "Neuron runtime detected, adding VRAM support". The
#: only plugin the Neuron path uses; what UCX would do with Neuron memory is not modelled (it is not offered).
PLUGIN_MEMS: dict[str, dict[str, tuple[str, ...]]] = {
    "LIBFABRIC": {"neuron": ("DRAM", "VRAM"), "cuda": ("DRAM", "VRAM"), "system": ("DRAM",)},
}


@dataclass
class Region:
    addr: int
    length: int
    dev: int

    def covers(self, addr: int, length: int, dev: int) -> bool:
        return self.dev == dev and self.addr <= addr and self.addr + self.length >= addr + length


@dataclass
class Prepped:
    agent: str  # "" for local (NIXL_INIT_AGENT)
    mem: str
    descs: list[tuple[int, int, int]]
    backends: set[str]


@dataclass
class Xfer:
    op: str
    remote: str
    pairs: list[tuple[tuple[int, int, int], tuple[int, int, int]]]
    notif: bytes
    done: bool = False


@dataclass
class Fabric:
    """The agents of one test, by name: metadata bytes name an agent and its registered regions."""

    runtime: str = "neuron"
    agents: dict[str, FakeNixlCore] = field(default_factory=dict)


class FakeNixlCore:
    """NIXL's C++ ``nixlAgent`` as ``nixl._api.nixl_agent`` calls it, with every call recorded in ``calls``."""

    def __init__(self, bindings: Any, fabric: Fabric, name: str, config: Any) -> None:
        self._b, self.fabric, self.name = bindings, fabric, name
        self.config = config
        self.calls: list[tuple[str, Any]] = []
        self.backends: dict[str, str] = {}  # handle -> plugin name
        #: (memory type, backend) -> registered regions: NIXL's local section.
        self.section: dict[tuple[str, str], list[Region]] = {}
        self.remote_sections: dict[str, dict[tuple[str, str], list[Region]]] = {}
        self.prepped: dict[int, Prepped] = {}
        self.xfers: dict[int, Xfer] = {}
        self.notifs: dict[str, list[bytes]] = {}
        self._ids = itertools.count(1)
        fabric.agents[name] = self

    # backends ---------------------------------------------------------------------------------------------

    def getAvailPlugins(self) -> list[str]:
        return sorted(PLUGIN_MEMS)

    def _mems(self, plugin: str) -> list[str]:
        return [f"{m}_SEG" for m in PLUGIN_MEMS[plugin][self.fabric.runtime]]  # as the bindings name them

    def getPluginParams(self, plugin: str) -> tuple[dict[str, str], list[str]]:
        return {}, self._mems(plugin)

    def createBackend(self, plugin: str, params: dict[str, str]) -> str:
        if plugin not in PLUGIN_MEMS:
            raise self._b.nixlNotFoundError("NIXL_ERR_NOT_FOUND")
        handle = f"backend:{plugin}"
        self.backends[handle] = plugin
        self.calls.append(("createBackend", (plugin, dict(params))))
        return handle

    def getBackendParams(self, handle: str) -> tuple[dict[str, str], list[str]]:
        return {}, self._mems(self.backends[handle])

    def _supports(self, backend: str, mem: str) -> bool:
        return mem in PLUGIN_MEMS[self.backends[backend]][self.fabric.runtime]

    # memory -----------------------------------------------------------------------------------------------

    def _mem(self, dlist: Any) -> str:
        return dlist.getType().name.removesuffix("_SEG")

    def registerMem(self, descs: Any, handles: list[str]) -> None:
        mem = self._mem(descs)
        regions = [Region(int(a), int(n), int(d)) for a, n, d, *_ in (descs[i] for i in range(descs.descCount()))]
        self.calls.append(("registerMem", (mem, [(r.addr, r.length, r.dev) for r in regions],
                                           [self.backends[h] for h in handles])))
        backends = list(handles) or [h for h in self.backends if self._supports(h, mem)]
        if not backends:
            raise self._b.nixlNotFoundError(f"NIXL_ERR_NOT_FOUND: no available backends for mem type '{mem}'")
        count = 0
        for backend in backends:
            if not self._supports(backend, mem):  # the plugin's registerMem: NIXL_ERR_NOT_SUPPORTED
                continue
            self.section.setdefault((mem, backend), []).extend(regions)
            count += 1
        if not count:
            raise self._b.nixlBackendError(
                f"NIXL_ERR_BACKEND: registration failed for the specified or all potential backends ({mem} on "
                f"{[self.backends[b] for b in backends]} with a {self.fabric.runtime} runtime)")

    def deregisterMem(self, descs: Any, handles: list[str]) -> None:
        mem = self._mem(descs)
        self.calls.append(("deregisterMem", mem))
        for (m, _b), regions in self.section.items():
            if m == mem:
                for i in range(descs.descCount()):
                    a, n, d, *_ = descs[i]
                    regions[:] = [r for r in regions if (r.addr, r.length, r.dev) != (a, n, d)]

    def getLocalMD(self) -> bytes:
        sections = {f"{mem}|{self.backends[b]}": [[r.addr, r.length, r.dev] for r in regions]
                    for (mem, b), regions in self.section.items()}
        return json.dumps({"name": self.name, "sections": sections}).encode()

    def loadRemoteMD(self, metadata: bytes) -> str:
        blob = json.loads(metadata)
        plugins = {p: h for h, p in self.backends.items()}
        section: dict[tuple[str, str], list[Region]] = {}
        for key, regions in blob["sections"].items():
            mem, plugin = key.split("|")
            if plugin in plugins:  # a backend both sides have
                section[(mem, plugins[plugin])] = [Region(*r) for r in regions]
        self.remote_sections[blob["name"]] = section
        self.calls.append(("loadRemoteMD", blob["name"]))
        return blob["name"]

    def invalidateRemoteMD(self, name: str) -> None:
        self.remote_sections.pop(name, None)

    # transfers --------------------------------------------------------------------------------------------

    def prepXferDlist(self, agent: str, descs: Any, handles: list[str]) -> int:
        mem = self._mem(descs)
        rows = [tuple(int(v) for v in descs[i]) for i in range(descs.descCount())]
        local = agent == self._b.NIXL_INIT_AGENT
        if not local and agent not in self.remote_sections:
            raise self._b.nixlNotFoundError(f"NIXL_ERR_NOT_FOUND: metadata for remote agent '{agent}' not found")
        section = self.section if local else self.remote_sections[agent]
        candidates = list(handles) or [b for (m, b) in section if m == mem]
        if not candidates or not rows:
            raise self._b.nixlNotFoundError(f"NIXL_ERR_NOT_FOUND: no available backends for mem type '{mem}'")
        ok = {b for b in candidates
              if all(any(r.covers(*row) for r in section.get((mem, b), ())) for row in rows)}
        self.calls.append(("prepXferDlist", (agent, mem, rows, sorted(self.backends[b] for b in ok))))
        if not ok:
            raise self._b.nixlNotFoundError(
                f"NIXL_ERR_NOT_FOUND: failed to prepare the descriptors for any of the specified or potential "
                f"backends for agent '{agent or 'NIXL_INIT_AGENT'}' (a descriptor outside every registered region)")
        handle = next(self._ids)
        self.prepped[handle] = Prepped(agent, mem, rows, ok)
        return handle

    def releasedDlistH(self, handle: int) -> None:
        self.prepped.pop(int(handle), None)

    def makeXferReq(self, op: Any, local_h: int, local_idx: Any, remote_h: int, remote_idx: Any, notif: bytes,
                    handles: list[str], skip_merge: bool = False) -> int:
        local, remote = self.prepped.get(int(local_h)), self.prepped.get(int(remote_h))
        li, ri = [int(i) for i in local_idx], [int(i) for i in remote_idx]
        invalid = self._b.nixlInvalidParamError
        if local is None or remote is None or local.agent != "" or remote.agent == "":
            raise invalid("NIXL_ERR_INVALID_PARAM: invalid sides (local must be local, remote must be remote)")
        if remote.agent not in self.remote_sections:
            raise self._b.nixlNotFoundError(f"NIXL_ERR_NOT_FOUND: remote agent '{remote.agent}' was invalidated")
        if not (local.backends & remote.backends):
            raise invalid("NIXL_ERR_INVALID_PARAM: no common backend for the prepped lists")
        if not li or len(li) != len(ri):
            raise invalid(f"NIXL_ERR_INVALID_PARAM: different number of indices for local ({len(li)}), "
                          f"remote ({len(ri)})")
        pairs = []
        for n, (i, j) in enumerate(zip(li, ri, strict=True)):
            if not 0 <= i < len(local.descs):
                raise invalid(f"NIXL_ERR_INVALID_PARAM: local index out of range at index {n} with value {i}")
            if not 0 <= j < len(remote.descs):
                raise invalid(f"NIXL_ERR_INVALID_PARAM: remote index out of range at index {n} with value {j}")
            if local.descs[i][1] != remote.descs[j][1]:
                raise invalid(f"NIXL_ERR_INVALID_PARAM: length mismatch at index pair {n}")
            pairs.append((local.descs[i], remote.descs[j]))
        name = op.name.removeprefix("NIXL_")
        handle = next(self._ids)
        self.xfers[handle] = Xfer(name, remote.agent, pairs, bytes(notif))
        self.calls.append(("makeXferReq", (name, remote.agent, pairs, bytes(notif))))
        return handle

    def postXferReq(self, handle: int, notif: bytes = b"") -> Any:
        xfer = self.xfers[int(handle)]
        for (laddr, length, _), (raddr, _, _) in xfer.pairs:
            src, dst = (raddr, laddr) if xfer.op == "READ" else (laddr, raddr)
            ctypes.memmove(dst, src, length)
        xfer.done = True
        message = bytes(notif) or xfer.notif
        if message and xfer.remote in self.fabric.agents:
            self.fabric.agents[xfer.remote].notifs.setdefault(self.name, []).append(message)
        self.calls.append(("postXferReq", (xfer.op, xfer.remote, message)))
        return self._b.NIXL_SUCCESS

    def getXferStatus(self, handle: int) -> Any:
        return self._b.NIXL_SUCCESS if self.xfers[int(handle)].done else self._b.NIXL_IN_PROG

    def getXferTelemetry(self, handle: int) -> Any:
        xfer = self.xfers[int(handle)]
        return types.SimpleNamespace(startTime=0, postDuration=1, xferDuration=10, descCount=len(xfer.pairs),
                                     totalBytes=sum(p[0][1] for p in xfer.pairs))

    def releaseXferReq(self, handle: int) -> None:
        self.xfers.pop(int(handle), None)

    def genNotif(self, remote: str, message: bytes, *backend: Any) -> None:
        if remote not in self.remote_sections or remote not in self.fabric.agents:
            raise self._b.nixlNotFoundError(f"NIXL_ERR_NOT_FOUND: remote agent '{remote}' not found")
        self.fabric.agents[remote].notifs.setdefault(self.name, []).append(bytes(message))

    def getNotifs(self, into: dict[str, list[bytes]], handles: list[str]) -> dict[str, list[bytes]]:
        for agent, messages in self.notifs.items():
            into.setdefault(agent, []).extend(messages)
        self.notifs = {}
        return into


class FakeBindings(types.ModuleType):
    """``nixl._api.nixlBind`` with the C++ agent replaced by :class:`FakeNixlCore`; everything else is NIXL's."""

    def __init__(self, real: Any, fabric: Fabric) -> None:
        super().__init__(real.__name__)
        self._real, self.fabric = real, fabric

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def nixlAgent(self, name: str, config: Any) -> FakeNixlCore:
        return FakeNixlCore(self._real, self.fabric, name, config)
