"""Params: every tunable of ``turnkv.params.CATALOG`` as an SSM parameter with its default, description and
allowed pattern (the same ones ``turnkv params set`` writes).

The operator owns the values: each parameter's Value is the ``Tunables`` custom resource's attribute of its
name (``infra/lambdas/keep_tunables.py``), the live value where one exists and fits the catalog, else the
deployment's default. A kit upgrade that changes a tunable's description or default rewrites the description and
keeps an operator's ``turnkv params set``; ``turnkv params diff`` reports the defaults that differ."""

from __future__ import annotations

import hashlib
import json

from aws_cdk import CfnCustomResource, Duration, RemovalPolicy, Stack, Token
from aws_cdk import aws_iam as iam
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_logs as logs
from aws_cdk import aws_ssm as ssm
from constructs import Construct

from infra import host_tier
from infra.config import DeploymentConfig
from infra.lambdas import KEEP_TUNABLES
from turnkv import params
from turnkv.aws_params import allowed_pattern, description
from turnkv.engine_args import Role

LAMBDA_RUNTIME = lambda_.Runtime.PYTHON_3_14


class ParamsStack(Stack):
    def __init__(self, scope: Construct, construct_id: str, *, config: DeploymentConfig, **kwargs) -> None:
        super().__init__(scope, construct_id, **kwargs)
        # The catalog's cross-checks hold for the defaults (a broken catalog fails the synth here).
        params.cross_check(params.defaults())
        self.parameters: dict[str, ssm.CfnParameter] = {}
        values = deployment_defaults(config)
        spec = tunable_spec(config.name, values)
        described = {t.name: description(t) for t in params.CATALOG}
        tags = {t.name: {"turnkv:deployment": config.name, "turnkv:scope": t.scope.value} for t in params.CATALOG}
        kept = self._keeper(config, spec, revision=_digest([spec, described, tags]))
        for tunable in params.CATALOG:
            self.parameters[tunable.name] = ssm.CfnParameter(
                self, _logical_id(tunable.name),
                name=spec[tunable.name]["path"],
                type="String",
                value=Token.as_string(kept.get_att(tunable.name)),
                description=described[tunable.name],
                allowed_pattern=spec[tunable.name]["pattern"],
                tier="Standard",
                tags=tags[tunable.name],
            )

    def _keeper(self, config: DeploymentConfig, spec: dict[str, dict[str, str]], revision: str) -> CfnCustomResource:
        """The custom resource whose attributes are the values to write (``infra/lambdas/keep_tunables.py``). Its
        ``Revision`` is a digest of everything the parameter resources carry, so any change to them reads the live
        values first; an unchanged template touches nothing."""
        log_group = logs.LogGroup(self, "KeepTunablesLogs", retention=logs.RetentionDays.ONE_MONTH,
                                  removal_policy=RemovalPolicy.DESTROY)
        role = iam.Role(self, "KeepTunablesRole", assumed_by=iam.ServicePrincipal("lambda.amazonaws.com"))
        role.add_to_policy(iam.PolicyStatement(actions=["ssm:GetParameters"],
                                               resources=[parameter_arn(self, config.name, "*")]))
        role.add_to_policy(iam.PolicyStatement(actions=["logs:CreateLogStream", "logs:PutLogEvents"],
                                               resources=[f"{log_group.log_group_arn}:*"]))
        self.keeper_function = lambda_.Function(
            self, "KeepTunables", runtime=LAMBDA_RUNTIME, handler="index.handler",
            code=lambda_.Code.from_inline(KEEP_TUNABLES.read_text()), role=role, timeout=Duration.seconds(60),
            log_group=log_group, description=f"turnkv {config.name}: keep the operator's tunables across upgrades")
        keeper = CfnCustomResource(self, "Tunables", service_token=self.keeper_function.function_arn)
        keeper.add_property_override("Tunables", json.dumps(spec, sort_keys=True, separators=(",", ":")))
        keeper.add_property_override("Revision", revision)
        keeper.node.add_dependency(role)
        return keeper


def tunable_spec(deployment: str, values: dict[str, int | float]) -> dict[str, dict[str, str]]:
    """What the keeper checks a live value against, per tunable: its path, SSM pattern, bounds and the default."""
    return {t.name: {"path": t.ssm_path(deployment), "pattern": allowed_pattern(t), "min": str(t.minimum),
                     "max": str(t.maximum), "default": str(values[t.name])} for t in params.CATALOG}


def _digest(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


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
