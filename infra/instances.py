"""Engine instance types: the ONE table of EFA interface layouts and accelerator counts.

Pure data (no CDK import), so the config validation, the launch-template construct and the tests all
read the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Flavor(StrEnum):
    """Which AMI an instance type boots (``/turnkv/<deployment>/ami/<flavor>``)."""

    GPU = "gpu"
    NEURON = "neuron"


@dataclass(frozen=True)
class InstanceProfile:
    instance_type: str
    flavor: Flavor
    #: EFA interfaces (``EfaInfo.MaximumEfaInterfaces``); one network card each.
    efa_interfaces: int
    #: Devices a tensor-parallel group can span: GPUs, or logical NeuronCores (LNC=2 on trn2).
    accelerators: int
    #: Host memory (EC2 instance type specifications): what decode's host tier of retained turns can draw on.
    host_memory_gib: int = 2048
    #: Root volume: the image (baked on 200 GiB: ``ami.recipes``; a launch needs at least its snapshot's size), vLLM's
    #: compile caches and logs. Weights go to the instance NVMe every supported type has (``infra.bootstrap``), so
    #: 300 GiB of gp3 at its baseline IOPS, not 1000 GiB at 16k IOPS (~$30 a month per node instead of ~$180).
    root_volume_gib: int = 300
    #: vCPUs (the unit of the Running On-Demand P / Trn instances quotas; EC2 instance type specifications).
    vcpus: int = 192


#: p5en 16 EFA, p5/p5e 32, trn2 16, trn1 8 (AWS HPC recipes, moto's instance data, EC2 user guide); host
#: memory 2,048 GiB on p5en, p5, p5e and trn2, 512 GiB on trn1 (EC2 accelerated computing specifications).
INSTANCE_TYPES: dict[str, InstanceProfile] = {
    p.instance_type: p
    for p in (
        InstanceProfile("p5en.48xlarge", Flavor.GPU, efa_interfaces=16, accelerators=8),
        InstanceProfile("p5.48xlarge", Flavor.GPU, efa_interfaces=32, accelerators=8),
        InstanceProfile("p5e.48xlarge", Flavor.GPU, efa_interfaces=32, accelerators=8),
        InstanceProfile("trn2.48xlarge", Flavor.NEURON, efa_interfaces=16, accelerators=64),
        InstanceProfile("trn1.32xlarge", Flavor.NEURON, efa_interfaces=8, accelerators=32, host_memory_gib=512,
                        vcpus=128),
    )
}


@dataclass(frozen=True)
class InterfaceSlot:
    network_card_index: int
    device_index: int
    interface_type: str  # "efa" (EFA + ENA, carries the instance's IP) or "efa-only" (no IP)


#: Where EC2 offers the Neuron instance types (availability zones; a region's are the AZs that start with its name), as
#: DescribeInstanceTypeOfferings answered when moto 5.2.5 recorded it (moto/ec2/resources/instance_type_offerings/
#: availability-zone/*.json.gz). A snapshot: EC2 adds zones, so a zone missing here is refused with the command
#: that checks it now and the key that confirms it (``pools[].offering_confirmed``). GPU types are not listed (not
#: checked; trn1 is refused on other grounds).
OFFERINGS_SOURCE = ("moto 5.2.5, ec2/resources/instance_type_offerings/availability-zone "
                    "(EC2 DescribeInstanceTypeOfferings)")
OFFERED_AZS: dict[str, frozenset[str]] = {
    "trn2.48xlarge": frozenset({"ap-south-2a", "ap-south-2b", "ap-south-2c", "us-east-2a", "us-east-2b", "us-east-2c"}),
    "trn2.3xlarge": frozenset({"ap-south-2a", "ap-south-2b", "ap-south-2c", "ap-southeast-4c", "sa-east-1a",
                               "sa-east-1b", "sa-east-1c"}),
}


def offered_in(instance_type: str, zone_or_region: str) -> bool | None:
    """Whether the snapshot lists ``instance_type`` in that AZ (or any AZ of that region); None: not tracked."""
    zones = OFFERED_AZS.get(instance_type)
    if zones is None:
        return None
    return any(zone_or_region in (z, z[:-1]) for z in zones)


def offering_command(instance_type: str, region: str) -> str:
    """The AWS CLI call that answers where ``instance_type`` is offered in ``region`` today."""
    return (f"aws ec2 describe-instance-type-offerings --region {region} --location-type availability-zone "
            f"--filters Name=instance-type,Values={instance_type} --query 'InstanceTypeOfferings[].Location'")


def efa_layout(instance_type: str) -> tuple[InterfaceSlot, ...]:
    """Card 0 device 0: ``efa`` (the IP for HTTP and the NIXL side channel); every other card: ``efa-only``."""
    profile = INSTANCE_TYPES[instance_type]
    return tuple(
        InterfaceSlot(card, 0, "efa" if card == 0 else "efa-only") for card in range(profile.efa_interfaces)
    )


#: Share of a decode node's host memory its engines' host tiers take by default: the rest stays for vLLM (weights
#: staging, CPU-side buffers), the OS and NIXL's bounce buffers.
HOST_TIER_SHARE = 0.5


def host_tier_budget_mib(instance_type: str, tensor_parallel_size: int, share: float = HOST_TIER_SHARE,
                         engines: int | None = None) -> int:
    """Each decode engine's default ``host_kv_budget_mib``: ``share`` of the node's host memory, split between the
    engines a node runs (``engines``; default its accelerators over the tensor-parallel size)."""
    profile = INSTANCE_TYPES[instance_type]
    if engines is None:
        engines = max(1, profile.accelerators // max(1, tensor_parallel_size))
    return int(profile.host_memory_gib * 1024 * share) // engines
