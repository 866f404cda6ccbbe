"""The router's security groups: clients -> ALB -> router tasks -> engines (Valkey's group is the store's own,
``infra.constructs.elasticache_store``). Scope-preserving (``infra.constructs``)."""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import aws_ec2 as ec2
from constructs import Construct

from infra.stacks.network import NetworkStack, https_egress
from turnkv import node_env, router_env


@dataclass(frozen=True)
class RouterAccessProps:
    network: NetworkStack
    #: The engines' security group (the serving stack's): the router reaches their HTTP port.
    engines: ec2.ISecurityGroup
    #: Who may reach the ALB listener (router.allowed_cidrs, or the VPC's CIDR when that is empty).
    client_cidrs: tuple[str, ...]
    #: HTTPS on 443 (HTTP on 80 then only redirects) when the router has a certificate; HTTP on 80 otherwise.
    https: bool
    #: The engines' HTTP ports, first and last (``ServingStack.http_ports``: one per engine a node runs).
    engine_ports: tuple[int, int] = (node_env.DEFAULT_PORT, node_env.DEFAULT_PORT)


class RouterAccess:
    """``alb_sg`` (the listener, from the client CIDRs) and ``router_sg`` (the tasks, from the ALB), and the
    engines' ingress rule from the router (here: a router -> serving dependency only, no cycle)."""

    def __init__(self, scope: Construct, props: RouterAccessProps) -> None:
        vpc = props.network.vpc
        self.alb_sg = ec2.SecurityGroup(scope, "AlbSecurityGroup", vpc=vpc, allow_all_outbound=False,
                                        description="turnkv ALB: the listener, from the allowed client CIDRs")
        listener_port = 443 if props.https else 80
        for i, cidr in enumerate(props.client_cidrs):
            peer = ec2.Peer.ipv6(cidr) if ":" in cidr else ec2.Peer.ipv4(cidr)
            self.alb_sg.add_ingress_rule(peer, ec2.Port.tcp(listener_port), f"clients {i}")
            if props.https:
                self.alb_sg.add_ingress_rule(peer, ec2.Port.tcp(80), f"clients {i}: redirect to HTTPS")
        self.router_sg = ec2.SecurityGroup(scope, "RouterSecurityGroup", vpc=vpc, allow_all_outbound=False,
                                           description="turnkv router tasks")
        self.router_sg.add_ingress_rule(self.alb_sg, ec2.Port.tcp(router_env.PORT), "from the ALB")
        self.alb_sg.add_egress_rule(self.router_sg, ec2.Port.tcp(router_env.PORT), "to the router tasks")
        https_egress(self.router_sg, props.network, "AWS APIs, ECR image layers")
        first, last = props.engine_ports
        port = ec2.Port.tcp(first) if first == last else ec2.Port.tcp_range(first, last)
        self.router_sg.add_egress_rule(props.engines, port,
                                       "to the engines' HTTP port" if first == last else "to the engines' HTTP ports")
        ec2.CfnSecurityGroupIngress(
            scope, "EngineFromRouter", group_id=props.engines.security_group_id, ip_protocol="tcp",
            from_port=first, to_port=last,
            source_security_group_id=self.router_sg.security_group_id, description="turnkv router to engines")
        # `turnkv smoke --via-ssm` (turnkv.tunnel): Session Manager forwards a workstation's port to the ALB through
        # an engine node, which therefore reaches the listener (the engines' group allows no other egress to it).
        self.alb_sg.add_ingress_rule(props.engines, ec2.Port.tcp(listener_port), "engine nodes: Session Manager "
                                                                                 "port forwarding (smoke --via-ssm)")
        ec2.CfnSecurityGroupEgress(
            scope, "EngineToAlb", group_id=props.engines.security_group_id, ip_protocol="tcp",
            from_port=listener_port, to_port=listener_port,
            destination_security_group_id=self.alb_sg.security_group_id,
            description="turnkv engine node to the router ALB: Session Manager port forwarding (smoke --via-ssm)")
