"""The typed, validated deployment config.

Read from ``cdk.json`` context (``turnkv``: an inline mapping) or from a YAML/JSON file
(``cdk synth -c turnkv:config=deploy/prod.yaml``). Every problem is reported at synth as
``<field>: <what is wrong>; <how to fix it>``, all at once.
Pure: no CDK import, so the tests and ``turnkv`` can validate without jsii.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from turnkv.engine_args import Mode, Role
from turnkv.node_env import check_value

from .instances import INSTANCE_TYPES, Flavor

_NAME = re.compile(r"^[a-z][a-z0-9-]{1,20}$")
_REGION = re.compile(r"^[a-z]{2}(-gov)?-[a-z]+-\d$")
_ACCOUNT = re.compile(r"^\d{12}$")
_ODCR = re.compile(r"^cr-[0-9a-f]{17}$")
_VPC = re.compile(r"^vpc-[0-9a-f]{8,17}$")
_SUBNET = re.compile(r"^subnet-[0-9a-f]{8,17}$")
_ACM = re.compile(r"^arn:aws[a-z-]*:acm:[a-z0-9-]+:\d{12}:certificate/[0-9a-f-]{36}$")
_S3 = re.compile(r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[A-Za-z0-9_.,:/@+=-]*)?$")
_AMI = re.compile(r"^ami-[0-9a-f]{8,17}$")
_PLACEMENT_GROUP = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")
#: Bucket names the docs and samples use as placeholders: a deploy with one would loop on a failing weight sync.
_PLACEHOLDER_BUCKETS = re.compile(r"^(replace-me|example|my-bucket|your-|changeme|placeholder)")
_EMAIL = re.compile(r"^[^@\s]+@[^@\s]+\.[^@\s]+$")
LOG_RETENTION_DAYS = (1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922,
                      3288, 3653)


#: Subnet sizes of a new VPC (infra.stacks.network): a public /24 and a private /20 in every AZ.
PUBLIC_SUBNET_MASK = 24
PRIVATE_SUBNET_MASK = 20


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


@dataclass(frozen=True)
class ExistingVpc:
    vpc_id: str
    cidr: str
    #: Private subnets, one per entry of ``network.availability_zones`` (same order).
    private_subnet_ids: tuple[str, ...]
    public_subnet_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class NetworkConfig:
    #: Two AZs at least (the ALB and the router need two); the engines live in ``availability_zone``.
    availability_zones: tuple[str, ...]
    cidr: str = "10.40.0.0/16"
    #: 0: engines and router have no internet path (VPC endpoints only; weights must come from S3).
    nat_gateways: int = 0
    existing: ExistingVpc | None = None
    flow_log_retention_days: int = 90

    @property
    def vpc_cidr(self) -> str:
        """The VPC's CIDR as a literal (security-group rules stay checkable at synth)."""
        return self.existing.cidr if self.existing else self.cidr


@dataclass(frozen=True)
class PoolConfig:
    name: str
    role: Role
    instance_type: str
    count: int
    #: On-Demand Capacity Reservation or Capacity Block id (``cr-...``).
    capacity_reservation_id: str | None = None
    #: True when the reservation is a Capacity Block (launch template market type ``capacity-block``).
    capacity_block: bool = False
    #: The cluster placement group an On-Demand Capacity Reservation was created in: instances must launch into
    #: that group to use the reservation (EC2: Capacity Reservations in cluster placement groups).
    placement_group: str | None = None

    @property
    def flavor(self) -> str:
        return INSTANCE_TYPES[self.instance_type].flavor.value


@dataclass(frozen=True)
class ModelConfig:
    id: str
    tensor_parallel_size: int = 8
    max_model_len: int = 32768
    served_model_name: str | None = None
    #: Weights prefix (``s3://bucket/prefix/``); required when the VPC has no NAT.
    s3_uri: str | None = None

    @property
    def name(self) -> str:
        return self.served_model_name or self.id


@dataclass(frozen=True)
class ConnectorConfig:
    mode: Mode = Mode.PULL
    bidirectional: bool = True


@dataclass(frozen=True)
class RouterConfig:
    replicas: int = 2
    max_replicas: int = 8
    cpu: int = 1024
    memory_mib: int = 2048
    #: ACM certificate: HTTPS on 443 (HTTP on 80 redirects); none: HTTP on 80.
    certificate_arn: str | None = None
    #: Internet-facing ALB (public subnets); otherwise internal.
    public: bool = False
    #: Who may reach the ALB listener. Empty: the VPC's CIDR only. 0.0.0.0/0 must be written out.
    allowed_cidrs: tuple[str, ...] = ()
    #: ALB idle timeout: long enough for the longest stream's silences (first token of a long prefill).
    idle_timeout_s: int = 900
    #: An internet-facing ALB without a certificate serves plain HTTP (Bearer keys in the clear): refused unless
    #: this says so explicitly.
    allow_http: bool = False

    @property
    def uses_valkey(self) -> bool:
        return self.replicas > 1 or self.max_replicas > 1


@dataclass(frozen=True)
class ImageConfig:
    #: Bring your own engine AMI (built from ami/ or equivalent): the deploy skips the Image Builder bake.
    ami_id: str | None = None


@dataclass(frozen=True)
class DeploymentConfig:
    name: str
    region: str
    availability_zone: str
    network: NetworkConfig
    model: ModelConfig
    pools: tuple[PoolConfig, ...]
    connector: ConnectorConfig = field(default_factory=ConnectorConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    image: ImageConfig = field(default_factory=ImageConfig)
    account: str | None = None
    alarm_email: str | None = None

    @property
    def prefix(self) -> str:
        """Resource-name prefix (ASGs, Cloud Map, log groups)."""
        return f"turnkv-{self.name}"

    def ami_parameter(self, flavor: str) -> str:
        return f"/turnkv/{self.name}/ami/{flavor}"


# ---------------------------------------------------------------- parsing


class _Reader:
    """Collects problems instead of stopping at the first one."""

    def __init__(self) -> None:
        self.problems: list[tuple[str, str]] = []

    def fail(self, path: str, message: str) -> None:
        self.problems.append((path, message))

    def mapping(self, value: Any, path: str, cls: type) -> Mapping[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            self.fail(path, f"expected a mapping, got {type(value).__name__}")
            return {}
        known = {f.name for f in fields(cls)}
        for key in value:
            if key not in known:
                self.fail(f"{path}.{key}" if path else key,
                          f"unknown field; known fields here: {', '.join(sorted(known))}")
        return value

    def get(self, data: Mapping[str, Any], key: str, path: str, kind: type | tuple[type, ...], default: Any = ...,
            fix: str = "") -> Any:
        where = f"{path}.{key}" if path else key
        if key not in data or data[key] is None:
            if default is ...:
                self.fail(where, f"required{'; ' + fix if fix else ''}")
                return None
            return default
        value = data[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if (bool not in kinds and isinstance(value, bool)) or not isinstance(value, kinds):
            self.fail(where, f"expected {' or '.join(k.__name__ for k in kinds)}, got {value!r}")
            return None if default is ... else default
        return value

    def enum(self, data: Mapping[str, Any], key: str, path: str, enum: type, default: Any = ...) -> Any:
        raw = self.get(data, key, path, str, default)
        if raw is None or isinstance(raw, enum):
            return raw
        try:
            return enum(raw)
        except ValueError:
            self.fail(f"{path}.{key}", f"{raw!r} is not one of {', '.join(e.value for e in enum)}")
            return None


def _strs(r: _Reader, data: Mapping[str, Any], key: str, path: str, default: Any = ...) -> tuple[str, ...]:
    value = r.get(data, key, path, (list, tuple), default)
    if value is None:
        return ()
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, str):
            r.fail(f"{path}.{key}[{i}]", f"expected a string, got {item!r}")
        else:
            out.append(item)
    return tuple(out)


def from_mapping(data: Mapping[str, Any]) -> DeploymentConfig:
    """Parse and validate; raise ConfigError listing every problem with its fix."""
    r = _Reader()
    top = r.mapping(data, "", DeploymentConfig)

    name = r.get(top, "name", "", str, fix="a short lowercase name such as 'prod'")
    if name is not None and not _NAME.match(name):
        r.fail("name", f"{name!r}: use 2-21 lowercase letters, digits or '-', starting with a letter "
                       "(it prefixes resource names)")
    region = r.get(top, "region", "", str, fix="e.g. us-east-2")
    if region is not None and not _REGION.match(region):
        r.fail("region", f"{region!r} is not an AWS region name (e.g. us-east-2)")
    account = r.get(top, "account", "", str, None)
    if account is not None and not _ACCOUNT.match(account):
        r.fail("account", f"{account!r}: 12 digits, quoted in YAML (or leave it out)")
    az = r.get(top, "availability_zone", "", str, fix="the AZ your GPU capacity is in, e.g. us-east-2b")
    if az and region and not (az.startswith(region) and len(az) == len(region) + 1):
        r.fail("availability_zone", f"{az!r} is not in region {region!r}; use e.g. {region}a")

    # network
    n = r.mapping(top.get("network"), "network", NetworkConfig)
    azs = _strs(r, n, "availability_zones", "network",
                (az, f"{region}{'b' if az and az.endswith('a') else 'a'}") if az and region else ...)
    if len(set(azs)) < 2:
        r.fail("network.availability_zones", "give at least two distinct AZs (the ALB needs two)")
    if az and azs and az not in azs:
        r.fail("network.availability_zones", f"must include availability_zone {az!r}")
    for i, zone in enumerate(azs):
        if region and not zone.startswith(region):
            r.fail(f"network.availability_zones[{i}]", f"{zone!r} is not in region {region!r}")
    cidr = r.get(n, "cidr", "network", str, "10.40.0.0/16")
    try:
        block = ipaddress.ip_network(cidr)
    except ValueError:
        r.fail("network.cidr", f"{cidr!r} is not a CIDR block (e.g. 10.40.0.0/16)")
    else:
        need = subnet_addresses(len(azs))
        if n.get("existing") is None and need > block.num_addresses:
            fits = 32 - (need - 1).bit_length()
            r.fail("network.cidr", f"{cidr} holds {block.num_addresses} addresses; {len(azs)} AZs need a public "
                                   f"/{PUBLIC_SUBNET_MASK} and a private /{PRIVATE_SUBNET_MASK} each ({need}): use a "
                                   f"/{fits} or larger block, or fewer network.availability_zones")
    nat = r.get(n, "nat_gateways", "network", int, 0)
    if nat is not None and not 0 <= nat <= len(azs or (1,)):
        r.fail("network.nat_gateways", f"{nat}: use 0 (no internet path) up to one per AZ ({len(azs)})")
    retention = r.get(n, "flow_log_retention_days", "network", int, 90)
    if retention is not None and retention not in LOG_RETENTION_DAYS:
        r.fail("network.flow_log_retention_days", f"{retention}: CloudWatch Logs keeps logs for one of "
                                                  f"{', '.join(map(str, LOG_RETENTION_DAYS))} days")
    existing = None
    if n.get("existing") is not None:
        e = r.mapping(n["existing"], "network.existing", ExistingVpc)
        vpc_id = r.get(e, "vpc_id", "network.existing", str)
        if vpc_id and not _VPC.match(vpc_id):
            r.fail("network.existing.vpc_id", f"{vpc_id!r} is not a VPC id (vpc-...)")
        vpc_cidr = r.get(e, "cidr", "network.existing", str, fix="the VPC's primary CIDR")
        private = _strs(r, e, "private_subnet_ids", "network.existing")
        public = _strs(r, e, "public_subnet_ids", "network.existing", ())
        for key, ids in (("private_subnet_ids", private), ("public_subnet_ids", public)):
            if ids and len(ids) != len(azs):
                r.fail(f"network.existing.{key}",
                       f"give one subnet per network.availability_zones entry ({len(azs)}), in the same order")
            for i, sid in enumerate(ids):
                if not _SUBNET.match(sid):
                    r.fail(f"network.existing.{key}[{i}]", f"{sid!r} is not a subnet id (subnet-...)")
        existing = ExistingVpc(vpc_id or "", vpc_cidr or "", private, public)

    # model
    m = r.mapping(top.get("model"), "model", ModelConfig)
    model_id = r.get(m, "id", "model", str, fix="a Hugging Face id such as Qwen/Qwen3-32B")
    tp = r.get(m, "tensor_parallel_size", "model", int, 8)
    max_len = r.get(m, "max_model_len", "model", int, 32768)
    served = r.get(m, "served_model_name", "model", str, None)
    s3_uri = r.get(m, "s3_uri", "model", str, None)
    for key, value in (("id", model_id), ("served_model_name", served)):
        if value:
            try:
                check_value("TURNKV_MODEL", value)
            except ValueError:
                r.fail(f"model.{key}", f"{value!r}: letters, digits and _.,:/@+=- only")
    if tp is not None and (tp < 1 or tp & (tp - 1)):
        r.fail("model.tensor_parallel_size", f"{tp}: use a power of two (1, 2, 4, 8, ...)")
    if max_len is not None and not 256 <= max_len <= 10_000_000:
        r.fail("model.max_model_len", f"{max_len}: use 256 .. 10000000 tokens")
    if s3_uri is not None and not _S3.match(s3_uri):
        r.fail("model.s3_uri", f"{s3_uri!r}: expected s3://bucket/prefix/")
    elif s3_uri is not None and _PLACEHOLDER_BUCKETS.match(s3_uri[len("s3://"):]):
        r.fail("model.s3_uri", f"{s3_uri!r} is a placeholder; upload the weights (aws s3 sync ./<model> "
                               "s3://<your-bucket>/<model>/) and name that prefix, or drop s3_uri and set "
                               "network.nat_gateways: 1 to download from Hugging Face")
    if nat == 0 and existing is None and not s3_uri:
        r.fail("model.s3_uri", "required when network.nat_gateways is 0 (engines have no internet path to "
                               "download weights); upload the weights to S3 or set network.nat_gateways: 1")

    # connector
    c = r.mapping(top.get("connector"), "connector", ConnectorConfig)
    mode = r.enum(c, "mode", "connector", Mode, Mode.PULL)
    bidirectional = r.get(c, "bidirectional", "connector", bool, True)

    # pools
    raw_pools = r.get(top, "pools", "", (list, tuple),
                      fix="a list with at least one prefill and one decode pool")
    pools: list[PoolConfig] = []
    for i, raw in enumerate(raw_pools or ()):
        path = f"pools[{i}]"
        p = r.mapping(raw, path, PoolConfig)
        role = r.enum(p, "role", path, Role)
        pname = r.get(p, "name", path, str, role.value if role else "pool")
        if pname and not re.fullmatch(r"[a-z][a-z0-9-]{0,15}", pname):
            r.fail(f"{path}.name", f"{pname!r}: 1-16 lowercase letters, digits or '-'")
        itype = r.get(p, "instance_type", path, str)
        if itype is not None and itype not in INSTANCE_TYPES:
            r.fail(f"{path}.instance_type", f"{itype!r} is not supported; use one of {', '.join(INSTANCE_TYPES)}")
        count = r.get(p, "count", path, int, 1)
        if count is not None and not 0 <= count <= 64:
            r.fail(f"{path}.count", f"{count}: use 0 .. 64")
        reservation = r.get(p, "capacity_reservation_id", path, str, None)
        if reservation is not None and not _ODCR.match(reservation):
            r.fail(f"{path}.capacity_reservation_id", f"{reservation!r} is not a reservation id (cr- and 17 hex)")
        block = r.get(p, "capacity_block", path, bool, False)
        if block and not reservation:
            r.fail(f"{path}.capacity_block", "a Capacity Block needs its id in capacity_reservation_id")
        placement = r.get(p, "placement_group", path, str, None)
        if placement is not None:
            if not _PLACEMENT_GROUP.match(placement):
                r.fail(f"{path}.placement_group", f"{placement!r} is not a placement group name")
            elif not reservation or block:
                r.fail(f"{path}.placement_group", "only for an On-Demand Capacity Reservation created in a cluster "
                                                  "placement group: set capacity_reservation_id too (a Capacity "
                                                  "Block places its instances itself; a pool without a reservation "
                                                  "joins the deployment's own placement group)")
        if itype in INSTANCE_TYPES and INSTANCE_TYPES[itype].flavor is Flavor.NEURON:
            gpus = ", ".join(t for t, prof in INSTANCE_TYPES.items() if prof.flavor is Flavor.GPU)
            r.fail(f"{path}.instance_type",
                   f"{itype} is a Trainium (Neuron) instance: the Neuron image has no NIXL and no vLLM that "
                   f"turnkv's KV connector supports yet, so its engines would restart forever and never serve; "
                   f"use a GPU instance type ({gpus})")
        if itype in INSTANCE_TYPES and tp and tp > INSTANCE_TYPES[itype].accelerators:
            r.fail("model.tensor_parallel_size",
                   f"{tp} exceeds the {INSTANCE_TYPES[itype].accelerators} accelerators of {itype} ({path}); "
                   f"lower it or pick a larger instance type")
        pools.append(PoolConfig(pname or "", role or Role.PREFILL, itype or "", count or 0, reservation, bool(block),
                                placement))
    if raw_pools is not None:
        roles = {p.role for p in pools}
        for role in Role:
            if role not in roles:
                r.fail("pools", f"no {role.value} pool; add one with role: {role.value}")
        names = [p.name for p in pools]
        for dup in sorted({x for x in names if names.count(x) > 1}):
            r.fail("pools", f"pool name {dup!r} is used twice; give each pool its own name")
        flavors = {p.flavor for p in pools if p.instance_type in INSTANCE_TYPES}
        if len(flavors) > 1:
            r.fail("pools", "prefill and decode must run on the same accelerator family (GPU or Neuron): KV "
                            "blocks move between them as is")

    # router
    rt = r.mapping(top.get("router"), "router", RouterConfig)
    replicas = r.get(rt, "replicas", "router", int, 2)
    max_replicas = r.get(rt, "max_replicas", "router", int, max(8, replicas or 1))
    if replicas is not None and not 1 <= replicas <= 100:
        r.fail("router.replicas", f"{replicas}: use 1 .. 100")
    if replicas and max_replicas is not None and max_replicas < replicas:
        r.fail("router.max_replicas", f"{max_replicas} is below router.replicas ({replicas}); raise it")
    cpu = r.get(rt, "cpu", "router", int, 1024)
    memory = r.get(rt, "memory_mib", "router", int, 2048)
    fargate = {256: (512, 2048), 512: (1024, 4096), 1024: (2048, 8192), 2048: (4096, 16384), 4096: (8192, 30720),
               8192: (16384, 61440), 16384: (32768, 122880)}
    if cpu not in fargate:
        r.fail("router.cpu", f"{cpu}: Fargate takes one of {', '.join(map(str, fargate))} (CPU units)")
    elif memory is not None and not fargate[cpu][0] <= memory <= fargate[cpu][1]:
        r.fail("router.memory_mib", f"{memory}: with cpu {cpu} Fargate takes {fargate[cpu][0]} .. {fargate[cpu][1]}")
    cert = r.get(rt, "certificate_arn", "router", str, None)
    if cert is not None and not _ACM.match(cert):
        r.fail("router.certificate_arn", f"{cert!r} is not an ACM certificate ARN")
    if cert and region and f":acm:{region}:" not in cert:
        r.fail("router.certificate_arn", f"the certificate must be in {region} (the ALB's region)")
    public = r.get(rt, "public", "router", bool, False)
    cidrs = _strs(r, rt, "allowed_cidrs", "router", ())
    for i, block_ in enumerate(cidrs):
        try:
            ipaddress.ip_network(block_)
        except ValueError:
            r.fail(f"router.allowed_cidrs[{i}]", f"{block_!r} is not a CIDR block (e.g. 203.0.113.0/24)")
    if public and existing is not None and not existing.public_subnet_ids:
        r.fail("router.public", "an internet-facing ALB needs network.existing.public_subnet_ids; add them or set "
                                "router.public: false")
    allow_http = r.get(rt, "allow_http", "router", bool, False)
    if public and not cert and not allow_http:
        r.fail("router.certificate_arn", "required for an internet-facing router (router.public: true): clients "
                                         "send their API keys as Bearer tokens; add an ACM certificate ARN, or set "
                                         "router.allow_http: true to serve plain HTTP knowingly")
    if public and not cidrs:
        r.fail("router.allowed_cidrs", "an internet-facing router needs the client CIDRs that may reach it "
                                       "(write 0.0.0.0/0 explicitly to open it to everyone)")
    idle = r.get(rt, "idle_timeout_s", "router", int, 900)
    if idle is not None and not 60 <= idle <= 4000:
        r.fail("router.idle_timeout_s", f"{idle}: use 60 .. 4000 s (ALB limit 4000)")

    im = r.mapping(top.get("image"), "image", ImageConfig)
    ami_id = r.get(im, "ami_id", "image", str, None)
    if ami_id is not None and not _AMI.match(ami_id):
        r.fail("image.ami_id", f"{ami_id!r} is not an AMI id (ami- and 8 or 17 hex); leave it out to bake one")

    alarm_email = r.get(top, "alarm_email", "", str, None)
    if alarm_email is not None and not _EMAIL.match(alarm_email):
        r.fail("alarm_email", f"{alarm_email!r} is not an e-mail address")

    if r.problems:
        raise ConfigError(r.problems)
    return DeploymentConfig(
        name=name, region=region, availability_zone=az, account=account, alarm_email=alarm_email,
        network=NetworkConfig(availability_zones=azs, cidr=cidr, nat_gateways=nat, existing=existing,
                              flow_log_retention_days=retention),
        model=ModelConfig(id=model_id, tensor_parallel_size=tp, max_model_len=max_len, served_model_name=served,
                          s3_uri=s3_uri),
        connector=ConnectorConfig(mode=mode, bidirectional=bidirectional),
        pools=tuple(pools),
        image=ImageConfig(ami_id=ami_id),
        router=RouterConfig(replicas=replicas, max_replicas=max_replicas, cpu=cpu, memory_mib=memory,
                            certificate_arn=cert, public=public, allowed_cidrs=cidrs, idle_timeout_s=idle,
                            allow_http=bool(allow_http)),
    )


def load_file(path: str | Path) -> Mapping[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError([("turnkv:config", f"{path} does not exist; pass -c turnkv:config=PATH to a YAML/JSON file")])
    text = path.read_text()
    if path.suffix in {".yaml", ".yml"}:
        import yaml

        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if not isinstance(data, Mapping):
        raise ConfigError([("turnkv:config", f"{path} must hold a mapping at the top")])
    return data


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
