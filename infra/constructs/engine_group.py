"""One Auto Scaling group of engines of one role on one instance type, with capacity reservation targeting,
a terminate lifecycle hook (the node drains on it: ``turnkv engine drain``; Cloud Map deregistration runs on it
too) and a rolling replacement when the launch template changes (a new baked AMI, new user data).

The rolling update never takes the whole pool down: one instance at a time, and the next only after the new
one has signalled that its engine is healthy and registered (``infra.bootstrap`` sends the signal). Sizes,
surge and the hook's timeout come from ``infra.roll`` (where the roll's order and cost are stated too).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from aws_cdk import Duration
from aws_cdk import aws_autoscaling as autoscaling
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_iam as iam
from aws_cdk import aws_sns as sns
from constructs import Construct

from infra import roll
from infra.config import PoolConfig
from infra.roll import group_name
from turnkv.node_env import DRAIN_HOOK

from .efa_launch_template import EfaLaunchTemplate, EfaLaunchTemplateProps

#: How long CloudFormation waits for a new engine's signal (the most it allows: one hour).
SIGNAL_TIMEOUT = Duration.hours(1)


def group_logical_id(pool_name: str) -> str:
    """The Auto Scaling group's logical id: fixed, so the node's user data can name it in its signal."""
    return "EngineGroup" + "".join(part.capitalize() for part in re.split(r"[^a-z0-9]+", pool_name) if part)


@dataclass(frozen=True)
class EngineGroupProps:
    pool: PoolConfig
    deployment_prefix: str
    vpc: ec2.IVpc
    subnet: ec2.ISubnet
    machine_image: ec2.IMachineImage
    user_data: ec2.UserData
    role: iam.IRole
    security_group: ec2.ISecurityGroup
    #: The deployment's cluster placement group (None when no pool of the deployment launches into it).
    placement_group: ec2.IPlacementGroup | None
    notifications_topic: sns.ITopic
    #: A new instance loads weights and compiles before it is useful (minutes).
    health_grace_minutes: int = 30


class EngineGroup(Construct):
    """One pool's Auto Scaling group of engine instances (the router's live view of engines is
    ``router.engines.EnginePool``)."""

    def __init__(self, scope: Construct, construct_id: str, props: EngineGroupProps) -> None:
        super().__init__(scope, construct_id)
        pool = props.pool
        self.pool = pool
        self.group_name = group_name(props.deployment_prefix, pool.name)
        self.roll = roll.pool_roll(pool)
        max_size, in_service = self.roll.max_size, self.roll.min_in_service
        self.min_in_service = in_service
        # EC2: an instance uses a Capacity Reservation made in a cluster placement group only when it launches into
        # that group; a reservation outside any group is used only by instances outside groups; a Capacity Block
        # places its instances itself. Pools without a reservation share the deployment's cluster group.
        placement: ec2.IPlacementGroup | None = props.placement_group
        if pool.placement_group:
            placement = ec2.PlacementGroup.from_placement_group_name(self, "ReservationPlacementGroup",
                                                                      pool.placement_group)
        elif pool.capacity_reservation_id:
            placement = None
        self.template = EfaLaunchTemplate(self, "LaunchTemplate", EfaLaunchTemplateProps(
            instance_type=pool.instance_type,
            machine_image=props.machine_image,
            user_data=props.user_data,
            role=props.role,
            security_group=props.security_group,
            placement_group=placement,
            capacity_reservation_id=pool.capacity_reservation_id,
            capacity_block=pool.capacity_block,
            launch_template_name=self.group_name,
        ))
        self.group = autoscaling.AutoScalingGroup(
            self, "Group",
            auto_scaling_group_name=self.group_name,
            vpc=props.vpc,
            vpc_subnets=ec2.SubnetSelection(subnets=[props.subnet]),
            launch_template=self.template.launch_template,
            # min pins the pool size (max leaves room for one surge instance during a rolling update); no desired
            # capacity, so a deploy never resets a group an operator resized by hand (aws-cdk#5215).
            min_capacity=pool.count,
            max_capacity=max_size,
            health_checks=autoscaling.HealthChecks.ec2(grace_period=Duration.minutes(props.health_grace_minutes)),
            notifications=[autoscaling.NotificationConfiguration(topic=props.notifications_topic)],
            group_metrics=[autoscaling.GroupMetrics.all()],
            update_policy=autoscaling.UpdatePolicy.rolling_update(
                max_batch_size=1, min_instances_in_service=in_service, min_success_percentage=100,
                wait_on_resource_signals=True, pause_time=SIGNAL_TIMEOUT,
                suspend_processes=[autoscaling.ScalingProcess.HEALTH_CHECK,
                                   autoscaling.ScalingProcess.REPLACE_UNHEALTHY,
                                   autoscaling.ScalingProcess.AZ_REBALANCE,
                                   autoscaling.ScalingProcess.ALARM_NOTIFICATION,
                                   autoscaling.ScalingProcess.SCHEDULED_ACTIONS]),
        )
        cfn: autoscaling.CfnAutoScalingGroup = self.group.node.default_child  # type: ignore[assignment]
        cfn.override_logical_id(group_logical_id(pool.name))
        if pool.capacity_reservation_id and not pool.capacity_block:
            spec = autoscaling.CfnAutoScalingGroup
            cfn.capacity_reservation_specification = spec.CapacityReservationSpecificationProperty(
                capacity_reservation_preference="capacity-reservations-only",
                capacity_reservation_target=spec.CapacityReservationTargetProperty(
                    capacity_reservation_ids=[pool.capacity_reservation_id]),
            )
        # The node completes the action once drained (``turnkv engine drain``); CONTINUE after the timeout bounds a
        # node that cannot (already impaired, or its agent gone).
        self.terminate_hook = self.group.add_lifecycle_hook(
            "Deregister",
            lifecycle_hook_name=DRAIN_HOOK,
            lifecycle_transition=autoscaling.LifecycleTransition.INSTANCE_TERMINATING,
            default_result=autoscaling.DefaultResult.CONTINUE,
            heartbeat_timeout=Duration.seconds(self.roll.hook_timeout_s),
        )
