"""Reach an internal ALB from a workstation: Session Manager port forwarding through one of the deployment's
engine nodes (``turnkv smoke --via-ssm``).

The default ALB is internal and the example VPC has no NAT: nothing outside the VPC reaches it. Every engine node
runs the SSM agent with Session Manager's permissions (the serving stack's engine role) and reaches the ALB on its
listener port (the router stack's egress rule), so the AWS-StartPortForwardingSessionToRemoteHost document
forwards a local port to the ALB through it. Needs the AWS CLI and its Session Manager plugin on the workstation,
and ``ssm:StartSession`` for the caller (AWS Systems Manager user guide, "Port forwarding to a remote host").

Pure: the command line and the node pick; the CLI runs them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

#: The Session Manager document that forwards a local port to a host the target instance reaches.
DOCUMENT = "AWS-StartPortForwardingSessionToRemoteHost"
#: Tag every engine instance carries (the stacks' tags propagate to the Auto Scaling groups' instances).
DEPLOYMENT_TAG = "turnkv:deployment"


class TunnelError(ValueError):
    pass


def remote(url: str) -> tuple[str, int]:
    """The ALB host and listener port of ``url`` (http: 80, https: 443 unless the URL names one)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TunnelError(f"--url {url!r}: pass the ALB's URL, http(s)://<AlbDnsName>")
    host = parts.netloc.rsplit("@", 1)[-1]
    host = host.rsplit(":", 1)[0] if parts.port else host  # as written (hostname would lowercase it)
    return host, parts.port or (443 if parts.scheme == "https" else 80)


def local_url(url: str, local_port: int) -> str:
    """``url`` with its host and port replaced by the tunnel's local end (path kept)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://127.0.0.1:{local_port}{parts.path.rstrip('/')}"


def start_session_command(region: str, instance_id: str, host: str, port: int, local_port: int) -> list[str]:
    """``aws ssm start-session`` forwarding ``127.0.0.1:local_port`` to ``host:port`` through ``instance_id``."""
    parameters = {"host": [host], "portNumber": [str(port)], "localPortNumber": [str(local_port)]}
    return ["aws", "ssm", "start-session", "--region", region, "--target", instance_id,
            "--document-name", DOCUMENT, "--parameters", json.dumps(parameters, separators=(",", ":"))]


def describe_filters(deployment: str) -> list[dict[str, Any]]:
    """EC2 DescribeInstances filters for the deployment's running engine nodes."""
    return [{"Name": f"tag:{DEPLOYMENT_TAG}", "Values": [deployment]},
            {"Name": "instance-state-name", "Values": ["running"]}]


def pick_node(reservations: Sequence[Mapping[str, Any]]) -> str:
    """An instance id from a DescribeInstances answer: the longest running one (the least likely to be in a roll)."""
    instances = [i for r in reservations for i in r.get("Instances", [])
                 if i.get("State", {}).get("Name") == "running"]
    if not instances:
        raise TunnelError("no running engine node of this deployment: the tunnel goes through one (check "
                          "--deployment and --region, and that the serving stack's pools are up)")
    return min(instances, key=lambda i: (str(i.get("LaunchTime", "")), i["InstanceId"]))["InstanceId"]
