"""The host tier a deployment's decode engines start with (pure): half the decode node's host memory per node
(``infra.instances.host_tier_budget_mib``), or none, said at config time, for a model the tier refuses.

The engine refuses the host tier for MLA models (``connector.worker``: every rank holds the same latent KV, and a
pool shared through rank 0 is not built), and with it the FLASHMLA kernel's 64-token blocks under turnkv's
``--block-size 128``. A deploy default of half the host memory for such a model would pin nothing, log an error on
every start and keep the ``HostTierShort-decode`` alarm on, so a model the catalog (``turnkv.plan.architectures``)
knows as MLA gets 0, and ``turnkv config validate`` says why. A model the catalog does not know is caught at engine
start (the error line, ``vllm:turnkv_host_tier_granted_bytes`` 0, the alarm)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from infra.instances import Flavor, host_tier_budget_mib

if TYPE_CHECKING:
    from infra.config import DeploymentConfig


def refusal(model_id: str) -> str | None:
    """Why the host tier cannot serve ``model_id`` (None: it can, or the catalog does not know the model)."""
    from turnkv.plan import architectures

    name = model_id.rstrip("/").rsplit("/", 1)[-1].lower()
    arch = next((a for key, a in architectures.CATALOG.items() if key.lower() == name), None)
    if arch is None or not arch.mla:
        return None
    return (f"{arch.name} is an MLA model: the host tier does not serve MLA (one latent copy per rank; with an fp8 "
            f"KV cache, FLASHMLA's 64-token kernel blocks under --block-size 128), so decode starts without it")


def default_mib(config: DeploymentConfig) -> tuple[int, str]:
    """(host_kv_budget_mib each decode engine starts with, why) for ``config``; 0 without a decode pool."""
    from turnkv.engine_args import Role

    decode = next((p for p in config.pools if p.role is Role.DECODE), None)
    if decode is None:
        return 0, "no decode pool"
    if decode.flavor == Flavor.NEURON.value:
        from turnkv import neuron

        return 0, neuron.HOST_TIER_NOTE
    why = refusal(config.model.id)
    if why:
        return 0, why
    budget = host_tier_budget_mib(decode.instance_type, config.model.tensor_parallel_size,
                                  engines=config.engines_per_node(decode))
    return budget, f"half of {decode.instance_type}'s host memory over its engines"
