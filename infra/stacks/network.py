"""Network: the VPC (new, or an existing one by id, no lookups), VPC endpoints so engines need no
internet path, and flow logs."""

from __future__ import annotations

from aws_cdk import RemovalPolicy, Stack
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_logs as logs
from aws_cdk import aws_ssm as ssm
from aws_cdk import custom_resources as cr
from constructs import Construct

from infra.config import PRIVATE_SUBNET_MASK, PUBLIC_SUBNET_MASK, DeploymentConfig

#: Interface endpoints the engines (SSM, Cloud Map, logs/metrics, autoscaling) and the router (ECR, logs,
#: Secrets Manager, SSM, Cloud Map) call. S3 is a gateway endpoint.
INTERFACE_ENDPOINTS = {
    "Ssm": ec2.InterfaceVpcEndpointAwsService.SSM,
    "SsmMessages": ec2.InterfaceVpcEndpointAwsService.SSM_MESSAGES,
    "Ec2Messages": ec2.InterfaceVpcEndpointAwsService.EC2_MESSAGES,
    "Logs": ec2.InterfaceVpcEndpointAwsService.CLOUDWATCH_LOGS,
    "Monitoring": ec2.InterfaceVpcEndpointAwsService.CLOUDWATCH_MONITORING,
    "Sts": ec2.InterfaceVpcEndpointAwsService.STS,
    "CloudMap": ec2.InterfaceVpcEndpointAwsService.CLOUD_MAP_SERVICE_DISCOVERY,
    "CloudMapData": ec2.InterfaceVpcEndpointAwsService.CLOUD_MAP_DATA_SERVICE_DISCOVERY,
    "EcrApi": ec2.InterfaceVpcEndpointAwsService.ECR,
    "EcrDocker": ec2.InterfaceVpcEndpointAwsService.ECR_DOCKER,
    "SecretsManager": ec2.InterfaceVpcEndpointAwsService.SECRETS_MANAGER,
    "Ec2": ec2.InterfaceVpcEndpointAwsService.EC2,
    # Engines signal CloudFormation when they serve (rolling replacement of a pool waits for it).
    "CloudFormation": ec2.InterfaceVpcEndpointAwsService.CLOUDFORMATION,
    # A node whose engine never serves marks itself unhealthy (autoscaling:SetInstanceHealth) to be replaced.
    "AutoScaling": ec2.InterfaceVpcEndpointAwsService.AUTOSCALING,
}


class NetworkStack(Stack):
    def __init__(self, scope: Construct, construct_id: str, *, config: DeploymentConfig, **kwargs) -> None:
        super().__init__(scope, construct_id, **kwargs)
        net = config.network
        self.config = config
        #: Set when the VPC has no NAT: the region's S3 prefix list (egress is narrowed to it and the VPC).
        self.s3_prefix_list_id: str | None = None
        if net.existing is not None:
            ex = net.existing
            self.vpc: ec2.IVpc = ec2.Vpc.from_vpc_attributes(
                self, "Vpc", vpc_id=ex.vpc_id, vpc_cidr_block=ex.cidr,
                availability_zones=list(net.availability_zones),
                private_subnet_ids=list(ex.private_subnet_ids),
                public_subnet_ids=list(ex.public_subnet_ids) or None,
            )
            # The VPC, its endpoints and flow logs are the owner's; record which one this deployment uses.
            ssm.StringParameter(self, "VpcId", parameter_name=f"/turnkv/{config.name}/network/vpc-id",
                                string_value=ex.vpc_id, description=f"VPC of turnkv deployment {config.name}")
            return
        private_type = (ec2.SubnetType.PRIVATE_WITH_EGRESS if net.nat_gateways
                        else ec2.SubnetType.PRIVATE_ISOLATED)
        flow_logs = logs.LogGroup(self, "FlowLogs", retention=_retention(net.flow_log_retention_days),
                                  removal_policy=RemovalPolicy.DESTROY)
        self.vpc = ec2.Vpc(
            self, "Vpc",
            vpc_name=config.prefix,
            ip_addresses=ec2.IpAddresses.cidr(net.cidr),
            availability_zones=list(net.availability_zones),
            nat_gateways=net.nat_gateways,
            subnet_configuration=[
                ec2.SubnetConfiguration(name="public", subnet_type=ec2.SubnetType.PUBLIC, cidr_mask=PUBLIC_SUBNET_MASK,
                                        map_public_ip_on_launch=False),
                ec2.SubnetConfiguration(name="private", subnet_type=private_type, cidr_mask=PRIVATE_SUBNET_MASK),
            ],
            flow_logs={"all": ec2.FlowLogOptions(
                destination=ec2.FlowLogDestination.to_cloud_watch_logs(flow_logs),
                traffic_type=ec2.FlowLogTrafficType.ALL)},
            restrict_default_security_group=True,
            gateway_endpoints={"S3": ec2.GatewayVpcEndpointOptions(service=ec2.GatewayVpcEndpointAwsService.S3)},
        )
        # Export every subnet (and the VPC) whether a stack imports it now or not: toggling router.public moves the
        # ALB between the public and private subnets, and an export that disappears while the deployed router
        # stack still imports it stops this stack's update (CloudFormation refuses to delete an imported export).
        for exported in (self.vpc.vpc_id, *(s.subnet_id for s in (*self.vpc.public_subnets, *self.private_subnets))):
            self.export_value(exported)
        if not net.nat_gateways:
            # No internet path: engines and router talk to the interface endpoints (VPC CIDR) and S3 through the
            # gateway endpoint, whose addresses are the region's S3 prefix list. Its id differs per region and
            # CloudFormation cannot name it, so a deploy-time lookup fetches it (synth stays offline).
            lookup = cr.AwsCustomResource(
                self, "S3PrefixList",
                on_update=cr.AwsSdkCall(
                    service="EC2", action="describeManagedPrefixLists",
                    parameters={"Filters": [{"Name": "prefix-list-name",
                                             "Values": [f"com.amazonaws.{self.region}.s3"]}]},
                    physical_resource_id=cr.PhysicalResourceId.of(f"s3-prefix-list-{self.region}"),
                    output_paths=["PrefixLists.0.PrefixListId"]),
                policy=cr.AwsCustomResourcePolicy.from_sdk_calls(resources=cr.AwsCustomResourcePolicy.ANY_RESOURCE),
                install_latest_aws_sdk=False,
                # its own log group, which `cdk destroy` removes (the function's default one outlives the stack)
                log_group=logs.LogGroup(self, "S3PrefixListLogs", retention=logs.RetentionDays.ONE_MONTH,
                                        removal_policy=RemovalPolicy.DESTROY))
            self.s3_prefix_list_id = lookup.get_response_field("PrefixLists.0.PrefixListId")
        private = ec2.SubnetSelection(subnet_type=private_type)
        # One group for all interface endpoints: HTTPS in from the VPC, nothing out (endpoints only answer).
        self.endpoint_sg = ec2.SecurityGroup(self, "EndpointSecurityGroup", vpc=self.vpc, allow_all_outbound=False,
                                             description="turnkv VPC interface endpoints: HTTPS from the VPC")
        self.endpoint_sg.add_ingress_rule(ec2.Peer.ipv4(net.cidr), ec2.Port.tcp(443), "HTTPS from the VPC")
        for name, service in INTERFACE_ENDPOINTS.items():
            self.vpc.add_interface_endpoint(name, service=service, subnets=private, private_dns_enabled=True,
                                            security_groups=[self.endpoint_sg], open=False)

    @property
    def private_subnets(self) -> list[ec2.ISubnet]:
        return self.vpc.private_subnets or self.vpc.isolated_subnets

    def engine_subnet(self) -> ec2.ISubnet:
        """The private subnet in the engines' AZ (one EFA pool lives in one subnet with its placement group)."""
        az = self.config.availability_zone
        for subnet in self.private_subnets:
            if subnet.availability_zone == az:
                return subnet
        raise ValueError(f"no private subnet in {az}")  # config validation makes this unreachable


#: CloudWatch Logs retention periods (the only values it takes), by their RetentionDays names.
_RETENTION = {1: "ONE_DAY", 3: "THREE_DAYS", 5: "FIVE_DAYS", 7: "ONE_WEEK", 14: "TWO_WEEKS", 30: "ONE_MONTH",
              60: "TWO_MONTHS", 90: "THREE_MONTHS", 120: "FOUR_MONTHS", 150: "FIVE_MONTHS", 180: "SIX_MONTHS",
              365: "ONE_YEAR", 400: "THIRTEEN_MONTHS", 545: "EIGHTEEN_MONTHS", 731: "TWO_YEARS", 1096: "THREE_YEARS",
              1827: "FIVE_YEARS", 2192: "SIX_YEARS", 2557: "SEVEN_YEARS", 2922: "EIGHT_YEARS", 3288: "NINE_YEARS",
              3653: "TEN_YEARS"}


def _retention(days: int) -> logs.RetentionDays:
    return getattr(logs.RetentionDays, _RETENTION[days])


def https_egress(group: ec2.SecurityGroup, network: NetworkStack, what: str) -> None:
    """HTTPS out: to the VPC (interface endpoints) and the S3 prefix list (gateway endpoint) when the VPC has no
    NAT, else anywhere (AWS APIs and model hubs through the NAT)."""
    if network.s3_prefix_list_id is None:
        group.add_egress_rule(ec2.Peer.any_ipv4(), ec2.Port.tcp(443), f"HTTPS: {what} (through the NAT or endpoints)")
        return
    group.add_egress_rule(ec2.Peer.ipv4(network.config.network.vpc_cidr), ec2.Port.tcp(443),
                          f"HTTPS to the VPC interface endpoints: {what}")
    group.add_egress_rule(ec2.Peer.prefix_list(network.s3_prefix_list_id), ec2.Port.tcp(443),
                          "HTTPS to S3 through the gateway endpoint")
