"""Params: every tunable of ``turnkv.params.CATALOG`` as an SSM parameter with its default, description and
allowed pattern (the same ones ``turnkv params set`` writes)."""

from __future__ import annotations

from aws_cdk import Stack
from aws_cdk import aws_ssm as ssm
from constructs import Construct

from infra import host_tier
from infra.config import DeploymentConfig
from turnkv import params
from turnkv.aws_params import allowed_pattern, description
from turnkv.engine_args import Role


class ParamsStack(Stack):
    def __init__(self, scope: Construct, construct_id: str, *, config: DeploymentConfig, **kwargs) -> None:
        super().__init__(scope, construct_id, **kwargs)
        # The catalog's cross-checks hold for the defaults (a broken catalog fails the synth here).
        params.cross_check(params.defaults())
        self.parameters: dict[str, ssm.CfnParameter] = {}
        values = deployment_defaults(config)
        for tunable in params.CATALOG:
            self.parameters[tunable.name] = ssm.CfnParameter(
                self, _logical_id(tunable.name),
                name=tunable.ssm_path(config.name),
                type="String",
                value=str(values[tunable.name]),
                description=description(tunable),
                allowed_pattern=allowed_pattern(tunable),
                tier="Standard",
                tags={"turnkv:deployment": config.name, "turnkv:scope": tunable.scope.value},
            )


def deployment_defaults(config: DeploymentConfig) -> dict[str, int | float]:
    """The catalog's defaults, with what depends on the deployment's nodes: the host tier of retained turns sized
    from the decode pool's host memory (``infra.host_tier.default_mib``; 0 without a decode pool, and for a model
    the host tier refuses), the router's decode share from the engines' ``model.max_num_seqs`` when set (the
    catalog's is vLLM's default on the supported GPUs); then the config's ``tunables``."""
    values = params.defaults()
    if any(p.role is Role.DECODE for p in config.pools):
        budget, _ = host_tier.default_mib(config)  # 0 for a model the host tier refuses (infra.host_tier)
        values["host_kv_budget_mib"] = params.get("host_kv_budget_mib").parse(budget)
    if config.model.max_num_seqs is not None:
        values["decode_fair_sequences"] = params.get("decode_fair_sequences").parse(config.model.max_num_seqs)
    # The deploy config's initial tunables over them (validated with the config; cross-checked again here).
    return params.validate(params.fit_router_ttl(config.tunables), values)


def parameter_arn(stack: Stack, deployment: str, suffix: str) -> str:
    """ARN (pattern) of parameters under ``/turnkv/<deployment>/<suffix>``, in ``stack``'s account and region."""
    return stack.format_arn(service="ssm", resource="parameter",
                            resource_name=f"{params.SSM_PREFIX[1:]}/{deployment}/{suffix}")


def _logical_id(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))
