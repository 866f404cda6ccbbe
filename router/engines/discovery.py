"""Engine discovery: static flags, or AWS Cloud Map (``servicediscovery:DiscoverInstances``).

The infra engines register with attributes ``AWS_INSTANCE_IPV4``, ``AWS_INSTANCE_PORT``, ``role``,
``engine_id``, ``side_channel_host``, ``side_channel_port``, ``tp_size``, ``http_port`` (and
``pool``). ``engines_from_instances`` is pure; ``CloudMapDiscovery`` does the API call in a thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from router.engines import ROLES, Engine, join_host_port

log = logging.getLogger("turnkv.router")


def engines_from_instances(instances: Iterable[Mapping[str, Any]]) -> dict[str, list[Engine]]:
    """Cloud Map ``Instances`` -> engines by role; instances missing an address or a role are skipped."""
    out: dict[str, list[Engine]] = {role: [] for role in ROLES}
    for inst in instances:
        attrs = inst.get("Attributes") or {}
        role = attrs.get("role")
        host = attrs.get("AWS_INSTANCE_IPV4") or attrs.get("AWS_INSTANCE_IPV6") or attrs.get("side_channel_host")
        port = attrs.get("http_port") or attrs.get("AWS_INSTANCE_PORT")
        if role not in out or not host or not str(port).isdigit() or not 0 < int(port) < 65536:
            log.warning("Cloud Map instance %s skipped: needs role, an address and a port (got %s)",
                        inst.get("InstanceId"), sorted(attrs))
            continue
        try:
            out[role].append(Engine(
                f"http://{join_host_port(host, port)}", role, engine_id=attrs.get("engine_id", ""),
                side_channel_host=attrs.get("side_channel_host", host),
                side_channel_port=int(attrs.get("side_channel_port") or 0), tp_size=int(attrs.get("tp_size") or 1)))
        except ValueError as exc:
            log.warning("Cloud Map instance %s skipped: %s", inst.get("InstanceId"), exc)
    return out


class CloudMapDiscovery:
    def __init__(self, namespace: str, service: str, region: str | None = None, endpoint_url: str | None = None,
                 client: Any = None) -> None:
        self.namespace, self.service = namespace, service
        if client is None:
            import boto3
            from botocore.config import Config

            # DiscoverInstances goes to data-servicediscovery.*; an override endpoint (moto) has no such host.
            cfg = Config(inject_host_prefix=endpoint_url is None, retries={"max_attempts": 2},
                         connect_timeout=3, read_timeout=5)
            client = boto3.client("servicediscovery", region_name=region, endpoint_url=endpoint_url, config=cfg)
        self.client = client

    def _discover(self) -> list[dict[str, Any]]:
        resp = self.client.discover_instances(NamespaceName=self.namespace, ServiceName=self.service,
                                              HealthStatus="ALL", MaxResults=1000)
        return resp.get("Instances", [])

    async def discover(self) -> dict[str, list[Engine]]:
        return engines_from_instances(await asyncio.to_thread(self._discover))
