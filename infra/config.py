"""The typed, validated deployment config (pydantic v2 models: each field, its type and its default written once).

Read from ``cdk.json`` context (``turnkv``: an inline mapping) or from a YAML/JSON file
(``cdk synth -c turnkv:config=deploy/example.yaml``). Every problem is reported at synth, and by
``turnkv config validate``, as ``<field>: <what is wrong>; <how to fix it>``, all in one pass (``check``): the
models check each field (types, formats, ranges), then ``_cross_checks`` the rules that tie fields together (AZs
and region, VPC size, pools and the model, the ALB, the bake's subnet).
Pure: no CDK import, so the tests and ``turnkv`` can validate without jsii.
"""

from __future__ import annotations

import copy
import difflib
import ipaddress
import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)

from turnkv import engine_settings as es
from turnkv import media, neuron, params, platforms
from turnkv.engine_args import OFFLOAD_PLATFORMS, Mode, Role
from turnkv.engine_settings import EngineSettings
from turnkv.node_env import MAX_ENGINES_PER_NODE, MAX_PREFILL_OFFLOAD_GIB, MODEL, check_value
from turnkv.plan import architectures
from turnkv.plan.hardware import INSTANCES as PRICED_INSTANCES

from .instances import (
    HOST_TIER_SHARE,
    INSTANCE_TYPES,
    OFFERED_AZS,
    OFFERINGS_SOURCE,
    Flavor,
    offered_in,
    offering_command,
)

LOG_RETENTION_DAYS = (1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922,
                      3288, 3653)
#: Fargate CPU units -> the memory (MiB) range it takes.
FARGATE_MEMORY = {256: (512, 2048), 512: (1024, 4096), 1024: (2048, 8192), 2048: (4096, 16384),
                  4096: (8192, 30720), 8192: (16384, 61440), 16384: (32768, 122880)}
#: Subnet sizes of a new VPC (infra.stacks.network): a public /24 and a private /20 in every AZ.
PUBLIC_SUBNET_MASK = 24
PRIVATE_SUBNET_MASK = 20
#: Bucket names the docs and samples use as placeholders: a deploy with one would loop on a failing weight sync.
_PLACEHOLDER_BUCKETS = re.compile(r"^(replace-me|example|my-bucket|your-|changeme|placeholder|acme)")
#: Reservation ids the docs and deploy/example.yaml use as placeholders: a deploy with one fails at the launch
#: (after the 1-2 h bake), so they are refused up front.
PLACEHOLDER_RESERVATIONS = frozenset({"cr-0123456789abcdef0", "cr-0fedcba9876543210", "cr-00000000000000000"})
#: What to write when a required field is missing.
_REQUIRED_FIX = {
    "name": "a short lowercase name such as 'prod'",
    "region": "e.g. us-east-2",
    "availability_zone": "the AZ your GPU capacity is in, e.g. us-east-2b",
    "model.id": "a Hugging Face id such as Qwen/Qwen3-32B",
    "pools": "a list with at least one prefill and one decode pool",
    "network.existing.cidr": "the VPC's primary CIDR",
}


def subnet_addresses(azs: int) -> int:
    """Addresses a new VPC needs for its subnets, allocated as CDK does (public ones first, each aligned)."""
    end = 0
    for mask in [PUBLIC_SUBNET_MASK] * azs + [PRIVATE_SUBNET_MASK] * azs:
        size = 2 ** (32 - mask)
        end = -(-end // size) * size + size
    return end


class ConfigError(ValueError):
    """One or more config problems; ``problems`` holds ``(field, message)`` pairs."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        lines = "\n".join(f"  - {f}: {m}" for f, m in problems)
        super().__init__(f"turnkv deployment config is invalid:\n{lines}")


# ---------------------------------------------------------------- field formats


def _pattern(regex: str, what: str):
    compiled = re.compile(regex)

    def check(value: str) -> str:
        if not compiled.match(value):
            raise ValueError(f"{value!r} {what}")
        return value

    return AfterValidator(check)


def _cidr(value: str) -> str:
    try:
        ipaddress.ip_network(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a CIDR block; write one such as 203.0.113.0/24") from None
    return value


def _range(low: int, high: int, fix: str):
    def check(value: int) -> int:
        if not low <= value <= high:
            raise ValueError(f"{value} is out of range; {fix}")
        return value

    return AfterValidator(check)


def _model_text(value: str) -> str:
    try:
        check_value(MODEL, value)
    except ValueError:
        raise ValueError(f"{value!r} has a character the engine's env file cannot carry; use letters, digits and "
                         "_.,:/@+=- only") from None
    return value


def _power_of_two(value: int) -> int:
    if value < 1 or value & (value - 1):
        raise ValueError(f"{value} is not a power of two; use 1, 2, 4, 8, ...")
    return value


def _retention(value: int) -> int:
    if value not in LOG_RETENTION_DAYS:
        raise ValueError(f"{value} is not a CloudWatch Logs retention; use one of "
                         f"{', '.join(map(str, LOG_RETENTION_DAYS))} days")
    return value


def _instance_type(value: str) -> str:
    if value not in INSTANCE_TYPES:
        raise ValueError(f"{value!r} is not supported; use one of {', '.join(INSTANCE_TYPES)}")
    if INSTANCE_TYPES[value].flavor is Flavor.NEURON and not value.startswith(neuron.DI_FAMILIES):
        raise ValueError(f"{value} is refused: {neuron.TRN1_REFUSAL}")
    return value


def _s3_uri(value: str) -> str:
    if not re.match(r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[A-Za-z0-9_.,:/@+=-]*)?$", value):
        raise ValueError(f"{value!r} is not an S3 prefix; write s3://bucket/prefix/")
    if _PLACEHOLDER_BUCKETS.match(value[len("s3://"):]):
        raise ValueError(f"{value!r} is a placeholder; upload the weights (aws s3 sync ./<model> "
                         "s3://<your-bucket>/<model>/) and name that prefix, or drop s3_uri and set "
                         "network.nat_gateways: 1 to download from Hugging Face")
    return value


def _fargate_cpu(value: int) -> int:
    if value not in FARGATE_MEMORY:
        raise ValueError(f"{value} is not a Fargate CPU size; Fargate takes one of "
                         f"{', '.join(map(str, FARGATE_MEMORY))} (CPU units)")
    return value


Name = Annotated[StrictStr, _pattern(r"^[a-z][a-z0-9-]{1,20}$", "is not a resource-name prefix; use 2-21 lowercase "
                                     "letters, digits or '-', starting with a letter")]
#: AWS's region names (2025). A name of the right shape that is none of them (``us-east-9``) failed only at deploy.
#: A region AWS opened since: add it here.
AWS_REGIONS = frozenset({
    "us-east-1", "us-east-2", "us-west-1", "us-west-2", "us-gov-east-1", "us-gov-west-1", "ca-central-1",
    "ca-west-1", "mx-central-1", "sa-east-1", "af-south-1", "eu-central-1", "eu-central-2", "eu-west-1", "eu-west-2",
    "eu-west-3", "eu-south-1", "eu-south-2", "eu-north-1", "il-central-1", "me-south-1", "me-central-1",
    "ap-east-1", "ap-east-2", "ap-south-1", "ap-south-2", "ap-northeast-1", "ap-northeast-2", "ap-northeast-3",
    "ap-southeast-1", "ap-southeast-2", "ap-southeast-3", "ap-southeast-4", "ap-southeast-5", "ap-southeast-7",
    "cn-north-1", "cn-northwest-1",
})


def _known_region(value: str) -> str:
    if value not in AWS_REGIONS:
        close = difflib.get_close_matches(value, sorted(AWS_REGIONS), n=3, cutoff=0.8)
        use = " or ".join(close) if close else "one such as us-east-2"
        raise ValueError(f"{value!r} is no AWS region; use {use} (infra/config.py AWS_REGIONS lists them)")
    return value


Region = Annotated[StrictStr, _pattern(r"^[a-z]{2}(-gov)?-[a-z]+-\d$",
                                       "is not an AWS region name; "
                                       "use one such as us-east-2"), AfterValidator(_known_region)]
Account = Annotated[StrictStr, _pattern(r"^\d{12}$",
                                        "is not an account id; "
                                        "write its 12 digits, quoted in YAML (or leave it out)")]
Cidr = Annotated[StrictStr, AfterValidator(_cidr)]
Ec2InstanceType = Annotated[StrictStr, _pattern(r"^[a-z][a-z0-9-]*\.[a-z0-9]+$",
                                                "is not an EC2 instance type; write one such as g6.2xlarge")]
VpcId = Annotated[StrictStr, _pattern(r"^vpc-[0-9a-f]{8,17}$",
                                      "is not a VPC id; "
                                      "copy it from the VPC console (vpc-...)")]
SubnetId = Annotated[StrictStr, _pattern(r"^subnet-[0-9a-f]{8,17}$",
                                         "is not a subnet id; "
                                         "copy it from the VPC console (subnet-...)")]
SecurityGroupId = Annotated[StrictStr, _pattern(r"^sg-[0-9a-f]{8,17}$",
                                                "is not a security group id; "
                                                "copy it from the VPC console (sg-...)")]
ReservationId = Annotated[StrictStr, _pattern(r"^cr-[0-9a-f]{17}$",
                                              "is not a reservation id; "
                                              "copy it from the EC2 console (cr- and 17 hex)")]


def _real_reservation(value: str) -> str:
    if value in PLACEHOLDER_RESERVATIONS:
        raise ValueError(f"{value!r} is the example's placeholder; put the id of your own On-Demand Capacity "
                         "Reservation or Capacity Block here (EC2 console > Capacity Reservations), or drop the key "
                         "and set allow_on_demand: true")
    return value
PlacementGroupName = Annotated[StrictStr, _pattern(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$",
                                                   "is not a placement group name; copy it from the EC2 console")]
CertificateArn = Annotated[StrictStr, _pattern(
    r"^arn:aws[a-z-]*:acm:[a-z0-9-]+:\d{12}:certificate/[0-9a-f-]{36}$",
    "is not an ACM certificate ARN; copy it from the ACM console (arn:aws:acm:<region>:<account>:certificate/...)")]
AmiId = Annotated[StrictStr, _pattern(r"^ami-[0-9a-f]{8,17}$",
                                      "is not an AMI id (ami- and 8 or 17 hex); fix it, or leave it out to bake one")]
Email = Annotated[StrictStr, _pattern(r"^[^@\s]+@[^@\s]+\.[^@\s]+$",
                                      "is not an e-mail address; "
                                      "write one such as oncall@example.com")]
ModelText = Annotated[StrictStr, AfterValidator(_model_text)]


def _media_domain(value: str) -> str:
    host = value.strip().lower().rstrip(".")
    if not re.fullmatch(r"(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z][a-z0-9-]{0,61}[a-z0-9]", host):
        raise ValueError(f"{value!r} is not a DNS host name; write exact names such as images.example.com (no scheme, "
                         "port, path or wildcard: vLLM's --allowed-media-domains compares whole names)")
    if media.internal_host(host):
        raise ValueError(f"{value!r} names this network's inside; engines must not fetch media from it")
    return host


MediaDomain = Annotated[StrictStr, AfterValidator(_media_domain)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ---------------------------------------------------------------- the models


class ExistingVpc(_Model):
    vpc_id: VpcId
    cidr: Cidr
    #: Private subnets, one per entry of ``network.availability_zones`` (same order).
    private_subnet_ids: tuple[SubnetId, ...]
    public_subnet_ids: tuple[SubnetId, ...] = ()


class NetworkConfig(_Model):
    #: Two AZs at least (the ALB and the router need two); the engines live in ``availability_zone``.
    #: Default: ``availability_zone`` and one more of its region (DeploymentConfig fills it in).
    availability_zones: tuple[StrictStr, ...]
    cidr: Cidr = "10.40.0.0/16"
    #: 0: engines and router have no internet path (VPC endpoints only; weights must come from S3).
    nat_gateways: StrictInt = 0
    existing: ExistingVpc | None = None
    flow_log_retention_days: Annotated[StrictInt, AfterValidator(_retention)] = 90

    @property
    def vpc_cidr(self) -> str:
        """The VPC's CIDR as a literal (security-group rules stay checkable at synth)."""
        return self.existing.cidr if self.existing else self.cidr


class PoolConfig(_Model):
    role: Role
    instance_type: Annotated[StrictStr, AfterValidator(_instance_type)]
    #: Default: the role's name.
    name: Annotated[StrictStr, _pattern(r"^[a-z][a-z0-9-]{0,15}$",
                                        "is not a pool name; "
                                        "use 1-16 lowercase letters, digits or '-'")] = ""
    #: Instances (at least one: a pool of none serves nothing and its role's alarm fires from the first minute).
    count: Annotated[StrictInt, _range(1, 64, "use 1 .. 64 (to stop paying for a pool, destroy the deployment: "
                                                "every role needs a pool)")] = 1
    #: On-Demand Capacity Reservation or Capacity Block id (``cr-...``). Expected for P-family and Trainium pools
    #: (``reservation_expected``).
    capacity_reservation_id: Annotated[ReservationId, AfterValidator(_real_reservation)] | None = None
    #: A P-family or Trainium pool without a reservation asks EC2 for On-Demand capacity, which for p5/p5e/p5en and
    #: trn2 is often not there: the launch fails with InsufficientInstanceCapacity after the 1-2 h bake. Refused
    #: unless this says so explicitly (``_cross_checks``).
    allow_on_demand: StrictBool = False
    #: You checked that EC2 offers ``instance_type`` in ``availability_zone`` now (``infra.instances.OFFERED_AZS`` is a
    #: snapshot, so a zone it lacks is refused until this says so).
    offering_confirmed: StrictBool = False
    #: True when the reservation is a Capacity Block (launch template market type ``capacity-block``).
    capacity_block: StrictBool = False
    #: The cluster placement group an On-Demand Capacity Reservation was created in: instances must launch into
    #: that group to use the reservation (EC2: Capacity Reservations in cluster placement groups).
    placement_group: PlacementGroupName | None = None
    #: Engines each instance runs, each on its own accelerators and ports. Default: the instance's accelerators
    #: over ``model.tensor_parallel_size`` (all of them: an instance is paid for whole, as ``turnkv plan`` counts).
    engines_per_node: Annotated[StrictInt, _range(1, MAX_ENGINES_PER_NODE,
                                                  f"use 1 .. {MAX_ENGINES_PER_NODE} (at most accelerators / "
                                                  "model.tensor_parallel_size)")] | None = None

    #: One instance above ``count`` while a new image or user data rolls over the pool (every engine keeps serving;
    #: ``infra.roll``). Default: yes without a reservation, no with one (a reservation of exactly ``count`` has no
    #: room); true for a reservation that holds ``count + 1``, false to roll in place without the surge's quota.
    roll_surge: StrictBool | None = None
    #: How long a node being replaced or scaled in drains (deregistered, in-flight streams finish) before it is
    #: terminated: the terminate lifecycle hook's bound (Auto Scaling allows up to 7200 s with its margin).
    drain_timeout_s: Annotated[StrictInt, _range(60, 7140, "use 60 .. 7140 s (Auto Scaling's lifecycle hook "
                                                           "allows 7200 s, 60 of them its margin)")] = 900

    @model_validator(mode="before")
    @classmethod
    def _name_from_role(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and data.get("name") is None and isinstance(data.get("role"), str):
            return {**data, "name": data["role"]}
        return data

    @property
    def flavor(self) -> str:
        return INSTANCE_TYPES[self.instance_type].flavor.value

    @property
    def joins_deployment_placement_group(self) -> bool:
        """Whether the pool launches into the deployment's cluster placement group: only without a reservation (a
        reserved pool launches into the group its reservation was made in, ``placement_group``, or into none)."""
        return not self.capacity_reservation_id and not self.placement_group


def _setting(check):
    """A ``turnkv.engine_settings`` check as a field validator (its message names the fix)."""
    def run(value):
        try:
            return check(value)
        except es.SettingError as exc:
            raise ValueError(str(exc)) from None

    return AfterValidator(run)


class ModelConfig(_Model):
    id: ModelText
    tensor_parallel_size: Annotated[StrictInt, AfterValidator(_power_of_two)] = 8
    max_model_len: Annotated[StrictInt, _range(256, 10_000_000, "use 256 .. 10000000 tokens")] = 32768
    served_model_name: ModelText | None = None
    #: Weights prefix (``s3://bucket/prefix/``); required when the VPC has no NAT.
    s3_uri: Annotated[StrictStr, AfterValidator(_s3_uri)] | None = None
    # Engine settings (``turnkv.engine_settings``: the values the pinned vLLM accepts); unset: vLLM's defaults.
    #: ``--kv-cache-dtype`` (fp8 halves the KV bytes each turn moves and keeps).
    kv_cache_dtype: Annotated[StrictStr, _setting(es.kv_cache_dtype)] = "auto"
    #: ``--tool-call-parser``, with ``--enable-auto-tool-choice`` (hermes for Qwen3): without one vLLM answers
    #: ``tool_choice: auto`` with 400.
    tool_call_parser: Annotated[StrictStr, _setting(es.tool_call_parser)] | None = None
    #: ``--reasoning-parser`` (qwen3 for Qwen3).
    reasoning_parser: Annotated[StrictStr, _setting(es.reasoning_parser)] | None = None
    trust_remote_code: StrictBool = False
    gpu_memory_utilization: Annotated[StrictFloat, _setting(es.gpu_memory_utilization)] | None = None
    max_num_seqs: Annotated[StrictInt, _setting(es.max_num_seqs)] | None = None
    #: More ``vllm serve`` flags, ``--flag`` or ``--flag=value``, from turnkv's allow-list
    #: (``es.ALLOWED_EXTRA_FLAGS``); flags turnkv sets itself are refused.
    extra_args: Annotated[tuple[Annotated[StrictStr, _setting(es.extra_arg)], ...],
                          _setting(es.extra_args)] = ()
    #: Secrets Manager secret (name or ARN) holding a Hugging Face token for a gated model: the engine role may
    #: read that secret only, and each engine reads it at start into HF_TOKEN (never into a file).
    hf_token_secret: Annotated[StrictStr, _pattern(
        r"^(arn:aws[a-z-]*:secretsmanager:[a-z0-9-]+:\d{12}:secret:[A-Za-z0-9/_+=.@-]{1,512}"
        r"|[A-Za-z0-9/_+=.@-]{1,512})$",
        "is not a Secrets Manager secret name or ARN; write its name (e.g. turnkv/hf-token) or its full ARN")] \
        | None = None

    @property
    def name(self) -> str:
        return self.served_model_name or self.id

    @property
    def engine_settings(self) -> EngineSettings:
        return EngineSettings(
            kv_cache_dtype=self.kv_cache_dtype, tool_call_parser=self.tool_call_parser,
            reasoning_parser=self.reasoning_parser, trust_remote_code=self.trust_remote_code,
            gpu_memory_utilization=self.gpu_memory_utilization, max_num_seqs=self.max_num_seqs,
            extra_args=self.extra_args)


class ConnectorConfig(_Model):
    mode: Mode = Mode.PULL
    bidirectional: StrictBool = True
    #: Platforms whose engines start although turnkv's connector is unverified there (``turnkv.platforms``):
    #: Neuron pools need ``[neuron]``, written to each engine's env as ``TURNKV_ALLOW_UNVERIFIED``.
    allow_unverified: tuple[Literal["neuron"], ...] = ()
    #: GiB of each prefill engine's host memory for vLLM's native CPU offloading tier, run beside turnkv's
    #: connector (``turnkv.engine_args``: a MultiConnector), so prefill keeps shared prefixes its HBM has lost while
    #: decode's retained turns bring each conversation's tail. 0: none. GPU pools only (the tier runs on CUDA).
    prefill_offload_gib: Annotated[StrictInt, _range(0, MAX_PREFILL_OFFLOAD_GIB,
                                                     f"use 0 .. {MAX_PREFILL_OFFLOAD_GIB} GiB")] = 0


class RouterDeploymentConfig(_Model):
    """The deploy config's ``router`` section: how the router is deployed (Fargate, ALB, scaling). The router
    process's own settings are ``router.config.RouterConfig``."""

    replicas: Annotated[StrictInt, _range(1, 100, "use 1 .. 100")] = 2
    #: Default: 8, or ``replicas`` when that is more.
    max_replicas: StrictInt = 8
    cpu: Annotated[StrictInt, AfterValidator(_fargate_cpu)] = 1024
    memory_mib: StrictInt = 2048
    #: ACM certificate: HTTPS on 443 (HTTP on 80 redirects); none: HTTP on 80.
    certificate_arn: CertificateArn | None = None
    #: Internet-facing ALB (public subnets); otherwise internal.
    public: StrictBool = False
    #: Who may reach the ALB listener. Empty: the VPC's CIDR only. 0.0.0.0/0 must be written out.
    allowed_cidrs: tuple[Cidr, ...] = ()
    #: ALB idle timeout: long enough for the longest stream's silences (first token of a long prefill).
    idle_timeout_s: Annotated[StrictInt, _range(60, 4000, "use 60 .. 4000 s (ALB limit 4000)")] = 900
    #: An internet-facing ALB without a certificate serves plain HTTP (Bearer keys in the clear): refused unless
    #: this says so explicitly.
    allow_http: StrictBool = False

    @model_validator(mode="before")
    @classmethod
    def _max_replicas_default(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and data.get("max_replicas") is None and isinstance(data.get("replicas"), int):
            return {**data, "max_replicas": max(8, data["replicas"])}
        return data

    @property
    def uses_valkey(self) -> bool:
        """Shared conversation state whenever more than one replica can exist (autoscaling included): two
        replicas with their own memory stores would miss each other's turns."""
        return self.max_replicas > 1


class ImageConfig(_Model):
    #: Bring your own engine AMI (built from ami/ or equivalent): the deploy skips the Image Builder bake.
    ami_id: AmiId | None = None
    #: Build instance types, tried in order. Empty: the recipe's own list (``ami.recipes``).
    build_instance_types: tuple[Ec2InstanceType, ...] = ()
    #: Build in this subnet (with this security group) instead of the account's default VPC. It needs an
    #: internet path (the bake downloads the EFA installer, NIXL and vLLM).
    build_subnet_id: SubnetId | None = None
    build_security_group_id: SecurityGroupId | None = None


class AlarmsConfig(_Model):
    """Alarm thresholds of the observability stack (``infra.constructs.alarms``); each alarm notifies the SNS topic
    (``alarm_email`` subscribes). The defaults are the thresholds the stack has always used."""

    #: RouterTtftP99: router p99 time to first token above this (ms) for 3 of 5 minutes.
    ttft_p99_ms: Annotated[StrictInt, _range(1, 3_600_000, "use 1 .. 3600000 ms")] = 10_000
    #: RouterErrors and Alb5xx: more router errors a minute, or more 5xx a minute from the router tasks, than this.
    errors_per_minute: Annotated[StrictInt, _range(0, 1_000_000, "use 0 .. 1000000 a minute")] = 10
    #: KvCacheFull-<role>: an engine's KV cache usage above this (percent) for 8 of 10 minutes.
    kv_cache_usage_percent: Annotated[StrictInt, _range(1, 100, "use 1 .. 100 (%)")] = 95


class DeploymentConfig(_Model):
    name: Name
    region: Region
    availability_zone: StrictStr
    network: NetworkConfig
    model: ModelConfig
    pools: tuple[PoolConfig, ...]
    connector: ConnectorConfig = Field(default_factory=ConnectorConfig)
    router: RouterDeploymentConfig = Field(default_factory=RouterDeploymentConfig)
    image: ImageConfig = Field(default_factory=ImageConfig)
    account: Account | None = None
    alarm_email: Email | None = None
    alarms: AlarmsConfig = Field(default_factory=AlarmsConfig)
    #: Hosts media URLs (image_url, audio_url, video_url) may name: the router refuses any other (400) and the
    #: engines fetch from no other (vLLM ``--allowed-media-domains``), both from ``TURNKV_MEDIA_DOMAINS``. Exact
    #: names. Empty: any host on the internet, every name resolved and every address checked by the router
    #: (docs/router.md, Media URLs); a name that resolves differently for the engine (DNS rebinding) is closed only
    #: by a list.
    media_domains: tuple[MediaDomain, ...] = ()
    #: Initial tunables (``turnkv params catalog``), NAME: VALUE, written to SSM by the params stack in place of the
    #: catalog's defaults; validated against the catalog and its cross-checks (decoder_kv_blocks_ttl alone fits
    #: conversation_ttl). ``turnkv params set`` changes them afterwards.
    tunables: dict[StrictStr, StrictInt | StrictFloat] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _defaults_from_other_fields(cls, data: Any) -> Any:
        """``network.availability_zones`` defaults to the engines' AZ and one more of its region; absent
        sections are empty mappings (so a missing ``model.id`` is named as such)."""
        if not isinstance(data, Mapping):
            return data
        data = {k: v for k, v in data.items() if v is not None}
        for section in ("network", "model"):
            data.setdefault(section, {})
        network = data["network"]
        az, region = data.get("availability_zone"), data.get("region")
        if isinstance(network, Mapping) and network.get("availability_zones") is None \
                and isinstance(az, str) and isinstance(region, str):
            other = f"{region}{'b' if az.endswith('a') else 'a'}"
            data["network"] = {**network, "availability_zones": [az, other]}
        return data

    @property
    def prefix(self) -> str:
        """Resource-name prefix (ASGs, Cloud Map, log groups)."""
        return f"turnkv-{self.name}"

    def ami_parameter(self, flavor: str) -> str:
        return f"/turnkv/{self.name}/ami/{flavor}"

    def stack_output_parameter(self, stack: str, key: str) -> str:
        """Where stack ``stack`` publishes a value a later stack reads (SSM, not a CloudFormation export: an
        export another stack imports can never change, so a config change that replaces the ALB or its listener
        would fail the producing stack's update; docs/deploy-aws.md, "Change it without taking it down")."""
        return f"/turnkv/{self.name}/outputs/{stack}/{key}"

    def prefill_engine_price_per_hour(self) -> float:
        """USD per prefill engine-hour, to price the prefill time reuse saves (``router.savings``): each prefill pool's
        on-demand instance price in ``turnkv.plan.hardware`` (the one price table) over its engines per instance,
        weighted by its engines; 0 when a prefill pool's instance type has no price there."""
        engines = dollars = 0.0
        for pool in self.pools:
            if pool.role != Role.PREFILL or pool.count <= 0:
                continue
            instance = PRICED_INSTANCES.get(pool.instance_type)
            if instance is None or instance.price_per_hour <= 0:
                return 0.0
            per_node = self.engines_per_node(pool)
            engines += pool.count * per_node
            dollars += pool.count * instance.price_per_hour
        return round(dollars / engines, 6) if engines else 0.0

    def engines_per_node(self, pool: PoolConfig) -> int:
        """Engines one instance of ``pool`` runs: ``pools[].engines_per_node``, else every accelerator used."""
        if pool.engines_per_node is not None:
            return pool.engines_per_node
        return max(1, INSTANCE_TYPES[pool.instance_type].accelerators // self.model.tensor_parallel_size)


# ---------------------------------------------------------------- rules across fields


#: Instance families whose On-Demand capacity is scarce, bought as ODCRs or Capacity Blocks: P-family (p4d, p5, p5e,
#: p5en, ...) and Trainium (trn1, trn2; EC2 Capacity Blocks for ML sell both, and UltraServers of trn2 only as
#: Capacity Blocks: EC2 API Reference, CapacityBlock).
RESERVED_FAMILIES = ("p", "trn")


def _engine_shares(c: DeploymentConfig, role: Role, share: float, per_gib: int) -> Iterator[
        tuple[int, PoolConfig, int, int, int]]:
    """For each pool of ``role``: its index, the pool, its host memory (GiB), its engines a node, and the most host
    memory each engine may take (``share`` of the node's over its engines, in units of 1/``per_gib`` GiB)."""
    for i, pool in enumerate(c.pools):
        if pool.role is role:
            host_gib = INSTANCE_TYPES[pool.instance_type].host_memory_gib
            engines = c.engines_per_node(pool)
            yield i, pool, host_gib, engines, int(host_gib * per_gib * share) // engines


def reservation_expected(instance_type: str) -> bool:
    """Scarce On-Demand capacity (P-family, Trainium), bought as ODCRs or Capacity Blocks."""
    return instance_type.startswith(RESERVED_FAMILIES)


def _recipe_build_types(flavor: str) -> tuple[str, ...]:
    from ami.recipes import IMAGES

    return IMAGES[flavor].build_instance_types


def build_types_offered(types: tuple[str, ...], region: str) -> tuple[str, ...]:
    """The image recipe's build types the region offers (a type the offering table does not track is kept), in order;
    all of them when none is: the bake then fails at launch, and ``config validate`` said so first."""
    offered = tuple(t for t in types if offered_in(t, region) is not False)
    return offered or types


def _family(instance_type: str) -> str:
    return "Trainium" if instance_type.startswith("trn") else "P-family"


def _cross_checks(c: DeploymentConfig) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    fail = problems.append
    region, az, net = c.region, c.availability_zone, c.network
    azs = net.availability_zones
    if not (az.startswith(region) and len(az) == len(region) + 1):
        fail(("availability_zone", f"{az!r} is not in region {region!r}; use e.g. {region}a"))
    if len(set(azs)) < 2:
        fail(("network.availability_zones", "fewer than two distinct AZs; give at least two (the ALB needs two)"))
    if az not in azs:
        fail(("network.availability_zones", f"does not include availability_zone {az!r}; add it"))
    for i, zone in enumerate(azs):
        if not zone.startswith(region):
            fail((f"network.availability_zones[{i}]", f"{zone!r} is not in region {region!r}; use an AZ of {region}"))
    if not 0 <= net.nat_gateways <= len(azs):
        fail(("network.nat_gateways", f"{net.nat_gateways} is out of range; use 0 (no internet path) up to one per AZ "
                                         f"({len(azs)})"))
    need = subnet_addresses(len(azs))
    size = ipaddress.ip_network(net.cidr).num_addresses
    if net.existing is None and need > size:
        fits = 32 - (need - 1).bit_length()
        fail(("network.cidr", f"{net.cidr} holds {size} addresses; {len(azs)} AZs need a public "
                              f"/{PUBLIC_SUBNET_MASK} and a private /{PRIVATE_SUBNET_MASK} each ({need}): use a "
                              f"/{fits} or larger block, or fewer network.availability_zones"))
    if net.existing is not None:
        for key in ("private_subnet_ids", "public_subnet_ids"):
            ids = getattr(net.existing, key)
            if ids and len(ids) != len(azs):
                fail((f"network.existing.{key}",
                      f"not one subnet per network.availability_zones entry; give {len(azs)}, in the same order"))
    if net.nat_gateways == 0 and net.existing is None and not c.model.s3_uri:
        fail(("model.s3_uri", "required when network.nat_gateways is 0 (engines have no internet path to download "
                              "weights); upload the weights to S3 or set network.nat_gateways: 1"))

    tp = c.model.tensor_parallel_size
    for i, pool in enumerate(c.pools):
        path = f"pools[{i}]"
        if pool.capacity_block and not pool.capacity_reservation_id:
            fail((f"{path}.capacity_block", "set without a reservation; put the Capacity Block's id in "
                                            "capacity_reservation_id"))
        if pool.placement_group and (not pool.capacity_reservation_id or pool.capacity_block):
            fail((f"{path}.placement_group", "only for an On-Demand Capacity Reservation created in a cluster "
                                             "placement group; set capacity_reservation_id too (a Capacity Block "
                                             "places its instances itself; a pool without a reservation joins the "
                                             "deployment's own placement group)"))
        if reservation_expected(pool.instance_type) and not pool.capacity_reservation_id and not pool.allow_on_demand:
            fail((f"{path}.capacity_reservation_id",
                  f"missing for {pool.instance_type}: On-Demand {_family(pool.instance_type)} capacity is rarely "
                  f"there, and without it "
                  f"the launch fails with InsufficientInstanceCapacity after the 1-2 h bake; give the id of an "
                  f"On-Demand Capacity Reservation (in a cluster placement group: name it in placement_group) or "
                  f"a Capacity Block (capacity_block: true) in {c.availability_zone}, or set allow_on_demand: true "
                  f"to try On-Demand knowingly"))
        offered = offered_in(pool.instance_type, c.availability_zone)
        if offered is False and not pool.offering_confirmed:
            zones = sorted(OFFERED_AZS[pool.instance_type])
            fail((f"{path}.instance_type",
                  f"{pool.instance_type} is not offered in {c.availability_zone} as far as turnkv knows (offered in "
                  f"{', '.join(zones)}; {OFFERINGS_SOURCE}); move availability_zone (and region) there, or check "
                  f"with `{offering_command(pool.instance_type, region)}` and, if it is offered now, set "
                  f"offering_confirmed: true on this pool"))
        accelerators = INSTANCE_TYPES[pool.instance_type].accelerators
        if tp > accelerators:
            fail(("model.tensor_parallel_size", f"{tp} exceeds the {accelerators} accelerators of "
                                                f"{pool.instance_type} ({path}); lower it or pick a larger instance "
                                                "type"))
        elif pool.engines_per_node is not None and pool.engines_per_node * tp > accelerators:
            fail((f"{path}.engines_per_node", f"{pool.engines_per_node} engines of tensor-parallel size {tp} need "
                                              f"{pool.engines_per_node * tp} accelerators; {pool.instance_type} has "
                                              f"{accelerators}: use at most {accelerators // tp}, or leave it out"))
    roles = {p.role for p in c.pools}
    for role in Role:
        if role not in roles:
            fail(("pools", f"no {role.value} pool; add one with role: {role.value}"))
    names = [p.name for p in c.pools]
    for dup in sorted({x for x in names if names.count(x) > 1}):
        fail(("pools", f"pool name {dup!r} is used twice; give each pool its own name"))
    if len({p.flavor for p in c.pools}) > 1:
        fail(("pools", "prefill and decode are on different accelerator families (KV blocks move between them as "
                       "is); put every pool on GPU instances or every pool on Neuron"))
    elif c.pools and c.pools[0].flavor == Flavor.NEURON.value:
        if Flavor.NEURON.value not in c.connector.allow_unverified:
            fail(("connector.allow_unverified", "Neuron pools need [neuron]: turnkv's connector has not read KV on a "
                                                "Trainium node yet (" + "; ".join(platforms.unverified("neuron")) +
                  "), so engines start there only when the config says so; add allow_unverified: [neuron] to the "
                  "connector section, and check KV moved and answers match (docs/trainium.md)"))
        refused = neuron.MODE_REFUSALS.get(c.connector.mode.value)
        if refused:
            fail(("connector.mode", refused))
        if c.connector.prefill_offload_gib:
            fail(("connector.prefill_offload_gib", f"{OFFLOAD_PLATFORMS}; set it to 0 on Neuron pools"))
    offload = c.connector.prefill_offload_gib
    if offload:
        for i, pool, host_gib, engines, most in _engine_shares(c, Role.PREFILL, HOST_TIER_SHARE, 1):
            if offload > most:
                fail(("connector.prefill_offload_gib",
                      f"{offload} GiB x {engines} engine(s) per node exceeds {HOST_TIER_SHARE:g} of "
                      f"{pool.instance_type}'s {host_gib} GiB of host memory (pools[{i}]; the rest is the OS's, the "
                      f"engines' and pinned buffers'): use at most {most}"))

    budget = c.tunables.get("host_kv_budget_mib")
    if isinstance(budget, int | float) and budget > 0:
        from connector.host_pool_plan import NODE_SHARE

        for i, pool, host_gib, engines, most in _engine_shares(c, Role.DECODE, NODE_SHARE, 1024):
            if budget > most:
                fail(("tunables.host_kv_budget_mib",
                      f"{budget:g} MiB x {engines} decode engine(s) per node exceeds {NODE_SHARE:g} of "
                      f"{pool.instance_type}'s {host_gib} GiB of host memory (pools[{i}]), the most its engines can "
                      f"back: they would shrink it at start (or less, by what the node has available); use at most "
                      f"{most}"))

    rt = c.router
    if rt.max_replicas < rt.replicas:
        fail(("router.max_replicas", f"{rt.max_replicas} is below router.replicas ({rt.replicas}); raise it"))
    low, high = FARGATE_MEMORY[rt.cpu]
    if not low <= rt.memory_mib <= high:
        fail(("router.memory_mib", f"{rt.memory_mib} does not fit cpu {rt.cpu}; Fargate takes {low} .. {high}"))
    if rt.certificate_arn and f":acm:{region}:" not in rt.certificate_arn:
        fail(("router.certificate_arn", f"the certificate is not in {region} (the ALB's region); use one issued there"))
    if rt.public and net.existing is not None and not net.existing.public_subnet_ids:
        fail(("router.public", "an internet-facing ALB needs network.existing.public_subnet_ids; add them or set "
                               "router.public: false"))
    if rt.public and not rt.certificate_arn and not rt.allow_http:
        fail(("router.certificate_arn", "required for an internet-facing router (router.public: true): clients send "
                                        "their API keys as Bearer tokens; add an ACM certificate ARN, or set "
                                        "router.allow_http: true to serve plain HTTP knowingly"))
    if rt.public and not rt.allowed_cidrs:
        fail(("router.allowed_cidrs", "empty for an internet-facing router; list the client CIDRs that may reach it "
                                      "(write 0.0.0.0/0 explicitly to open it to everyone)"))
    if c.tunables:  # every bad tunable its own problem (two used to read as one), cross rules after
        for name, message in params.problems(params.fit_router_ttl(c.tunables)):
            message = message.removeprefix(f"{name}: ")  # the field names it
            fail((f"tunables.{name}" if name else "tunables",
                  message if ";" in message else f"{message}; see `turnkv params catalog`"))
    arch = architectures.CATALOG.get(architectures.catalog_name(c.model.id) or "")
    if arch is not None and arch.max_context and c.model.max_model_len > arch.max_context:
        fail(("model.max_model_len", f"{c.model.max_model_len} tokens is more than {c.model.id} serves "
                                     f"({arch.max_context:,}, its max_position_embeddings); use at most "
                                     f"{arch.max_context}"))
    img = c.image
    if bool(img.build_subnet_id) != bool(img.build_security_group_id):
        fail(("image.build_security_group_id" if img.build_subnet_id else "image.build_subnet_id",
              "given alone; give both image.build_subnet_id and image.build_security_group_id (Image Builder "
              "needs a security group in the subnet's VPC), or neither to build in the default VPC"))
    if not img.ami_id:
        for flavor in sorted({p.flavor for p in c.pools}):
            types = img.build_instance_types or _recipe_build_types(flavor)
            if all(offered_in(t, region) is False for t in types):
                fail(("image.build_instance_types",
                      f"none of the {flavor} image's build types ({', '.join(types)}) is offered in {region} as far as "
                      f"turnkv knows ({OFFERINGS_SOURCE}); list one that is (check with "
                      f"`{offering_command(types[0], region)}`), or bake elsewhere and give image.ami_id"))
    if img.ami_id and (img.build_instance_types or img.build_subnet_id):
        fail(("image.ami_id", "with your own AMI nothing is baked; drop the image.build_* settings, or ami_id"))
    return problems


# ---------------------------------------------------------------- pydantic errors as field: message; fix


def _where(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _known_fields(loc: tuple[Any, ...]) -> list[str]:
    """The fields of the model at ``loc`` (where an unknown key was found)."""
    model: Any = DeploymentConfig
    for part in loc:
        if isinstance(part, int):
            continue
        annotation = model.model_fields[part].annotation
        candidates = [a for a in getattr(annotation, "__args__", (annotation,))
                      if isinstance(a, type) and issubclass(a, BaseModel)]
        if not candidates:
            break
        model = candidates[0]
    return sorted(model.model_fields)


_EXPECTED = {"int_type": "an integer", "int_parsing": "an integer", "bool_type": "true or false",
             "bool_parsing": "true or false", "string_type": "a string", "model_type": "a mapping",
             "model_attributes_type": "a mapping",
             "dict_type": "a mapping", "tuple_type": "a list", "list_type": "a list"}


def _value_loc(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """Where the bad value is: pydantic adds the member of a tunable's ``int | float`` union to its location."""
    return loc[:2] if loc[0] == "tunables" and len(loc) == 3 else loc


def _problem(error: Any) -> tuple[str, str]:
    loc = tuple(error["loc"])
    where = _where(loc)
    kind = error["type"]
    if kind == "missing":
        fix = _REQUIRED_FIX.get(where)
        return where, f"required; give {fix}" if fix else "required; give a value"
    if kind == "extra_forbidden":
        return where, f"unknown field; known fields here: {', '.join(_known_fields(loc[:-1]))}"
    if _value_loc(loc) != loc:  # a tunable's int | float union: one problem, not one per member
        return _where(loc[:2]), f"{error.get('input')!r} is not a number; see `turnkv params catalog` for its range"
    if kind in _EXPECTED:
        got = error.get("input")
        return where, f"{got!r} is not {_EXPECTED[kind]}; write {_EXPECTED[kind]} here"
    if kind == "enum":
        enum = {"role": Role, "mode": Mode}.get(str(loc[-1]))
        choices = ", ".join(e.value for e in enum) if enum else error["ctx"]["expected"]
        return where, f"{error.get('input')!r} is not allowed; use one of {choices}"
    message = error["msg"].removeprefix("Value error, ")
    return where, message if ";" in message else f"{message}; see infra/config.py for what this field takes"


def _without_nulls(data: Any) -> Any:
    """A null (``key:`` with no value in YAML) means "not given": the default applies."""
    if isinstance(data, Mapping):
        return {k: _without_nulls(v) for k, v in data.items() if v is not None}
    if isinstance(data, (list, tuple)):
        return [_without_nulls(v) for v in data]
    return data


#: Stand-ins for required values that were wrong, so the cross-field rules still run (no rule reads them).
_STAND_INS: dict[tuple[Any, ...], str] = {("name",): "invalid", ("model", "id"): "invalid"}


def _set_aside(data: Any, loc: tuple[Any, ...], required: bool, left_out: list[str]) -> bool:
    """Take the bad value at ``loc`` out of the way of a second validation round: drop it (its default applies),
    put a stand-in in for a required one, or leave out the list element holding it (a pool; its path goes to
    ``left_out``). False: nothing to do."""
    if required:
        if loc in _STAND_INS:
            return _put(data, loc, _STAND_INS[loc])
        if loc == ("region",) and (az := _az_region(data)):  # the AZ's region: the rules that read it still run
            return _put(data, loc, az)
        index = max((i for i, part in enumerate(loc) if isinstance(part, int)), default=None)
        if index is None or not _put(data, loc[:index + 1], None):
            return False
        left_out.append(_where(loc[:index + 1]))
        return True
    return _put(data, loc, _DROP)


_DROP = object()


def _az_region(data: Any) -> str | None:
    """The region ``availability_zone`` is in, where that is a known region (a wrong region's stand-in)."""
    az = data.get("availability_zone") if isinstance(data, Mapping) else None
    return az[:-1] if isinstance(az, str) and az[:-1] in AWS_REGIONS else None


def _put(data: Any, loc: tuple[Any, ...], value: Any) -> bool:
    *parents, leaf = loc
    node = data
    for part in parents:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return False
    if isinstance(node, dict) and (leaf in node or value is not _DROP):
        if value is _DROP:
            del node[leaf]
        else:
            node[leaf] = value
        return True
    if isinstance(node, list) and isinstance(leaf, int) and leaf < len(node):
        node[leaf] = None  # keeps the later indexes; _compact drops it
        return True
    return False


def _compact(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _compact(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_compact(v) for v in data if v is not None]
    return data


def _within(field: str, path: str) -> bool:
    """``field`` is ``path`` or inside it (``pools[1].instance_type`` is within ``pools[1]``)."""
    return field == path or field.startswith((f"{path}.", f"{path}["))


def check(data: Any) -> tuple[DeploymentConfig | None, list[tuple[str, str]]]:
    """Every problem of a deploy config in one pass: the per-field ones, then the cross-field ones.

    Cross-field rules need a typed config, so after field errors the bad values are set aside (dropped, so their
    defaults apply; a wrong name or model id stood in for; a pool with a wrong required value left out) and the
    rest is validated again. A cross-field problem about a field already reported, or about a list that lost an
    element, is left out. A wrong region (which the cross-field rules read) stops at the per-field problems.
    Synth (``from_mapping``) and ``turnkv config validate`` both call this.
    """
    if not isinstance(data, Mapping):
        return None, [("turnkv", f"expected a mapping, got {type(data).__name__}")]
    data = _without_nulls(data)
    problems: list[tuple[str, str]] = []
    left_out: list[str] = []
    for round_ in range(5):
        try:
            config = DeploymentConfig.model_validate(data)
        except ValidationError as exc:
            errors = exc.errors()
            reported = {field for field, _ in problems}
            for p in map(_problem, errors):  # a tunable's union reports once, not once per member
                if p[0] not in reported and p not in problems:
                    problems.append(p)
            data = copy.deepcopy(data)
            # A value set aside in an earlier round comes back as "required": its first report stands.
            moved = [_set_aside(data, _value_loc(tuple(e["loc"])), e["type"] == "missing" and round_ > 0, left_out)
                     for e in errors if e["type"] != "missing" or round_ > 0]
            if not any(moved):
                return None, problems
            data = _compact(data)
            continue
        # Left out: a problem about a reported value (its default stood in), or about a list that lost an element
        # (``pools`` without the pool that was left out).
        reported = [field for field, _ in problems]
        problems += [p for p in _cross_checks(config)
                     if not any(_within(p[0], f) for f in reported)
                     and not any(_within(p[0], path) or _within(path, p[0]) for path in left_out)]
        if not problems:
            # What synth would refuse only after rendering the nodes' user data (EC2's 16 KB), said here instead.
            from infra import bootstrap

            problems += bootstrap.user_data_problems(config)
        return (None if problems else config), problems
    return None, problems


def from_mapping(data: Mapping[str, Any]) -> DeploymentConfig:
    """Parse and validate; raise ConfigError listing every problem with its fix."""
    config, problems = check(data)
    if problems or config is None:
        raise ConfigError(problems)
    return config


def load_file(path: str | Path) -> Mapping[str, Any]:
    """The config file's mapping; malformed YAML or JSON is a ConfigError naming the line, never a traceback."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError([("turnkv:config", f"{path} does not exist; pass -c turnkv:config=PATH to a YAML/JSON file")])
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([(str(path), f"cannot be read ({exc}); pass a UTF-8 YAML or JSON file")]) from None
    if path.suffix in {".yaml", ".yml"}:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError([(str(path), f"malformed YAML{where}: {what}; fix the syntax there (indentation, a "
                                           "missing ':' or an unclosed quote or bracket)")]) from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError([(str(path), f"malformed JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}; "
                                           "fix the syntax there, or use a .yaml file")]) from None
    if not isinstance(data, Mapping):
        raise ConfigError([("turnkv:config", f"{path} must hold a mapping at the top")])
    return data


def validate_file(path: str | Path) -> tuple[DeploymentConfig | None, list[tuple[str, str]]]:
    """``turnkv config validate``: the file read and every problem found, without a synth."""
    try:
        data = load_file(path)
    except ConfigError as exc:
        return None, exc.problems
    return check(data)


def from_context(inline: Any, file: str | None) -> DeploymentConfig:
    """``turnkv:config`` (a file) wins over the inline ``turnkv`` mapping of cdk.json."""
    if file:
        return from_mapping(load_file(file))
    if inline is None:
        raise ConfigError([("turnkv", "no config: add a 'turnkv' mapping to cdk.json context or pass "
                                      "-c turnkv:config=PATH")])
    if isinstance(inline, str):  # -c turnkv='{...}'
        inline = json.loads(inline)
    return from_mapping(inline)
