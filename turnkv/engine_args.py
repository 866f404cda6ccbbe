"""How a turnkv engine is launched: the ``vllm serve`` flags, ``--kv-transfer-config`` and environment.

One pure function serves the local stack (``turnkv local up``), the AWS user data (infra) and the
tests, so an engine runs with the same settings everywhere. No I/O here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import StrEnum

from turnkv import neuron, params, wire
from turnkv.engine_settings import EngineSettings
from turnkv.media import internal_host


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


class Mode(StrEnum):
    """KV transfer direction set-up: pull (decode READs from prefill) or push (prefill WRITEs)."""

    PULL = "pull"
    PUSH = "push"


#: Connector classes by mode, both turnkv's (bi-directional, token proof, retain on demand, adaptive
#: threshold). Upstream's push connector cannot do bi-directional transfer (``connector.push`` can).
CONNECTORS = {
    Mode.PULL: ("TurnkvPullConnector", "connector.pull"),
    Mode.PUSH: ("TurnkvPushConnector", "connector.push"),
}
#: Upstream's push connector raises NotImplementedError when bi-directional transfer is configured.
_NO_BIDIRECTIONAL = {"NixlPushConnector"}


@dataclass(frozen=True)
class EngineSpec:
    role: Role
    engine_id: str
    model: str
    port: int
    side_channel_port: int
    side_channel_host: str = "127.0.0.1"
    host: str = "127.0.0.1"
    served_model_name: str | None = None
    mode: Mode = Mode.PULL
    bidirectional: bool = True
    tensor_parallel_size: int = 1
    max_model_len: int = 8192
    block_size: int = 128
    prefix_caching: bool = True
    enforce_eager: bool = False
    load_format: str | None = None
    dtype: str = "auto"
    #: NIXL backends: ["UCX"] locally, ["LIBFABRIC"] on EFA.
    backends: tuple[str, ...] = ("UCX",)
    #: Engine tunables (catalog names), defaults from turnkv.params.
    tunables: dict[str, int | float] = field(default_factory=lambda: params.defaults(params.Scope.ENGINE))
    #: The model's engine settings (deploy config ``model``: KV cache dtype, parsers, ...); vLLM's defaults if unset.
    settings: EngineSettings = field(default_factory=EngineSettings)
    #: Flags passed as given (the local stack's tests and benchmarks); deployments use ``settings.extra_args``.
    extra_args: tuple[str, ...] = ()
    #: Hosts the engine may fetch media URLs from (vLLM ``--allowed-media-domains``, exact host names); empty:
    #: vLLM's default (any), with the router refusing internal addresses (router.intake). Internal addresses
    #: (loopback, private, link-local such as 169.254.169.254) are refused here.
    allowed_media_domains: tuple[str, ...] = ()
    #: A connector class other than the mode's (e.g. upstream "NixlPushConnector", no module path).
    connector: str | None = None
    #: File holding the deployment's offer secret (``turnkv.wire``): decode signs its offers with it and prefill
    #: reads only offers it verifies. ``turnkv local up`` generates one; on AWS the node's user data writes
    #: the deployment's Secrets Manager secret there.
    offer_secret_file: str | None = None
    #: The node image's accelerator family (``gpu`` or ``neuron``, what the AMI records); empty locally. On Neuron
    #: the engine needs the plugin's platform allow-listed, device-memory KV buffers and the settings in
    #: ``turnkv.neuron``.
    flavor: str = ""
    #: Prefill only: GiB of host memory for vLLM's native CPU offloading tier (``--kv-offloading-size``'s
    #: ``OffloadingConnector``), run beside turnkv's connector in a ``MultiConnector`` (OFFLOAD_CONNECTOR). 0: none.
    prefill_offload_gib: float = 0.0

    @property
    def on_neuron(self) -> bool:
        return self.flavor == neuron.PLATFORM_PLUGIN


#: vLLM's native CPU offloading tier (what ``--kv-offloading-backend native --kv-offloading-size`` configures:
#: ``VllmConfig._post_init_kv_transfer_config``), with its one required key. Spelled out here because
#: ``--kv-offloading-size`` alone *replaces* a ``--kv-transfer-config`` connector: beside turnkv's it must be a
#: child of a ``MultiConnector``.
OFFLOAD_CONNECTOR = "OffloadingConnector"
OFFLOAD_BYTES_KEY = "cpu_bytes_to_use"
MULTI_CONNECTOR = "MultiConnector"
#: Why an offload tier is refused where it is (vLLM 0.32 ``vllm/v1/kv_offload/cpu/spec.py`` raises at start on
#: any other platform).
OFFLOAD_PLATFORMS = "vLLM's CPU offloading tier runs on CUDA-alike and XPU GPUs only ('CPU Offloading is " \
                    "currently only supported on CUDA-alike and XPU GPUs')"


def kv_transfer_config(spec: EngineSpec) -> dict[str, object]:
    """The engine's ``--kv-transfer-config``: turnkv's connector; on a prefill engine with an offload tier, a
    ``MultiConnector`` of turnkv's connector first and vLLM's ``OffloadingConnector`` second. vLLM lets the
    first child that matches load a request: turnkv's matches only a replayed offer (decode's retained turn,
    everything past prefill's own prefix-cache hit), so every other request falls through to the offload tier's
    prefix lookup; a declined pull (below the threshold, or the cost model's recompute) does too."""
    turnkv_config = turnkv_connector_config(spec)
    if spec.prefill_offload_gib <= 0:
        return turnkv_config
    if spec.role is not Role.PREFILL:
        raise ValueError("prefill_offload_gib is a prefill engine's setting: decode keeps finished turns in turnkv's "
                         "own host tier (host_kv_budget_mib)")
    if spec.on_neuron:
        raise ValueError(f"prefill_offload_gib on Neuron: {OFFLOAD_PLATFORMS}")
    offload = {"kv_connector": OFFLOAD_CONNECTOR, "kv_role": "kv_both",
               "kv_connector_extra_config": {OFFLOAD_BYTES_KEY: int(spec.prefill_offload_gib * 2**30)}}
    return multi_connector(turnkv_config, [offload])


def multi_connector(turnkv_config: dict[str, object], others: list[dict[str, object]]) -> dict[str, object]:
    """A ``MultiConnector`` of turnkv's connector (first) and ``others``; the engine-wide keys (engine id, the load
    failure policy, the KV buffer's device) stay at the top, where vLLM reads them."""
    top = ("engine_id", "kv_load_failure_policy", "kv_buffer_device")
    child = {k: v for k, v in turnkv_config.items() if k not in top}
    if others:  # a sibling that stores computed blocks: turnkv's connector reads no pull inline (connector.inline)
        child["kv_connector_extra_config"] = {**dict(child.get("kv_connector_extra_config") or {}),
                                              wire.OFFLOAD_SIBLING_KEY: True}
    return {"kv_connector": MULTI_CONNECTOR, "kv_role": "kv_both",
            **{k: turnkv_config[k] for k in top if k in turnkv_config},
            "kv_connector_extra_config": {"connectors": [child, *others]}}


def turnkv_connector_config(spec: EngineSpec) -> dict[str, object]:
    """turnkv's own connector's ``--kv-transfer-config`` (alone, or as a ``MultiConnector``'s first child)."""
    connector, module_path = (spec.connector, None) if spec.connector else CONNECTORS[spec.mode]
    refused = neuron.MODE_REFUSALS.get(spec.mode.value) if spec.on_neuron else None
    if refused:
        raise ValueError(f"{spec.mode.value} mode on Neuron: {refused}")
    # Every engine tunable (catalog defaults under the spec's values): vLLM reads the TTL, threshold and lease
    # duration; the connector reads the rest as its start-up values (connector.tunables.start_values). The host
    # tier is decode's alone: a prefill engine never retains, so it allocates no pool.
    values = {**params.defaults(params.Scope.ENGINE), **spec.tunables}
    if spec.role is Role.PREFILL:
        values["host_kv_budget_mib"] = 0
    extra: dict[str, object] = {
        "backends": list(spec.backends),
        "bidirectional_kv_xfer": spec.bidirectional and connector not in _NO_BIDIRECTIONAL,
        **{name: params.get(name).parse(value) for name, value in values.items()},
    }
    config: dict[str, object] = {
        "kv_connector": connector,
        "kv_role": "kv_both",
        "engine_id": spec.engine_id,
        # A failed or expired pull recomputes instead of failing the request.
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }
    if module_path:
        config["kv_connector_module_path"] = module_path
    if spec.on_neuron:
        # vllm-neuron registers device memory with NIXL under the name "cuda" (get_nixl_supported_devices).
        config["kv_buffer_device"] = neuron.KV_BUFFER_DEVICE
    return config


def serve_args(spec: EngineSpec) -> list[str]:
    """``vllm serve`` argv (without the executable)."""
    args = [
        "serve", spec.model,
        "--host", spec.host,
        "--port", str(spec.port),
        "--served-model-name", spec.served_model_name or spec.model,
        "--tensor-parallel-size", str(spec.tensor_parallel_size),
        "--max-model-len", str(spec.max_model_len),
        "--block-size", str(spec.block_size),
        "--dtype", spec.dtype,
        "--kv-transfer-config", json.dumps(kv_transfer_config(spec), separators=(",", ":")),
        "--enable-prefix-caching" if spec.prefix_caching else "--no-enable-prefix-caching",
    ]
    if spec.enforce_eager:
        args.append("--enforce-eager")
    if spec.load_format:
        args += ["--load-format", spec.load_format]
    if spec.allowed_media_domains:
        internal = [d for d in spec.allowed_media_domains if internal_host(d)]
        if internal:
            raise ValueError(f"allowed_media_domains: {internal} name internal addresses; engines must not fetch "
                             "media from inside the network")
        args += ["--allowed-media-domains", *spec.allowed_media_domains]
    return args + spec.settings.args() + neuron_args(spec) + list(spec.extra_args)


#: Flags turnkv sets on a Neuron engine (:func:`neuron_args`), refused in extra_args there.
NEURON_FLAGS = ("--additional-config", "--max-num-batched-tokens")


def neuron_args(spec: EngineSpec) -> list[str]:
    """A Neuron engine's bucket configuration, as the vllm-neuron tutorials run prefix caching: segmented prefill
    (``kv_segment_size_buckets``) of one segment size, the prefill bucket and ``--max-num-batched-tokens`` equal to
    it, one decode batch bucket equal to ``--max-num-seqs``. Prefix caching starts only with segmented prefill, and a
    pulled turn is prior KV that only segmented prefill attends to. Nothing off Neuron."""
    if not spec.on_neuron:
        return []
    given = [a for a in (*spec.extra_args, *spec.settings.extra_args) if a.split("=", 1)[0] in NEURON_FLAGS]
    if given:
        raise ValueError(f"{', '.join(given)} on Neuron: turnkv sets the bucket configuration "
                         f"({', '.join(NEURON_FLAGS)}) from model.max_model_len and model.max_num_seqs; set those")
    seqs = spec.settings.max_num_seqs or neuron.DEFAULT_MAX_NUM_SEQS
    config = neuron.neuron_config(spec.max_model_len, spec.block_size, seqs)
    args = ["--max-num-batched-tokens", str(config["num_batched_tokens_buckets"][-1]),
            "--additional-config", json.dumps({"neuron_config": config}, separators=(",", ":"))]
    if spec.settings.max_num_seqs is None:
        args += ["--max-num-seqs", str(seqs)]
    return args


#: vLLM's switch for following redirects of media URLs (default on).
MEDIA_REDIRECTS = "VLLM_MEDIA_URL_ALLOW_REDIRECTS"

#: prometheus_client's process-wide switch for the ``*_created`` series (read from the environment at import).
PROMETHEUS_DISABLE_CREATED = "PROMETHEUS_DISABLE_CREATED_SERIES"


def neuron_env(spec: EngineSpec) -> dict[str, str]:
    """A Neuron engine's environment beyond the platform plugin (``VLLM_PLUGINS`` filters platform plugins too:
    without vllm-neuron's entry point the Neuron platform never loads), each from the vllm-neuron docs
    (``turnkv.neuron.FACTS``):

    - libfabric off shared memory: engines share a node;
    - the plugin's D->P switch when the engine is bi-directional;
    - prefill skips decode's warmup; decode keeps prefill's graphs, because a READ that fails recomputes the prompt
      there (``kv_load_failure_policy: recompute``): skipping them would compile a prefill graph on the request path;
    - compilation and ready budgets that outlast a first compile, and the compile cache on the root volume.
    """
    env = dict(neuron.SHM_OFF)
    if spec.bidirectional:
        env[neuron.BIDIRECTIONAL_ENV] = "1"
    if spec.role is Role.PREFILL:
        env[neuron.SKIP_WARMUP["prefill"]] = "1"
    env.update(neuron.TIMEOUTS)
    env[neuron.CACHE_ROOT_ENV] = neuron.CACHE_ROOT
    return env


def serve_env(spec: EngineSpec) -> dict[str, str]:
    """Environment the engine needs on top of the host's. ``HF_HUB_OFFLINE`` only when the weights are a local
    directory (synced from S3, or the local stack's model): a Hugging Face id must be downloaded (through NAT)."""
    env = {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": spec.side_channel_host,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(spec.side_channel_port),
        # vLLM loads endpoint plugins (turnkv's lease route) only when allow-listed; the list then
        # applies to general plugins too, so it names both of turnkv's.
        "VLLM_PLUGINS": "turnkv,turnkv-leases",
        # No ``*_created`` series beside every counter and histogram child (vLLM keeps prometheus_client's
        # default; the router turns them off too): prometheus_client reads this once, at import.
        PROMETHEUS_DISABLE_CREATED: "True",
        # A media URL's redirect is never followed: the router checked the URL's host (router.media), not where a
        # redirect would lead (169.254.169.254, a VPC address); vLLM follows them by default.
        MEDIA_REDIRECTS: "0",
        **({wire.OFFER_SECRET_FILE_ENV: spec.offer_secret_file} if spec.offer_secret_file else {}),
    }
    if spec.on_neuron:
        env.update(neuron_env(spec))
        env["VLLM_PLUGINS"] += f",{neuron.PLATFORM_PLUGIN}"
    if spec.model.startswith("/"):
        env["HF_HUB_OFFLINE"] = "1"
    return env
