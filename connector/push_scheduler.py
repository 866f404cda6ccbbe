"""Push + bi-directional, scheduler side: upstream's push scheduler taught to read decode's KV back.

Upstream (vLLM 0.32/0.33) refuses ``bidirectional_kv_xfer`` in push mode. What this class adds:

- **Prefill, a turn with stored decode params** (``do_remote_decode`` plus decode's ``remote_block_ids``):
  the reusable prefix is loaded asynchronously with a NIXL READ from the engine that decoded the previous
  turn (the pull scheduler's bi-directional path, unchanged), prefill computes only the new tokens, and
  the finished request is pushed as usual: the push worker WRITEs all of its blocks, pulled and
  computed, into the blocks the new decode engine registered in advance.
- **Decode, a finished turn**: its blocks are kept for ``decoder_kv_blocks_ttl`` and its params returned,
  as the pull scheduler does in bi-directional mode (so prefill and decode may be other engines next turn).

Everything else (registrations, the writer thread, leases) is upstream's push path.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import NixlPushConnectorScheduler

from turnkv import wire

_BIDI_KEY = "bidirectional_kv_xfer"


class PushBidiScheduler(NixlPushConnectorScheduler):
    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        # Upstream's constructor raises NotImplementedError when bi-directional is configured: build it as
        # plain push, then switch bi-directional on (the setting is read only in that constructor).
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        bidirectional = bool(extra.get(_BIDI_KEY, False))
        extra[_BIDI_KEY] = False
        try:
            super().__init__(vllm_config, engine_id, kv_cache_config)
        finally:
            extra[_BIDI_KEY] = bidirectional
        self.is_bidirectional_kv_xfer_enabled = bidirectional

    def _reads_back(self, params: dict[str, Any] | None) -> bool:
        """Prefill of a turn that may READ decode's retained KV (pull's bi-directional path applies)."""
        return bool(self.is_bidirectional_kv_xfer_enabled and wire.KVParams.from_params(params).do_remote_decode)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if self._reads_back(request.kv_transfer_params):
            return NixlPullConnectorScheduler.get_num_new_matched_tokens(self, request, num_computed_tokens)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self._reads_back(request.kv_transfer_params):
            # Queues the READ (reqs_to_recv with decode's block ids) and marks the request in-batch for
            # its push lease, exactly as the pull scheduler does for a bi-directional prefill.
            NixlPullConnectorScheduler.update_state_after_alloc(self, request, blocks, num_external_tokens)
            return
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        decode_done = (self.is_bidirectional_kv_xfer_enabled and params
                       and not params.get(wire.DO_REMOTE_DECODE) and not params.get(wire.DO_REMOTE_PREFILL))
        if not decode_done:
            return super().request_finished(request, block_ids)
        # Decode finished a turn it received by push: keep its blocks for the next turn's READ.
        self._push_registration_deadlines.pop(request.request_id, None)
        delay, out = NixlPullConnectorScheduler.request_finished(self, request, block_ids)
        if delay:
            # The worker accepts a lease only for in-batch requests. Marked here, not at allocation: while
            # the push is in flight, the request must not look like one of ours that a peer is reading,
            # or prefill's WRITE-completion notification would be taken for a read of retained blocks.
            self._reqs_in_batch.add(request.request_id)
        return delay, out
