"""Cloud Map discovery and the SSM re-read of tunables, against moto in server mode over HTTP."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import boto3
import pytest

from router.app import CONFIG, FLOW
from router.engines.discovery import CloudMapDiscovery
from router.reload import SsmSource, refresh_once
from tests.router.conftest import engines, free_port, router_over
from tests.router.test_flow_fake import chat

REGION = "us-east-2"


@pytest.fixture(scope="module")
def moto_url():
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture
def aws_env(monkeypatch):
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": REGION,
                 "AWS_REGION": REGION}.items():
        monkeypatch.setenv(k, v)


def register(sd, service_id, instance_id, role, engine_id, port, side_port):
    sd.register_instance(ServiceId=service_id, InstanceId=instance_id, Attributes={
        "AWS_INSTANCE_IPV4": "127.0.0.1", "AWS_INSTANCE_PORT": str(port), "role": role, "engine_id": engine_id,
        "side_channel_host": "127.0.0.1", "side_channel_port": str(side_port), "tp_size": "1",
        "http_port": str(port), "pool": "main"})


async def test_cloudmap_discovery_feeds_the_pool(moto_url, aws_env):
    sd = boto3.client("servicediscovery", region_name=REGION, endpoint_url=moto_url)
    op = sd.create_http_namespace(Name="turnkv-test")
    ns_id = sd.get_operation(OperationId=op["OperationId"])["Operation"]["Targets"]["NAMESPACE"]
    service_id = sd.create_service(Name="engines", NamespaceId=ns_id)["Service"]["Id"]
    p, d = engines(1, "prefill", mode="push"), engines(2, "decode", mode="push")
    register(sd, service_id, "i-p0", "prefill", "prefill-0", p[0].port, p[0].side_channel_port)
    register(sd, service_id, "i-d0", "decode", "decode-0", d[0].port, d[0].side_channel_port)
    register(sd, service_id, "i-bad", "decode", "decode-x", 0, 0)  # no usable port: skipped
    discovery = CloudMapDiscovery("turnkv-test", "engines", REGION, moto_url)
    found = await discovery.discover()
    assert [e.engine_id for e in found["prefill"]] == ["prefill-0"]
    assert found["prefill"][0].push_identity.port == p[0].side_channel_port
    async with router_over(p, d, mode="push", discovery="cloudmap", namespace="turnkv-test",
                           aws_endpoint_url=moto_url, region=REGION,
                           tunables={"discovery_interval": 1}) as (s, app):
        pool = app[FLOW].pool
        assert {e.name for e in pool.decode} == {"decode-0"}
        r = await chat(s, conversation=None)
        assert r["status"] == 200
        assert d[0].seen_params[-1]["remote_engine_id"] == "prefill-0"  # concurrent push: identity from Cloud Map
        register(sd, service_id, "i-d1", "decode", "decode-1", d[1].port, d[1].side_channel_port)
        sd.deregister_instance(ServiceId=service_id, InstanceId="i-d0")
        for _ in range(40):
            if {e.name for e in pool.decode} == {"decode-1"}:
                break
            await asyncio.sleep(0.1)
        assert {e.name for e in pool.decode} == {"decode-1"}
        assert (await chat(s, conversation=None))["status"] == 200 and d[1].stats["decode"] == 1


async def test_ssm_tunables_apply_without_restart_and_bad_values_keep_the_last_good(moto_url, aws_env):
    ssm = boto3.client("ssm", region_name=REGION, endpoint_url=moto_url)
    path = "/turnkv/t1/router/"
    ssm.put_parameter(Name=path + "prefill_retries", Value="5", Type="String", Overwrite=True)
    ssm.put_parameter(Name=path + "sse_keepalive", Value="abc", Type="String", Overwrite=True)
    ssm.put_parameter(Name="/turnkv/t1/engine/decoder_kv_blocks_ttl", Value="600", Type="String", Overwrite=True)
    p, d = engines(1, "prefill"), engines(1, "decode")
    async with router_over(p, d) as (_, app):
        config = app[CONFIG]
        source = SsmSource("t1", REGION, moto_url)
        errors = await refresh_once(config, source)
        assert config.tunables["prefill_retries"] == 5 and config.prefill_retries == 5
        assert config.tunables["decoder_kv_blocks_ttl"] == 600
        assert config.tunables["sse_keepalive"] == 15 and any("sse_keepalive" in e for e in errors)
        # a cross-tunable violation is refused whole
        ssm.put_parameter(Name=path + "sse_keepalive", Value="20", Type="String", Overwrite=True)
        ssm.put_parameter(Name=path + "conversation_ttl", Value="595", Type="String", Overwrite=True)
        errors = await refresh_once(config, source)
        assert config.tunables["conversation_ttl"] == 45 and config.tunables["sse_keepalive"] == 15
        assert any("must stay below" in e for e in errors)
        ssm.put_parameter(Name=path + "conversation_ttl", Value="300", Type="String", Overwrite=True)
        assert await refresh_once(config, source) == []
        assert config.tunables["conversation_ttl"] == 300 and config.entry_lifetime() == 300
        assert app[FLOW].pool.tunables is config.tunables  # the pool reads the same live values


async def test_the_container_command_line_serves_from_cloud_map(moto_url, aws_env, tmp_path, monkeypatch):
    """`turnkv router serve` with the flags router/Dockerfile + the infra stack pass (plus the moto endpoint)."""
    import os
    import subprocess
    import sys

    import aiohttp

    from bench.fake_engine import start
    from tests.router.test_flow_fake import MSGS

    sd = boto3.client("servicediscovery", region_name=REGION, endpoint_url=moto_url)
    op = sd.create_http_namespace(Name="turnkv-cli")
    ns_id = sd.get_operation(OperationId=op["OperationId"])["Operation"]["Targets"]["NAMESPACE"]
    service_id = sd.create_service(Name="engines", NamespaceId=ns_id)["Service"]["Id"]
    p, d = engines(1, "prefill"), engines(1, "decode")
    runners = await start(p + d)
    register(sd, service_id, "i-p", "prefill", "prefill-0", p[0].port, p[0].side_channel_port)
    register(sd, service_id, "i-d", "decode", "decode-0", d[0].port, d[0].side_channel_port)
    port = free_port()
    env = {**os.environ, "TURNKV_DEPLOYMENT": "cli", "TURNKV_API_KEYS": '{"keys": [], "initial": "initial-key-123"}',
           "TURNKV_METRICS_NAMESPACE": "turnkv/Router", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-m", "turnkv.cli", "router", "serve", "--host", "127.0.0.1", "--port",
                             str(port), "--discovery", "cloudmap", "--namespace", "turnkv-cli", "--service", "engines",
                             "--region", REGION, "--aws-endpoint-url", moto_url], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as s:
            for _ in range(100):
                try:
                    async with s.get("/ready") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
            body = {"model": "tiny", "messages": MSGS, "max_tokens": 3}
            async with s.post("/v1/chat/completions", json=body) as r:
                assert r.status == 401
            async with s.post("/v1/chat/completions", json=body,
                              headers={"Authorization": "Bearer initial-key-123"}) as r:
                assert r.status == 200
            async with s.get("/metrics") as r:
                text = await r.text()
                assert 'turnkv_router_params_reloads_total{result="unchanged"}' in text  # SSM on with cloudmap
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=10)
        for r in runners:
            await r.cleanup()
    emf = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    assert emf and emf[-1]["Deployment"] == "cli" and emf[-1]["status"] == 200


async def test_a_roll_drains_the_old_decode_node_without_cutting_its_stream(moto_url, aws_env):
    """Issue 46, a simulated roll of a one-node decode pool that can surge: the new node registers first, then the
    terminate hook's Lambda (infra/lambdas/deregister.py) takes the old one out of Cloud Map and the old node's drain
    (turnkv/drain.py) waits for its in-flight stream before it completes the lifecycle action. The stream that was
    running on the old node ends with 200 and the same text as the same turn with reuse off; the next turn is served
    by the new node."""
    import importlib.util
    import time
    import urllib.request

    from infra.lambdas import DEREGISTER
    from tests.router.test_flow_fake import MSGS, next_turn
    from turnkv import drain

    sd = boto3.client("servicediscovery", region_name=REGION, endpoint_url=moto_url)
    op = sd.create_http_namespace(Name="turnkv-roll")
    ns_id = sd.get_operation(OperationId=op["OperationId"])["Operation"]["Targets"]["NAMESPACE"]
    service_id = sd.create_service(Name="engines", NamespaceId=ns_id)["Service"]["Id"]
    p = engines(1, "prefill", request_marker=False)
    old, new = engines(2, "decode", request_marker=False)
    register(sd, service_id, "i-p0", "prefill", "prefill-0", p[0].port, p[0].side_channel_port)
    register(sd, service_id, "i-old", "decode", "decode-0", old.port, old.side_channel_port)
    spec = importlib.util.spec_from_file_location("deregister_in_roll", DEREGISTER)
    lam = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lam)
    lam.SERVICE_ID = service_id

    async with router_over(p, [old, new], discovery="cloudmap", namespace="turnkv-roll", aws_endpoint_url=moto_url,
                           region=REGION, tunables={"discovery_interval": 1}) as (s, app):
        pool = app[FLOW].pool
        first = await chat(s, conversation=None, stream=True)
        assert first["status"] == 200
        turn2 = next_turn(MSGS, first["text"])
        old.fault = {"token_delay": 0.4}  # a long stream, running on the old node while it is replaced
        in_flight = asyncio.create_task(chat(s, turn2, conversation=None, stream=True, max_tokens=8))
        for _ in range(50):
            if old.stats["running"]:
                break
            await asyncio.sleep(0.05)
        assert old.stats["running"] == 1

        # the roll: the new node is healthy and registered, then the old one's terminate hook fires
        register(sd, service_id, "i-new", "decode", "decode-1", new.port, new.side_channel_port)
        lam.handler({"detail": {"EC2InstanceId": "i-old", "AutoScalingGroupName": "turnkv-roll-decode"}}, None,
                    sd=sd)

        class OldNode:
            completed_at: float | None = None

            def lifecycle_state(self):
                return drain.TERMINATING

            def running(self):
                text = urllib.request.urlopen(f"http://127.0.0.1:{old.port}/metrics", timeout=5).read().decode()
                return drain.running_requests(text)

            def complete(self):
                OldNode.completed_at = time.monotonic()

            now = staticmethod(time.monotonic)
            sleep = staticmethod(time.sleep)

        drained = await asyncio.to_thread(drain.watch, OldNode(), 60, 2.0, 0.2)
        streamed = await in_flight
        finished = time.monotonic()
        assert streamed["status"] == 200 and drained.running == 0 and not drained.timed_out
        assert OldNode.completed_at is not None and OldNode.completed_at <= finished
        assert {e.name for e in pool.decode} == {"decode-1"}  # the routers dropped the old node while it drained
        old_served = old.stats["decode"]

        reference = await chat(s, turn2, conversation=None, stream=True, max_tokens=8,
                               headers={"X-TurnKV-Reuse": "off"})
        assert reference["status"] == 200 and streamed["text"] == reference["text"]
        third = await chat(s, next_turn(turn2, streamed["text"]), conversation=None, stream=True)
        assert third["status"] == 200 and old.stats["decode"] == old_served  # the new node serves
