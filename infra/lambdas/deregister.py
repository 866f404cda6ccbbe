"""ASG terminate lifecycle hook (via EventBridge): take the engine out of Cloud Map, then let it go.

Runs even when the instance is already unreachable, which the instance's own ExecStop cannot promise.
"""

import os

import boto3

SERVICE_ID = os.environ.get("SERVICE_ID", "")


def handler(event, context, sd=None, asg=None):
    detail = event.get("detail", {})
    instance_id = detail.get("EC2InstanceId")
    sd = sd or boto3.client("servicediscovery")
    asg = asg or boto3.client("autoscaling")
    if instance_id:
        try:
            sd.deregister_instance(ServiceId=SERVICE_ID, InstanceId=instance_id)
            print(f"deregistered {instance_id} from {SERVICE_ID}")
        except sd.exceptions.InstanceNotFound:
            print(f"{instance_id} was not registered in {SERVICE_ID}")
    if detail.get("LifecycleHookName") and detail.get("LifecycleActionToken"):
        asg.complete_lifecycle_action(
            LifecycleHookName=detail["LifecycleHookName"],
            AutoScalingGroupName=detail["AutoScalingGroupName"],
            LifecycleActionToken=detail["LifecycleActionToken"],
            LifecycleActionResult="CONTINUE",
            InstanceId=instance_id,
        )
    return {"instance": instance_id}
