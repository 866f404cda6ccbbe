"""Push + bi-directional, worker side: upstream's push worker that can also READ decode's retained KV.

``reqs_to_recv`` then holds two kinds of request:
- decode waiting for prefill's WRITE (upstream push: no remote block ids, nothing to post);
- prefill reading the previous turn back from a decode engine (remote block ids given): posted as NIXL
  READs by the pull worker's code, on the engine thread, as in pull mode.
The writer thread keeps owning NIXL notifications; READ-completion notifications from a prefill that read
this engine's retained blocks reach ``_get_new_notifs`` like any other and release the blocks. The UCX
worker is shared by both threads: with bi-directional on, the agent is created with NIXL's strict thread sync
on every platform (``connector.nixl_agent``).
"""

from __future__ import annotations

import copy
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker

from connector import compat, nixl_agent
from connector.worker import TurnkvWorkerMixin


def is_read_back(meta: Any) -> bool:
    """A receive that READs decode's blocks (prefill side), not one that waits for a WRITE (decode side)."""
    remote = getattr(meta, "remote", None)
    return bool(remote is not None and any(len(group) for group in remote.block_ids or ()))


# MRO: turnkv's mixin, then push's methods (start_load_kv, notifications, writer thread), then pull's READ
# helpers.
class PushBidiWorker(TurnkvWorkerMixin, NixlPushConnectorWorker, NixlPullConnectorWorker):
    def __init__(self, vllm_config: Any, engine_id: str, *args: Any, **kwargs: Any) -> None:
        transfer = vllm_config.kv_transfer_config
        if nixl_agent.needs_strict_sync(transfer.kv_connector, transfer.kv_connector_extra_config):
            with nixl_agent.strict_thread_sync(base_worker):
                super().__init__(vllm_config, engine_id, *args, **kwargs)
        else:
            super().__init__(vllm_config, engine_id, *args, **kwargs)

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
