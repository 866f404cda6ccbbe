"""The model's engine settings a deployment may set on `vllm serve`, and the values the pinned vLLM accepts.

The deploy config's ``model`` section (``infra.config.ModelConfig``), a node's engine.env (``turnkv.node_env``),
``turnkv engine run`` and ``turnkv local up`` all carry one :class:`EngineSettings`; :meth:`EngineSettings.args`
turns it into ``vllm serve`` flags (``turnkv.engine_args.serve_args`` appends them). Every check lives here once:
the config reports its problems, the engine.env reader refuses them, and both name the fix.

The accepted names are recorded for vLLM ``versions.VLLM_GPU`` (the GPU image's wheel; the CPU build of the
same release has the same Python): ``tests/unit/test_engine_settings.py`` reads them back from the installed
vLLM (``vllm/config/cache.py`` ``CacheDType``, ``ToolParserManager``, ``ReasoningParserManager`` and the
``vllm serve`` argument parser), so a pin that moves fails there, not on a node. Pure: no vLLM import.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

#: vLLM 0.32 ``CacheDType`` (``--kv-cache-dtype``).
KV_CACHE_DTYPES: tuple[str, ...] = (
    "auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla", "nvfp4_ds_mla",
    "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc", "ultraquant_4bit",
    "int4_per_token_head", "int8_per_token_head", "fp8_per_token_head", "nvfp4", "nvfp4_4over6")
#: vLLM 0.32 ``ToolParserManager`` names (``--tool-call-parser``). Qwen3 (and QwQ, Qwen2.5) emit Hermes-style
#: ``<tool_call>`` JSON: ``hermes`` (vLLM's tool-calling docs; ``qwen3_json`` is an alias of it in 0.32).
TOOL_CALL_PARSERS: tuple[str, ...] = (
    "apertus", "cohere_command3", "cohere_command4", "deepseek_v3", "deepseek_v31", "deepseek_v32", "deepseek_v4",
    "deepseek_v41", "dots", "ernie45", "functiongemma", "gemma4", "gigachat3", "glm45", "glm47", "granite",
    "granite-20b-fc", "granite4", "hermes", "hf", "hunyuan_a13b", "hy_v3", "hy_v4", "inkling", "internlm", "jamba",
    "k2_horizon", "kimi_k2", "kimi_k3", "lfm2", "ling3", "llama3_json", "llama4_json", "llama4_pythonic", "longcat",
    "mimo", "minicpm5", "minimax_m2", "minimax_m3", "mistral", "muse_glimmer", "olmo3", "openai", "phi4_mini_json",
    "plamo3", "poolside_v1", "pythonic", "qwen3_coder", "qwen3_json", "qwen3_xml", "seed_oss", "step3", "step3p5",
    "xlam")
#: vLLM 0.32 ``ReasoningParserManager`` names (``--reasoning-parser``); Qwen3's is ``qwen3``.
REASONING_PARSERS: tuple[str, ...] = (
    "cohere_command3", "cohere_command4", "deepseek_r1", "deepseek_v3", "deepseek_v4", "deepseek_v41", "ernie45",
    "gemma4", "glm45", "glm47", "granite", "granite_thinking_parser", "hf", "holo2", "hunyuan_a13b", "hy_v3",
    "hy_v4", "inkling", "k2_horizon", "kimi_k2", "kimi_k3", "ling3", "mimo", "minicpmv", "minimax_m2",
    "minimax_m2_append_think", "minimax_m3", "mistral", "muse_glimmer", "nemotron_v3", "olmo3", "openai_gptoss",
    "plamo3", "poolside_v1", "qwen3", "seed_oss", "step3", "step3p5")

#: ``vllm serve`` flags a deployment may add through ``model.extra_args``: flag -> True when it takes a value.
#: Each changes how one engine serves, never how engines find, address or trust each other. The one allow-list:
#: anything not here is refused (a test checks each exists in the pinned vLLM's parser).
ALLOWED_EXTRA_FLAGS: dict[str, bool] = {
    "--max-num-batched-tokens": True, "--enable-chunked-prefill": False, "--no-enable-chunked-prefill": False,
    "--long-prefill-token-threshold": True, "--async-scheduling": False, "--no-async-scheduling": False,
    "--scheduling-policy": True, "--seed": True, "--quantization": True, "--revision": True,
    "--tokenizer-revision": True, "--code-revision": True, "--tokenizer": True, "--tokenizer-mode": True,
    "--generation-config": True, "--chat-template": True, "--chat-template-content-format": True,
    "--max-logprobs": True, "--enable-prompt-tokens-details": False, "--enable-expert-parallel": False,
    "--enable-eplb": False, "--disable-custom-all-reduce": False, "--disable-cascade-attn": False,
    "--max-cudagraph-capture-size": True, "--mm-processor-cache-gb": True, "--language-model-only": False,
    "--enforce-eager": False, "--attention-backend": True, "--enable-log-requests": False,
}
#: Flags turnkv sets itself, and where their value comes from: refused in ``extra_args`` with that pointer.
OWNED_FLAGS: dict[str, str] = {
    "--host": "all interfaces on a node", "--port": "the node's engine slot, turnkv.node_env.engine_slots",
    "--served-model-name": "model.served_model_name", "--tensor-parallel-size": "model.tensor_parallel_size",
    "--max-model-len": "model.max_model_len", "--block-size": "the connector's KV block size, 128",
    "--dtype": "auto: the weights' own dtype",
    "--kv-transfer-config": "connector.mode, connector.bidirectional and the engine tunables",
    "--enable-prefix-caching": "decode keeps turns by prefix caching",
    "--no-enable-prefix-caching": "decode keeps turns by prefix caching",
    "--load-format": "the weights as synced", "--allowed-media-domains": "the router's media rules",
    "--kv-cache-dtype": "model.kv_cache_dtype", "--tool-call-parser": "model.tool_call_parser",
    "--enable-auto-tool-choice": "model.tool_call_parser",
    "--reasoning-parser": "model.reasoning_parser", "--trust-remote-code": "model.trust_remote_code",
    "--gpu-memory-utilization": "model.gpu_memory_utilization", "--max-num-seqs": "model.max_num_seqs",
    "--hf-token": "model.hf_token_secret",
    "--pipeline-parallel-size": "tensor parallelism only, model.tensor_parallel_size",
    "--data-parallel-size": "one engine per slot, pools[].engines_per_node",
    "--kv-events-config": "the connector", "--disable-log-stats": "the router and the alarms read engine metrics",
}
#: A value in extra_args: what an env file carries unquoted, without the list separator.
_VALUE = re.compile(r"^[A-Za-z0-9_.:/@+-]+$")
#: engine.env carries the list comma-separated.
EXTRA_ARGS_SEPARATOR = ","


class SettingError(ValueError):
    """A setting vLLM would refuse, or that turnkv owns; the message names the fix."""


def _one_of(value: str, allowed: Iterable[str], what: str, flag: str) -> str:
    allowed = tuple(allowed)
    if value not in allowed:
        raise SettingError(f"{value!r} is not {what} vLLM accepts ({flag}); use one of {', '.join(allowed)}")
    return value


def kv_cache_dtype(value: str) -> str:
    return _one_of(value, KV_CACHE_DTYPES, "a KV cache dtype", "--kv-cache-dtype")


def tool_call_parser(value: str) -> str:
    return _one_of(value, TOOL_CALL_PARSERS, "a tool-call parser", "--tool-call-parser")


def reasoning_parser(value: str) -> str:
    return _one_of(value, REASONING_PARSERS, "a reasoning parser", "--reasoning-parser")


def gpu_memory_utilization(value: float) -> float:
    if not 0 < value <= 1:
        raise SettingError(f"{value} is not a fraction of GPU memory; use a value in (0, 1], e.g. 0.9")
    return float(value)


MAX_NUM_SEQS = (1, 65536)
#: vLLM's ``max_num_seqs`` for ``vllm serve`` when none is set (``EngineArgs``' usage-context defaults): GPUs of 70 GiB
#: or more but A100 (H100, H200: the target's p5en), other GPUs, and CPU per tensor-parallel rank.
VLLM_MAX_NUM_SEQS_LARGE_GPU = 1024
VLLM_MAX_NUM_SEQS_GPU = 256
VLLM_MAX_NUM_SEQS_CPU_PER_RANK = 128


def max_num_seqs(value: int) -> int:
    low, high = MAX_NUM_SEQS
    if not low <= value <= high:
        raise SettingError(f"{value} is out of range; use {low} .. {high} sequences per engine step")
    return value


def extra_arg(item: str) -> str:
    """One ``extra_args`` entry: ``--flag`` or ``--flag=value``, the flag on the allow-list."""
    flag, sep, value = item.partition("=")
    if flag in OWNED_FLAGS:
        source = OWNED_FLAGS[flag]
        fix = f"set {source} instead" if source.startswith(("model.", "pools[")) else "drop it from extra_args"
        raise SettingError(f"{flag} is one turnkv sets itself ({source}); {fix}")
    if flag not in ALLOWED_EXTRA_FLAGS:
        raise SettingError(f"{item!r} is not a vllm serve flag turnkv permits in extra_args; use one of "
                           f"{', '.join(ALLOWED_EXTRA_FLAGS)} (as --flag or --flag=value)")
    if ALLOWED_EXTRA_FLAGS[flag] and not (sep and _VALUE.match(value)):
        raise SettingError(f"{item!r}: {flag} takes a value; write it as {flag}=VALUE (letters, digits and _.:/@+-)")
    if not ALLOWED_EXTRA_FLAGS[flag] and sep:
        raise SettingError(f"{item!r}: {flag} takes no value; write {flag} alone")
    return item


def extra_args(items: Iterable[str]) -> tuple[str, ...]:
    items = tuple(extra_arg(i) for i in items)
    flags = [i.partition("=")[0] for i in items]
    if dup := sorted({f for f in flags if flags.count(f) > 1}):
        raise SettingError(f"{', '.join(dup)} given more than once; keep one")
    return items


@dataclass(frozen=True)
class EngineSettings:
    """What the deploy config's ``model`` section sets on each engine beyond turnkv's own flags. Unset fields keep
    vLLM's defaults (no flag is written)."""

    kv_cache_dtype: str = "auto"
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    trust_remote_code: bool = False
    gpu_memory_utilization: float | None = None
    max_num_seqs: int | None = None
    extra_args: tuple[str, ...] = ()

    def check(self) -> EngineSettings:
        """Raise SettingError on the first bad value (the config reports each field on its own)."""
        kv_cache_dtype(self.kv_cache_dtype)
        if self.tool_call_parser is not None:
            tool_call_parser(self.tool_call_parser)
        if self.reasoning_parser is not None:
            reasoning_parser(self.reasoning_parser)
        if self.gpu_memory_utilization is not None:
            gpu_memory_utilization(self.gpu_memory_utilization)
        if self.max_num_seqs is not None:
            max_num_seqs(self.max_num_seqs)
        extra_args(self.extra_args)
        return self

    def args(self) -> list[str]:
        """The ``vllm serve`` flags. A tool-call parser turns on auto tool choice: without
        ``--enable-auto-tool-choice`` vLLM answers ``tool_choice: auto`` with 400."""
        out: list[str] = []
        if self.kv_cache_dtype != "auto":
            out += ["--kv-cache-dtype", self.kv_cache_dtype]
        if self.tool_call_parser:
            out += ["--enable-auto-tool-choice", "--tool-call-parser", self.tool_call_parser]
        if self.reasoning_parser:
            out += ["--reasoning-parser", self.reasoning_parser]
        if self.trust_remote_code:
            out.append("--trust-remote-code")
        if self.gpu_memory_utilization is not None:
            out += ["--gpu-memory-utilization", f"{self.gpu_memory_utilization:g}"]
        if self.max_num_seqs is not None:
            out += ["--max-num-seqs", str(self.max_num_seqs)]
        return out + list(self.extra_args)
