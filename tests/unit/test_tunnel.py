"""``turnkv smoke --via-ssm`` (turnkv/tunnel.py): the Session Manager port-forwarding command it builds to reach an
internal ALB through one of the deployment's engine nodes, and the node it picks (EC2 in moto server mode)."""

from __future__ import annotations

import io
import json
import shlex
import subprocess
from typing import ClassVar

import boto3
import pytest
from typer.testing import CliRunner

from turnkv import tunnel
from turnkv.cli import app

REGION = "us-east-2"
ALB = "internal-turnkv-prod-Alb-123456789.us-east-2.elb.amazonaws.com"


def test_the_command_forwards_a_local_port_to_the_alb_through_the_node():
    host, port = tunnel.remote(f"http://{ALB}")
    assert (host, port) == (ALB, 80)
    assert tunnel.remote(f"https://{ALB}/")[1] == 443 and tunnel.remote(f"http://{ALB}:8080")[1] == 8080
    command = tunnel.start_session_command(REGION, "i-0abc", host, port, 18080)
    assert command[:9] == ["aws", "ssm", "start-session", "--region", REGION, "--target", "i-0abc",
                           "--document-name", "AWS-StartPortForwardingSessionToRemoteHost"]
    assert json.loads(command[10]) == {"host": [ALB], "portNumber": ["80"], "localPortNumber": ["18080"]}
    assert tunnel.local_url(f"http://{ALB}/", 18080) == "http://127.0.0.1:18080"
    with pytest.raises(tunnel.TunnelError):
        tunnel.remote("ALB")


def test_the_oldest_running_node_carries_the_tunnel():
    answer = [{"Instances": [
        {"InstanceId": "i-new", "State": {"Name": "running"}, "LaunchTime": "2026-12-08T01:00:00Z"},
        {"InstanceId": "i-old", "State": {"Name": "running"}, "LaunchTime": "2026-12-01T01:00:00Z"},
        {"InstanceId": "i-gone", "State": {"Name": "shutting-down"}, "LaunchTime": "2026-11-01T01:00:00Z"}]}]
    assert tunnel.pick_node(answer) == "i-old"
    with pytest.raises(tunnel.TunnelError, match="no running engine node"):
        tunnel.pick_node([])


class NoPlugin:
    """``aws ssm start-session`` on a workstation without the Session Manager plugin."""

    commands: ClassVar[list[list[str]]] = []

    def __init__(self, command, **kwargs):
        NoPlugin.commands.append(command)
        self.returncode = 255
        self.stderr = io.BytesIO(b"SessionManagerPlugin is not found.")

    def poll(self):
        return self.returncode

    def terminate(self):
        pass

    def wait(self, timeout=None):
        return self.returncode


def test_smoke_via_ssm_finds_a_node_of_the_deployment_and_runs_the_tunnel(moto_url, monkeypatch):
    for key, value in {"AWS_ENDPOINT_URL": moto_url, "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing"}.items():
        monkeypatch.setenv(key, value)
    ec2 = boto3.client("ec2", region_name=REGION, endpoint_url=moto_url)
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    for deployment in ("prod", "prod-x"):
        ec2.run_instances(ImageId=image, MinCount=1, MaxCount=1, TagSpecifications=[{
            "ResourceType": "instance", "Tags": [{"Key": tunnel.DEPLOYMENT_TAG, "Value": deployment}]}])
    prod = [i["InstanceId"] for r in ec2.describe_instances(Filters=tunnel.describe_filters("prod"))["Reservations"]
            for i in r["Instances"]]
    monkeypatch.setattr(subprocess, "Popen", NoPlugin)
    result = CliRunner().invoke(app, ["smoke", "--url", f"http://{ALB}", "--via-ssm", "-d", "prod",
                                      "--region", REGION])
    assert result.exit_code == 1, result.output
    (command,) = NoPlugin.commands
    assert command == tunnel.start_session_command(REGION, prod[0], ALB, 80, 18080)
    assert f"tunnel: {shlex.join(command)}" in result.output
    assert "SessionManagerPlugin is not found" in result.output

    refused = CliRunner().invoke(app, ["smoke", "--url", f"http://{ALB}", "--via-ssm"])
    assert refused.exit_code == 2 and "--deployment" in refused.output
