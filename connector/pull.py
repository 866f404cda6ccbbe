"""turnkv's pull-mode bi-directional connector: upstream NIXL pull + turnkv's scheduling.

Load it with ``--kv-transfer-config '{"kv_connector": "TurnkvPullConnector",
"kv_connector_module_path": "connector.pull", ...}'`` (``turnkv.engine_args`` does).

Decode READs prefill's KV, and the next turn's prefill READs decode's retained KV back. What turnkv adds
(token proof, retain on demand, adaptive threshold, hot reload) lives in ``connector.scheduler``; the
worker is upstream's, with transfers counted by direction and reads checked against decode's boot
(``connector.worker``).
"""

from __future__ import annotations

from typing import Any

from connector.compat import check_platform, check_vllm_version

check_vllm_version()

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (  # noqa: E402
    NixlBaseConnector,
    NixlPullConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (  # noqa: E402
    NixlPullConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker  # noqa: E402

from connector.scheduler import TurnkvSchedulerMixin  # noqa: E402
from connector.stats import TurnkvStatsReporting  # noqa: E402
from connector.worker import TurnkvWorkerMixin  # noqa: E402


class TurnkvPullScheduler(TurnkvSchedulerMixin, NixlPullConnectorScheduler):
    """Upstream's pull scheduler (bi-directional) plus turnkv's scheduling (``connector.scheduler``)."""


class TurnkvPullWorker(TurnkvWorkerMixin, NixlPullConnectorWorker):
    """Upstream's pull worker, with transfer metrics by direction, the decode-boot check on reads and inline reads
    of short pulls (``connector.inline``)."""

    turnkv_reads_inline = True


class TurnkvPullConnector(TurnkvStatsReporting, NixlPullConnector):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        check_platform()  # unverified platforms (Neuron) stop here, naming what is unverified
        # The base constructor, then turnkv's roles (NixlPullConnector's would build upstream's first).
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = TurnkvPullScheduler(vllm_config, self.engine_id, kv_cache_config)
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = TurnkvPullWorker(vllm_config, self.engine_id, kv_cache_config)
