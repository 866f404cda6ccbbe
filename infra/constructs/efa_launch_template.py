"""A launch template with the EFA interface layout of its instance type (from ``infra.instances``).

The L2 ``LaunchTemplate`` has no network interfaces (aws-cdk#14494): it is given the security group (so
``connections`` works), then ``SecurityGroupIds`` is removed and ``NetworkInterfaces`` is set by override,
each interface carrying the group. No ``AssociatePublicIpAddress``: the subnets are private, and EC2 refuses the
key on a template with several network interfaces.
"""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_iam as iam
from constructs import Construct

from infra.instances import INSTANCE_TYPES, efa_layout


@dataclass(frozen=True)
class EfaLaunchTemplateProps:
    instance_type: str
    machine_image: ec2.IMachineImage
    user_data: ec2.UserData
    role: iam.IRole
    security_group: ec2.ISecurityGroup
    #: Cluster placement group; None with a targeted capacity reservation (the reservation decides placement).
    placement_group: ec2.IPlacementGroup | None = None
    #: Only for a Capacity Block (market type capacity-block + target, here); an On-Demand Capacity
    #: Reservation is targeted on the Auto Scaling group instead (EngineGroup).
    capacity_reservation_id: str | None = None
    capacity_block: bool = False
    root_volume_gib: int | None = None
    launch_template_name: str | None = None


class EfaLaunchTemplate(Construct):
    def __init__(self, scope: Construct, construct_id: str, props: EfaLaunchTemplateProps) -> None:
        super().__init__(scope, construct_id)
        profile = INSTANCE_TYPES[props.instance_type]
        self.layout = efa_layout(props.instance_type)
        self.launch_template = ec2.LaunchTemplate(
            self, "Resource",
            launch_template_name=props.launch_template_name,
            instance_type=ec2.InstanceType(props.instance_type),
            machine_image=props.machine_image,
            user_data=props.user_data,
            role=props.role,
            security_group=props.security_group,
            require_imdsv2=True,
            http_put_response_hop_limit=1,
            http_tokens=ec2.LaunchTemplateHttpTokens.REQUIRED,
            detailed_monitoring=True,
            ebs_optimized=True,
            block_devices=[ec2.BlockDevice(
                device_name="/dev/sda1",
                volume=ec2.BlockDeviceVolume.ebs(
                    props.root_volume_gib or profile.root_volume_gib, encrypted=True,
                    volume_type=ec2.EbsDeviceVolumeType.GP3, delete_on_termination=True, throughput=250,
                    iops=3000),
            )],
        )
        cfn: ec2.CfnLaunchTemplate = self.launch_template.node.default_child  # type: ignore[assignment]
        cfn.add_property_deletion_override("LaunchTemplateData.SecurityGroupIds")
        cfn.add_property_override("LaunchTemplateData.NetworkInterfaces", [
            {
                "NetworkCardIndex": slot.network_card_index,
                "DeviceIndex": slot.device_index,
                "InterfaceType": slot.interface_type,
                "Groups": [props.security_group.security_group_id],
                "DeleteOnTermination": True,
            }
            for slot in self.layout
        ])
        if props.placement_group is not None:
            cfn.add_property_override("LaunchTemplateData.Placement.GroupName",
                                      props.placement_group.placement_group_name)
        if props.capacity_block:
            cfn.add_property_override("LaunchTemplateData.InstanceMarketOptions.MarketType", "capacity-block")
            cfn.add_property_override(
                "LaunchTemplateData.CapacityReservationSpecification.CapacityReservationTarget.CapacityReservationId",
                props.capacity_reservation_id)
