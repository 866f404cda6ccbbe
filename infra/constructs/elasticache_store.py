"""The router's shared conversation store: ElastiCache Serverless (Valkey) with TLS and RBAC, reachable from the
router tasks only. Scope-preserving (``infra.constructs``).

Authentication (an RBAC user group) on top of TLS: the store also holds the conversation-key HMAC secret. The
router's user and password come from Secrets Manager; the default user is switched off.
"""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import RemovalPolicy
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_elasticache as elasticache
from aws_cdk import aws_secretsmanager as secretsmanager
from constructs import Construct

VALKEY_PORT = 6379
VALKEY_USER = "turnkv-router"
#: The default user's access string: switched off, no command allowed.
VALKEY_DEFAULT_ACCESS = "off -@all"


@dataclass(frozen=True)
class ElastiCacheStoreProps:
    #: Resource-name prefix (DeploymentConfig.prefix).
    prefix: str
    vpc: ec2.IVpc
    subnets: tuple[ec2.ISubnet, ...]
    #: The router tasks' group: the only client (ingress on the store's group, egress on this one).
    clients: ec2.SecurityGroup


class ElastiCacheStore:
    """``security_group``, ``credentials`` (the router's user: ``username``/``password``), ``default_credentials``
    (the switched-off default user's), ``cache`` and ``url`` (``rediss://host:port``). The router's client of
    this store is ``router.state.valkey.ValkeyStore``."""

    def __init__(self, scope: Construct, props: ElastiCacheStoreProps) -> None:
        prefix = props.prefix
        self.security_group = ec2.SecurityGroup(scope, "ValkeySecurityGroup", vpc=props.vpc, allow_all_outbound=False,
                                                description="turnkv conversation store (Valkey): router only")
        self.security_group.add_ingress_rule(props.clients, ec2.Port.tcp(VALKEY_PORT), "from the router")
        props.clients.add_egress_rule(self.security_group, ec2.Port.tcp(VALKEY_PORT), "to Valkey")
        self.credentials = secretsmanager.Secret(
            scope, "ValkeyCredentials", secret_name=f"{prefix}/valkey-router",
            description="turnkv router's Valkey (ElastiCache RBAC) user",
            generate_secret_string=secretsmanager.SecretStringGenerator(
                secret_string_template=f'{{"username": "{VALKEY_USER}"}}', generate_string_key="password",
                exclude_punctuation=True, password_length=64),
            removal_policy=RemovalPolicy.DESTROY)
        router_user = elasticache.CfnUser(
            scope, "ValkeyRouterUser", engine="valkey", user_id=f"{prefix}-router", user_name=VALKEY_USER,
            access_string="on ~* +@all -@dangerous",
            authentication_mode={"Type": "password", "Passwords": [
                self.credentials.secret_value_from_json("password").unsafe_unwrap()]})
        # ElastiCache takes only users with a password or IAM authentication into a Valkey user group; the
        # default user must be in it, so it gets a generated password nobody reads, and stays switched off.
        self.default_credentials = secretsmanager.Secret(
            scope, "ValkeyDefaultCredentials", secret_name=f"{prefix}/valkey-default",
            description="turnkv Valkey default user's password (the user is switched off: off -@all)",
            generate_secret_string=secretsmanager.SecretStringGenerator(
                exclude_punctuation=True, password_length=64),
            removal_policy=RemovalPolicy.DESTROY)
        default_user = elasticache.CfnUser(
            scope, "ValkeyDefaultUser", engine="valkey", user_id=f"{prefix}-default", user_name="default",
            access_string=VALKEY_DEFAULT_ACCESS, authentication_mode={"Type": "password", "Passwords": [
                self.default_credentials.secret_value.unsafe_unwrap()]})
        users = elasticache.CfnUserGroup(
            scope, "ValkeyUsers", engine="valkey", user_group_id=f"{prefix}-state",
            user_ids=[default_user.ref, router_user.ref])
        self.cache = elasticache.CfnServerlessCache(
            scope, "Valkey", engine="valkey", serverless_cache_name=f"{prefix}-state",
            major_engine_version="8", description="turnkv router conversation state",
            security_group_ids=[self.security_group.security_group_id], user_group_id=users.ref,
            subnet_ids=[s.subnet_id for s in props.subnets])
        self.url = f"rediss://{self.cache.attr_endpoint_address}:{self.cache.attr_endpoint_port}"
