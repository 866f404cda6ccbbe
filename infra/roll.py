"""How a new launch template (a new AMI, new user data) rolls over the engine pools, and what it costs (pure).

One source for the engine groups' update policies and lifecycle hooks (``infra.constructs.engine_group``), their
order (``infra.stacks.serving``) and the plan ``turnkv config validate`` prints before a deploy:

- **One group at a time**: every prefill pool, then every decode pool (a CloudFormation ``DependsOn`` chain: a
  resource is updated only after the one it depends on; two groups without one roll in parallel, so a role of
  ``count: 1`` pools would be empty while both boot).
- **One instance at a time** (``MaxBatchSize`` 1), the next only after the new one signalled that its engine is
  healthy and registered (``WaitOnResourceSignals``).
- **Surge where the pool allows**: a pool with room for one more instance (no reservation, or
  ``roll_surge: true`` for a reservation that holds ``count + 1``) keeps every engine in service
  (``MinInstancesInService`` = count, ``MaxSize`` = count + 1); a reservation of exactly ``count`` replaces in place
  (count - 1 in service), which for a one-node role takes the role down for a boot and a weight load.
- **Drain before terminate**: the terminate lifecycle hook waits for the node (``turnkv engine drain``) for up to
  ``drain_timeout_s``, then continues (the bound when a node cannot answer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from infra.config import DeploymentConfig, PoolConfig
from infra.instances import INSTANCE_TYPES
from turnkv.engine_args import Role

#: Auto Scaling's bounds for a lifecycle hook's heartbeat timeout, in seconds (the AWS::AutoScaling::LifecycleHook
#: HeartbeatTimeout property: 30 to 7200).
HOOK_TIMEOUT_RANGE = (30, 7200)
#: Seconds the hook waits past the node's own drain bound: the node completes the action after its drain, this
#: margin covers the call itself and a node's clock.
HOOK_MARGIN_S = 60
#: How long a replacement node takes to serve, by the deploy guide's table (boot, weights, compile), in minutes.
BOOT_TO_SERVE_MIN = (15, 30)
#: Role order of a roll: prefill first (a prefill gap costs new prompts a recompute elsewhere; decode holds the
#: retained KV and the streams, so it is drained last, when every prefill already serves on the new image).
ROLE_ORDER = (Role.PREFILL, Role.DECODE)


def group_name(deployment_prefix: str, pool_name: str) -> str:
    """The pool's Auto Scaling group (and launch template) name: IAM statements name it exactly, so a wildcard
    over the deployment's prefix never reaches another deployment's groups (``turnkv-prod-*`` would match
    ``turnkv-prod-x-...``); the node's drain agent names it when it completes the lifecycle action."""
    return f"{deployment_prefix}-{pool_name}"


@dataclass(frozen=True)
class PoolRoll:
    pool: str
    role: Role
    count: int
    #: The group's MaxSize (count + 1 with a surge).
    max_size: int
    #: The rolling update's MinInstancesInService.
    min_in_service: int
    #: vCPUs of the surge instance (0 without one): the quota a roll needs beyond the pools' own.
    surge_vcpus: int
    #: The terminate hook's heartbeat timeout (s): the node's drain bound plus ``HOOK_MARGIN_S``.
    hook_timeout_s: int

    @property
    def surge(self) -> bool:
        return self.max_size > self.count


def surges(pool: PoolConfig) -> bool:
    """Whether the pool launches one instance above its size during a roll (``roll_surge``; by default only a pool
    without a reservation, whose room is On-Demand capacity)."""
    if pool.roll_surge is not None:
        return pool.roll_surge
    return not pool.capacity_reservation_id


def pool_roll(pool: PoolConfig) -> PoolRoll:
    surge = surges(pool)
    return PoolRoll(
        pool=pool.name, role=pool.role, count=pool.count,
        max_size=pool.count + 1 if surge else pool.count,
        min_in_service=pool.count if surge else pool.count - 1,
        surge_vcpus=INSTANCE_TYPES[pool.instance_type].vcpus if surge else 0,
        hook_timeout_s=min(pool.drain_timeout_s + HOOK_MARGIN_S, HOOK_TIMEOUT_RANGE[1]))


def roll_order(pools: Sequence[PoolConfig]) -> list[PoolConfig]:
    """The order the groups roll in: ``ROLE_ORDER``, then the config's order within a role."""
    return sorted(pools, key=lambda p: ROLE_ORDER.index(p.role))


def plan(config: DeploymentConfig) -> list[str]:
    """What a roll of every pool costs, one line per pool in roll order, then one per role that a roll empties."""
    lines: list[str] = []
    for pool in roll_order(config.pools):
        r = pool_roll(pool)
        how = (f"surge 1 (+{r.surge_vcpus} vCPUs of quota while it boots)" if r.surge
               else "in place (no room to surge)")
        lines.append(f"{r.pool} ({r.role.value}, {r.count} x {pool.instance_type}): one node at a time, {how}; "
                     f"{r.min_in_service} of {r.count} in service; each old node drains up to "
                     f"{pool.drain_timeout_s} s")
    for role in ROLE_ORDER:
        rolls = [pool_roll(p) for p in config.pools if p.role is role]
        total = sum(r.count for r in rolls)
        emptied = [r.pool for r in rolls if total - r.count + r.min_in_service == 0]
        if emptied:
            lo, hi = BOOT_TO_SERVE_MIN
            lines.append(f"warning: a roll empties {role.value} ({', '.join(emptied)}: one node, a reservation of "
                         f"exactly its count, no surge): no {role.value} engine serves for a boot and a weight load "
                         f"({lo}-{hi} min). Choose: roll_surge: true if the reservation holds one more instance, "
                         f"count: 2, or deploy the change in a maintenance window")
    return lines


def peak_vcpus(config: DeploymentConfig) -> int:
    """vCPUs the pools hold, plus the one surge instance a roll adds at a time (groups roll one after another)."""
    held = sum(p.count * INSTANCE_TYPES[p.instance_type].vcpus for p in config.pools)
    return held + max((pool_roll(p).surge_vcpus for p in config.pools), default=0)
