"""ASG terminate lifecycle hook (via EventBridge): take the engine out of Cloud Map at once.

Runs even when the instance is already unreachable, which the instance's own ExecStop cannot promise. It does not
complete the lifecycle action: the node's drain agent does once its in-flight streams finished
(``turnkv engine drain``), and the hook's heartbeat timeout continues the termination of a node that cannot.
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


def handler(event, context, sd=None):
    detail = event.get("detail", {})
    instance_id = detail.get("EC2InstanceId")
    sd = sd or boto3.client("servicediscovery")
    if instance_id:
        engines = int(ENGINES_PER_NODE.get(detail.get("AutoScalingGroupName", ""), 1))
        for cloudmap_id in cloudmap_ids(instance_id, engines):
            try:
                sd.deregister_instance(ServiceId=SERVICE_ID, InstanceId=cloudmap_id)
                print(f"deregistered {cloudmap_id} from {SERVICE_ID}")
            except sd.exceptions.InstanceNotFound:
                print(f"{cloudmap_id} was not registered in {SERVICE_ID}")
    return {"instance": instance_id}
