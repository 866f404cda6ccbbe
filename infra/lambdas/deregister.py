"""ASG terminate lifecycle hook (via EventBridge): take the engine out of Cloud Map, then let it go.

Runs even when the instance is already unreachable, which the instance's own ExecStop cannot promise.
"""

import json
import os

import boto3

SERVICE_ID = os.environ.get("SERVICE_ID", "")
#: {Auto Scaling group name: engines each of its instances runs} (the serving stack writes it).
ENGINES_PER_NODE = json.loads(os.environ.get("ENGINES_PER_NODE") or "{}")


def cloudmap_ids(instance_id, engines):
    """The Cloud Map instance ids of a node's engines: the instance id, then ``<instance id>-<slot>`` for the
    others (turnkv.node_env.slot_suffix, which this file cannot import; a test ties the two)."""
    return [instance_id] + [f"{instance_id}-{slot}" for slot in range(1, max(1, engines))]


def handler(event, context, sd=None, asg=None):
    detail = event.get("detail", {})
    instance_id = detail.get("EC2InstanceId")
    sd = sd or boto3.client("servicediscovery")
    asg = asg or boto3.client("autoscaling")
    if instance_id:
        engines = int(ENGINES_PER_NODE.get(detail.get("AutoScalingGroupName", ""), 1))
        for cloudmap_id in cloudmap_ids(instance_id, engines):
            try:
                sd.deregister_instance(ServiceId=SERVICE_ID, InstanceId=cloudmap_id)
                print(f"deregistered {cloudmap_id} from {SERVICE_ID}")
            except sd.exceptions.InstanceNotFound:
                print(f"{cloudmap_id} was not registered in {SERVICE_ID}")
    if detail.get("LifecycleHookName") and detail.get("LifecycleActionToken"):
        asg.complete_lifecycle_action(
            LifecycleHookName=detail["LifecycleHookName"],
            AutoScalingGroupName=detail["AutoScalingGroupName"],
            LifecycleActionToken=detail["LifecycleActionToken"],
            LifecycleActionResult="CONTINUE",
            InstanceId=instance_id,
        )
    return {"instance": instance_id}
