"""One Auto Scaling group of engines of one role on one instance type, with capacity reservation targeting
and a terminate lifecycle hook (Cloud Map deregistration runs on it).
"""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import Duration
from aws_cdk import aws_autoscaling as autoscaling
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_iam as iam
from aws_cdk import aws_sns as sns
from constructs import Construct

from infra.config import PoolConfig

from .efa_launch_template import EfaLaunchTemplate, EfaLaunchTemplateProps


@dataclass(frozen=True)
class EnginePoolProps:
    pool: PoolConfig
    deployment_prefix: str
    vpc: ec2.IVpc
    subnet: ec2.ISubnet
    machine_image: ec2.IMachineImage
    user_data: ec2.UserData
    role: iam.IRole
    security_group: ec2.ISecurityGroup
    placement_group: ec2.IPlacementGroup
    notifications_topic: sns.ITopic
    #: A new instance loads weights and compiles before it is useful (minutes).
    health_grace_minutes: int = 30


class EnginePool(Construct):
    def __init__(self, scope: Construct, construct_id: str, props: EnginePoolProps) -> None:
        super().__init__(scope, construct_id)
        pool = props.pool
        self.pool = pool
        self.group_name = f"{props.deployment_prefix}-{pool.name}"
        self.template = EfaLaunchTemplate(self, "LaunchTemplate", EfaLaunchTemplateProps(
            instance_type=pool.instance_type,
            machine_image=props.machine_image,
            user_data=props.user_data,
            role=props.role,
            security_group=props.security_group,
            placement_group=None if pool.capacity_reservation_id else props.placement_group,
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
            # min = max pins the pool size; no desired capacity, so a deploy never resets a group an operator
            # resized by hand during an incident (aws-cdk#5215).
            min_capacity=pool.count,
            max_capacity=pool.count,
            health_checks=autoscaling.HealthChecks.ec2(grace_period=Duration.minutes(props.health_grace_minutes)),
            notifications=[autoscaling.NotificationConfiguration(topic=props.notifications_topic)],
            group_metrics=[autoscaling.GroupMetrics.all()],
            # A GPU pool is replaced by hand (capacity is scarce): no rolling update on template changes.
            update_policy=None,
        )
        cfn: autoscaling.CfnAutoScalingGroup = self.group.node.default_child  # type: ignore[assignment]
        if pool.capacity_reservation_id and not pool.capacity_block:
            spec = autoscaling.CfnAutoScalingGroup
            cfn.capacity_reservation_specification = spec.CapacityReservationSpecificationProperty(
                capacity_reservation_preference="capacity-reservations-only",
                capacity_reservation_target=spec.CapacityReservationTargetProperty(
                    capacity_reservation_ids=[pool.capacity_reservation_id]),
            )
        self.terminate_hook = self.group.add_lifecycle_hook(
            "Deregister",
            lifecycle_hook_name="turnkv-deregister",
            lifecycle_transition=autoscaling.LifecycleTransition.INSTANCE_TERMINATING,
            default_result=autoscaling.DefaultResult.CONTINUE,
            heartbeat_timeout=Duration.minutes(2),
        )
