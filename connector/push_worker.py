"""Push + bi-directional, worker side: upstream's push worker that can also READ decode's retained KV.

``reqs_to_recv`` then holds two kinds of request:
- decode waiting for prefill's WRITE (upstream push: no remote block ids, nothing to post);
- prefill reading the previous turn back from a decode engine (remote block ids given): posted as NIXL
  READs by the pull worker's code, on the engine thread, as in pull mode.
The writer thread keeps owning NIXL notifications; READ-completion notifications from a prefill that read
this engine's retained blocks reach ``_get_new_notifs`` like any other and release the blocks once every
reading rank has sent one. The reader (the pull worker's code) sends ``"{request}:{readers}"``, the number of its
ranks reading each of this engine's ranks (2 for prefill TP 8 reading decode TP 4), but upstream push counts a
tracked request's ``"{request}:{n}"`` as ``n // world_size`` readers when ``n > world_size``, else one: decode
freed the blocks after the first READ while the second rank was still reading. :class:`RetainedReadNotifs`
restates the count in push's terms (``readers x world_size``) as the engine thread takes it. The UCX
worker is shared by both threads: with bi-directional on, the agent is created with NIXL's strict thread sync
on every platform (``connector.nixl_agent``).

A peer that restarted under the same engine id and address is handshaken again, as the pull worker does
(``connector.worker``; upstream leaves push mode a TODO). Without it a push prefill kept WRITEing to the dead
process of a restarted decode (and a push decode kept sending registrations to a restarted prefill): every
decode leg paired with it waited for KV that never came, until the router's ``first_token_timeout`` (13 legs
of 30 s each in a 150 s fault run). A failed WRITE or registration marks the peer stale (writer thread); the
engine thread releases its handshake once no READ from it, no WRITE into it and no handshake with it is in
flight, holding the lock the writer holds while it WRITEs or registers, so neither thread sees the peer half
released. The next WRITE or registration handshakes with the process serving there now.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
from collections.abc import Callable, Iterable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker

from connector import compat, nixl_agent
from connector.worker import TurnkvWorkerMixin
from turnkv import wire

logger = logging.getLogger(__name__)

#: Upstream failure types of push traffic to a peer (``_log_failure``): WRITEs posted by prefill, and the
#: registrations decode sends; either one failing means the handshake with that peer may be stale.
STALE_PEER_FAILURES = ("transfer_setup_failed", "push_reg_notif_failed")


def releasable(stale: Iterable[str], handshaken: Iterable[str], reading: Iterable[str],
               handshaking: Iterable[str], writing: Iterable[str] = ()) -> set[str]:
    """Stale peers whose handshake can be released now: still handshaken, no READ from them, no WRITE into them
    and no new handshake with them in flight (pure). A WRITE posted before the peer went stale still uses its
    descriptors until NIXL reports it done or failed."""
    return (set(stale) & set(handshaken)) - set(reading) - set(writing) - set(handshaking)


def push_read_notif(msg: bytes, world_size: int, retained: Callable[[str], bool]) -> bytes:
    """A READ-completion notification for a retained request, restated so upstream push counts its readers (pure).

    Pull readers send ``"{request}:{readers}"``; push's counter expects ``readers x world_size`` there (it waits for
    ``n // world_size`` notifications when ``n > world_size``, else for one). Heartbeats, WRITE completions (requests
    this engine does not retain) and anything unparsable pass unchanged."""
    try:
        text = msg.decode("utf-8")
    except UnicodeDecodeError:
        return msg
    req_id, sep, count = text.rpartition(":")
    if not sep or text.startswith("HB:") or not count.isdigit() or not retained(req_id):
        return msg
    return f"{req_id}:{max(1, int(count)) * max(1, world_size)}".encode()


#: What the engine thread is handed in place of a fork-readable turn's read notification (``connector.worker.ForkReads``
#: counted it): an empty heartbeat, which renews nothing.
KEPT_FOR_FORKS = b"HB:"


class RetainedReadNotifs(queue.Queue):
    """The writer thread's hand-over queue of notifications, read by upstream's ``_get_new_notifs``: a retained
    request's READ-completion notification is restated (:func:`push_read_notif`) when the engine thread takes it,
    where the retained set is that thread's own state (no race with the writer)."""

    def __init__(self, worker: Any) -> None:
        super().__init__()
        self._worker = worker

    def _get(self) -> bytes:
        w = self._worker
        msg = super()._get()
        if w._turnkv_fork_reads.take(msg):
            return KEPT_FOR_FORKS  # a fork-readable turn's read: counted there, kept from upstream
        return push_read_notif(msg, int(getattr(w, "world_size", 1) or 1),
                               lambda rid: rid in w._reqs_to_send or rid in w._reqs_to_process)


def is_read_back(meta: Any) -> bool:
    """A receive that READs decode's blocks (prefill side), not one that waits for a WRITE (decode side)."""
    remote = getattr(meta, "remote", None)
    return bool(remote is not None and any(len(group) for group in remote.block_ids or ()))


# MRO: turnkv's mixin, then push's methods (start_load_kv, notifications, writer thread), then pull's READ
# helpers.
class PushBidiWorker(TurnkvWorkerMixin, NixlPushConnectorWorker, NixlPullConnectorWorker):
    _turnkv_filters_nixl_notifs = False  # the writer thread takes NIXL's notifications: filtered off its queue
    def __init__(self, vllm_config: Any, engine_id: str, *args: Any, **kwargs: Any) -> None:
        # Before upstream's __init__: it starts the writer thread, which may WRITE at once.
        self._turnkv_peer_lock = threading.RLock()
        self._turnkv_stale_peers: set[str] = set()
        self._turnkv_sending_to: str | None = None
        # Writer thread: the decode engine each pushing request WRITEs into (pruned once its WRITEs are done).
        self._turnkv_writing_to: dict[str, str] = {}
        transfer = vllm_config.kv_transfer_config
        if nixl_agent.needs_strict_sync(transfer.kv_connector, transfer.kv_connector_extra_config):
            with nixl_agent.strict_thread_sync(base_worker):
                super().__init__(vllm_config, engine_id, *args, **kwargs)
        else:
            super().__init__(vllm_config, engine_id, *args, **kwargs)
        # Before the writer thread starts (register_kv_caches): it puts every non-registration notification here.
        self._pending_completion_notifs = RetainedReadNotifs(self)

    # restarted peers (see the module docstring) ----------------------------------------------------

    def _log_failure(self, failure_type: str, *args: Any, **kwargs: Any) -> Any:
        if failure_type in STALE_PEER_FAILURES:
            peer = kwargs.get("dst_engine_id") or self._turnkv_sending_to
            if peer:
                with self._turnkv_peer_lock:
                    self._turnkv_stale_peers.add(str(peer))
        return super()._log_failure(failure_type, *args, **kwargs)  # type: ignore[misc]

    def _do_start_push_kv(self, *args: Any, **kwargs: Any) -> Any:
        with self._turnkv_peer_lock:
            return super()._do_start_push_kv(*args, **kwargs)  # type: ignore[misc]

    def _xfer_blocks_for_req(self, req_id: str, meta: Any) -> Any:
        """Writer thread, under the peer lock: note the engine this request's WRITEs go to."""
        with self._sending_transfers_lock:
            for done in [r for r in self._turnkv_writing_to if r not in self._sending_transfers]:
                del self._turnkv_writing_to[done]
            self._turnkv_writing_to[req_id] = str(meta.remote.engine_id)
        return super()._xfer_blocks_for_req(req_id, meta)  # type: ignore[misc]

    def _engines_with_inflight_writes(self) -> set[str]:
        """Decode engines a WRITE of this engine is still in flight to (upstream tracks READs only)."""
        with self._sending_transfers_lock:
            return {engine for req_id, engine in self._turnkv_writing_to.items()
                    if self._sending_transfers.get(req_id)}

    def _do_send_reg_notif(self, req_id: str, reg_data: dict[str, Any]) -> Any:
        with self._turnkv_peer_lock:
            self._turnkv_sending_to = reg_data.get(wire.REMOTE_ENGINE_ID)  # upstream's registration copies the key
            try:
                return super()._do_send_reg_notif(req_id, reg_data)  # type: ignore[misc]
            finally:
                self._turnkv_sending_to = None

    def _cleanup_remote_engines(self) -> None:
        """Engine thread, every step: release the handshakes of stale peers (and of peers the boot check
        invalidated, which upstream releases only in pull mode), then upstream's own cleanup."""
        if self._turnkv_stale_peers or getattr(self, "_invalid_remote_engines", None):  # else no lock taken
            with self._turnkv_peer_lock:
                self._turnkv_release_stale_peers()
        super()._cleanup_remote_engines()

    def _turnkv_release_stale_peers(self) -> None:
        stale = self._turnkv_stale_peers | set(getattr(self, "_invalid_remote_engines", ()))
        with self._handshake_lock:
            handshaken, handshaking = set(self._remote_agents), set(self._handshake_futures)
        released = set()
        for engine_id in releasable(stale, handshaken, self._engines_with_inflight_transfers(), handshaking,
                                    self._engines_with_inflight_writes()):
            logger.warning("turnkv: traffic to %s failed: handshaking with it again", engine_id)
            try:
                self._cleanup_remote_engine(engine_id, log_eviction=False)
            except Exception:  # it stays stale: tried again next step
                logger.exception("turnkv: could not release the handshake with %s", engine_id)
                continue
            released.add(engine_id)
        self._turnkv_stale_peers -= released | (stale - handshaken)

    def start_load_kv(self, metadata: Any) -> None:
        reads = {rid: meta for rid, meta in metadata.reqs_to_recv.items() if is_read_back(meta)}
        if reads:
            rest = copy.copy(metadata)
            rest.reqs_to_recv = {rid: m for rid, m in metadata.reqs_to_recv.items() if rid not in reads}
            metadata = rest
        super().start_load_kv(metadata)  # the mixin notes every read's expected boot; push takes the rest
        for req_id, meta in reads.items():
            meta.local_physical_block_ids = self._logical_to_kernel_block_ids(
                meta.local_block_ids, self._physical_blocks_per_logical_kv_block)
            # As the running release's pull worker posts it (a full local hit only notifies decode).
            compat.start_read(self, req_id, meta)
        # READs whose handshake finished in the background since the last step.
        while not self._ready_requests.empty():
            self._read_blocks_for_req(*self._ready_requests.get_nowait())
