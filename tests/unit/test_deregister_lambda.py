"""The lifecycle-hook Lambda (infra/lambdas/deregister.py) against Cloud Map in moto server mode. It deregisters and
leaves the lifecycle action to the node's drain agent (tests/unit/test_drain.py)."""

from __future__ import annotations

import importlib.util

import boto3
import pytest

from infra.lambdas import DEREGISTER

REGION = "us-east-2"


@pytest.fixture(scope="module")
def sd(moto_url):
    return boto3.client("servicediscovery", region_name=REGION, endpoint_url=moto_url,
                        aws_access_key_id="testing", aws_secret_access_key="testing")


def _module():
    spec = importlib.util.spec_from_file_location("deregister_under_test", DEREGISTER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _handler(service_id: str, engines_per_node: dict[str, int] | None = None):
    module = _module()
    module.SERVICE_ID = service_id
    module.ENGINES_PER_NODE = engines_per_node or {}
    return module.handler


def test_deregisters_the_instance_and_leaves_the_lifecycle_action_to_the_node(sd):
    ns = sd.create_http_namespace(Name="turnkv-unit")["OperationId"]
    namespace_id = sd.get_operation(OperationId=ns)["Operation"]["Targets"]["NAMESPACE"]
    service_id = sd.create_service(Name="engines", NamespaceId=namespace_id)["Service"]["Id"]
    for iid in ("i-0aaa", "i-0bbb"):
        sd.register_instance(ServiceId=service_id, InstanceId=iid,
                             Attributes={"AWS_INSTANCE_IPV4": "10.0.0.1", "role": "decode"})
    event = {"detail": {"EC2InstanceId": "i-0aaa", "LifecycleHookName": "turnkv-drain",
                        "AutoScalingGroupName": "turnkv-unit-decode", "LifecycleActionToken": "tok-1"}}
    assert _handler(service_id)(event, None, sd=sd) == {"instance": "i-0aaa"}
    left = [i["Id"] for i in sd.list_instances(ServiceId=service_id)["Instances"]]
    assert left == ["i-0bbb"]
    # an instance that never registered (it died while loading): nothing to take out, no error (the hook's
    # timeout continues its termination)
    event["detail"]["EC2InstanceId"] = "i-0never"
    assert _handler(service_id)(event, None, sd=sd) == {"instance": "i-0never"}


def test_inline_code_fits_cloudformation_zipfile_limit():
    assert len(DEREGISTER.read_text().encode()) < 4096


def test_every_engine_of_a_node_that_runs_several_is_deregistered(sd):
    """A TP-4 node on p5en runs two engines, each its own Cloud Map instance (``<instance>`` and ``<instance>-1``,
    infra.bootstrap); the Lambda takes both out, and only that node's."""
    ns = sd.create_http_namespace(Name="turnkv-slots")["OperationId"]
    namespace_id = sd.get_operation(OperationId=ns)["Operation"]["Targets"]["NAMESPACE"]
    service_id = sd.create_service(Name="engines", NamespaceId=namespace_id)["Service"]["Id"]
    for iid in ("i-0ccc", "i-0ccc-1", "i-0ddd", "i-0ddd-1"):
        sd.register_instance(ServiceId=service_id, InstanceId=iid, Attributes={"AWS_INSTANCE_IPV4": "10.0.0.2"})
    event = {"detail": {"EC2InstanceId": "i-0ccc", "AutoScalingGroupName": "turnkv-slots-prefill"}}
    _handler(service_id, {"turnkv-slots-prefill": 2})(event, None, sd=sd)
    left = sorted(i["Id"] for i in sd.list_instances(ServiceId=service_id)["Instances"])
    assert left == ["i-0ddd", "i-0ddd-1"]


def test_the_lambda_names_a_nodes_engines_as_the_node_registers_them():
    from turnkv import node_env

    ids = _module().cloudmap_ids("i-0abc", 8)
    assert ids == [f"i-0abc{node_env.slot_suffix(k)}" for k in range(8)]
    assert _module().cloudmap_ids("i-0abc", 1) == ["i-0abc"]
