"""turnkv's push-mode bi-directional connector.

Load it with ``--kv-transfer-config '{"kv_connector": "TurnkvPushConnector",
"kv_connector_module_path": "connector.push", "kv_connector_extra_config":
{"bidirectional_kv_xfer": true, ...}}'`` on prefill and decode (``turnkv.engine_args`` does).

Decode registers its blocks with prefill before prefill starts; prefill READs the previous turn back
from whichever decode engine holds it (``connector.push_scheduler``, ``connector.push_worker``),
computes the new tokens, and WRITEs the whole KV into the new decode engine's blocks from upstream's
``nixl-push-writer`` thread. turnkv's scheduling (token proof, retain on demand, adaptive threshold, hot
reload) is the pull connector's (``connector.scheduler``).
"""

from __future__ import annotations

from typing import Any

from connector.compat import check_platform, check_vllm_version

check_vllm_version()

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (  # noqa: E402
    NixlBaseConnector,
    NixlPushConnector,
)

from connector.push_scheduler import PushBidiScheduler  # noqa: E402
from connector.push_worker import PushBidiWorker  # noqa: E402
from connector.scheduler import TurnkvSchedulerMixin  # noqa: E402
from connector.stats import TurnkvStatsReporting  # noqa: E402


class TurnkvPushScheduler(TurnkvSchedulerMixin, PushBidiScheduler):
    """Push + bi-directional scheduling plus turnkv's (``connector.scheduler``)."""


class TurnkvPushConnector(TurnkvStatsReporting, NixlPushConnector):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        check_platform()  # unverified platforms (Neuron) stop here, naming what is unverified
        # NixlPushConnector's constructor would build upstream's push scheduler, which refuses
        # bi-directional transfer: run the base constructor and build turnkv's roles instead.
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        if vllm_config.parallel_config.decode_context_parallel_size > 1:
            raise ValueError("TurnkvPushConnector does not support decode_context_parallel_size > 1.")
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = TurnkvPushScheduler(vllm_config, self.engine_id, kv_cache_config)
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = PushBidiWorker(vllm_config, self.engine_id, kv_cache_config)
        else:
            raise ValueError(f"Unsupported KVConnectorRole: {role}")
