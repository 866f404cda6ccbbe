"""A deploy config's engine settings on real vLLM CPU engines: fp8 KV cache, a tool-call parser (auto tool choice on)
and remote code, taken from the config's ``model`` section by the path `turnkv local up --model-config` takes
(``turnkv.local.settings``), as a node's `turnkv engine run` does. Through the router, the unmodified openai SDK
sends ``tools`` with a named ``tool_choice`` (vLLM forces the call with structured outputs, so even the tiny model
returns real ``tool_calls``) and with ``tool_choice: auto`` (200, not the 400 an engine without a parser gives);
the follow-up turn carrying the ``role: tool`` result pulls what decode held (prefill's ``external_kv_transfer``
counter) and answers as with reuse off.

The parser is ``pythonic``, not the Qwen3 example's ``hermes``: under vLLM 0.32's strict tool calling
(``VLLM_ENFORCE_STRICT_TOOL_CALLING``, on by default) hermes forces a named call with a structural tag that spells
``<tool_call>{"name": "look", "arguments": ...`` (vllm/tool_parsers/structural_tag_registry.py), which the tiny
model's word-level vocabulary cannot write; pythonic's forced call is the arguments' JSON schema alone. Hermes and
the rest of the example's settings reach the argv in the unit and infra tests. The tiny model has no ``<think>``
tokens either, so no reasoning parser here. Its own stack (ports 18030/18130/18230, side channels from 15700): the
package's engines run other settings. ``--trust-request-chat-template`` is the suites' own flag (a template that
renders the calls, as Qwen3's does).

vLLM's CPU build runs an fp8 KV cache only on a CPU with AVX-512 or AMX. On one without (CI's runners vary), the
stack refuses the config's fp8 before it starts a process, with the fix (checked here), and the suite runs the
same settings with ``--kv-cache-dtype auto``, the override that fix names.

Decode also starts with a host tier the machine cannot back (``host_kv_budget_mib`` 4,000,000, ~3.8 TiB; issue #51
item 3: the cap was 75% of MemTotal and the OOM killer ended decode): it grants what the host's room allows
(``connector.host_pool_plan.host_room``), says SHRUNK in its log and the granted bytes on /metrics, and serves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from openai import OpenAI

from tests.e2e.client import OFF, OUTCOME, REUSED, chat, engine_stack, metric, pulled_tokens, words
from tests.infra import configs
from turnkv.local import engine_env
from turnkv.local.settings import engine_settings_for
from turnkv.local.stack import StackConfig, StackError, Supervisor

pytestmark = pytest.mark.engines

ROOT = Path(__file__).resolve().parents[2]
STATE_DIR = ROOT / ".turnkv" / "e2e-settings"
#: The infra suite's Qwen3 deployment with fp8 KV, a tool-call parser and remote code (no reasoning parser).
DEPLOY = configs.variant(configs.GPU, **{"model.kv_cache_dtype": "fp8", "model.tool_call_parser": "pythonic",
                                         "model.trust_remote_code": True, "model.reasoning_parser": None,
                                         "model.extra_args": None})
# Renders an assistant's calls as their arguments' JSON (the tokens decode generated under the forced choice).
TOOL_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') }}"
    "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}{{ c['function']['arguments'] | tojson }}{% endfor %}"
    "{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
#: The KV cache dtype the engines run here: the config's fp8 where this CPU runs it, else the named fix's auto.
FP8_HERE = not engine_env.fp8_kv_refusal("fp8", engine_env.cpu_flags())
KV_DTYPE = "fp8" if FP8_HERE else "auto"
#: A host tier no machine here backs (params' bound is 4 TiB).
BUDGET = 4_000_000
TOOLS = [{"type": "function", "function": {"name": "look", "description": "look around",
                                           "parameters": {"type": "object", "properties": {},
                                                          "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def settings_stack():
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    path = STATE_DIR / "deploy.yaml"
    path.write_text(yaml.safe_dump(DEPLOY))
    settings = engine_settings_for(path)
    assert settings.args() == ["--kv-cache-dtype", "fp8", "--enable-auto-tool-choice", "--tool-call-parser",
                               "pythonic", "--trust-remote-code"]
    config = stack_config(settings)
    if not FP8_HERE:
        with pytest.raises(StackError, match=r"needs a CPU with AVX-512 or AMX.*--kv-cache-dtype auto"):
            Supervisor(STATE_DIR).up(config)
        assert not Supervisor(STATE_DIR).running()
        config = stack_config(engine_settings_for(path, kv_cache_dtype="auto"))
    with engine_stack(config) as running:
        yield running


def stack_config(settings) -> StackConfig:
    return StackConfig(state_dir=STATE_DIR, router_port=18030, prefill_port=18130, decode_port=18230,
                       side_channel_base=15700, kv_cache_gib=1, prefill_prefix_caching=False,
                       tunables={"decoder_kv_blocks_ttl": 60, "conversation_ttl": 45, "host_kv_budget_mib": BUDGET},
                       engine_settings=settings,
                       engine_extra_args=("--trust-request-chat-template",))


def test_engines_run_the_configs_settings(settings_stack):
    for engine in ("prefill-0", "decode-0"):
        log = (STATE_DIR / "logs" / f"{engine}.log").read_text()
        assert f"kv_cache_dtype={KV_DTYPE}," in log and "'tool_call_parser': 'pythonic'" in log, engine
        assert "'enable_auto_tool_choice': True" in log and "'trust_remote_code': True" in log, engine


def test_named_and_auto_tool_choice_then_the_tool_result_turn_reuses_decodes_kv(settings_stack):
    stack = settings_stack
    client = OpenAI(base_url=stack["router"] + "/v1", api_key="none", max_retries=0, timeout=120)
    model_dir = stack["model_dir"]
    common = {"model": "tiny", "temperature": 0, "max_tokens": 16, "tools": TOOLS,
              "extra_body": {"chat_template": TOOL_TEMPLATE}}
    messages = [{"role": "user", "content": words(model_dir, 700, 910)}]

    named = client.chat.completions.with_raw_response.create(
        messages=messages, tool_choice={"type": "function", "function": {"name": "look"}}, **common)
    assert named.status_code == 200
    assistant = named.parse().choices[0].message
    (call,) = assistant.tool_calls
    assert call.function.name == "look" and json.loads(call.function.arguments) == {}

    auto = client.chat.completions.with_raw_response.create(messages=messages, tool_choice="auto", **common)
    assert auto.status_code == 200  # an engine without --enable-auto-tool-choice answers 400
    choice = auto.parse().choices[0]
    print(f"auto: finish={choice.finish_reason} calls={len(choice.message.tool_calls or [])} "
          f"content={choice.message.content!r:.60}")

    history = [*messages, assistant.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": words(model_dir, 30, 911)}]

    def follow_up(headers):
        raw = client.chat.completions.with_raw_response.create(messages=history, tool_choice="auto",
                                                               extra_headers=headers, **common)
        message = raw.parse().choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        return (message.content, calls), raw.headers

    before = pulled_tokens(stack)
    answer, headers = follow_up(None)
    moved = pulled_tokens(stack) - before
    print(f"tool-result turn: {headers[OUTCOME]} reused={headers[REUSED]} pulled={moved:.0f}")  # the figures (-s)
    assert headers[OUTCOME] == "hit", headers[OUTCOME]
    assert int(headers[REUSED]) == moved > 600
    off, _ = follow_up(OFF)
    assert answer == off


def test_a_host_tier_the_machine_cannot_back_is_shrunk_loudly_and_decode_serves(settings_stack):
    decode = settings_stack["decode-0"]
    # decode reports its pool with its first step's output
    served = chat(settings_stack["router"], [{"role": "user", "content": words(settings_stack["model_dir"], 200, 912)}])
    assert served.status == 200
    granted = metric(decode, "vllm:turnkv_host_tier_granted_bytes")
    configured = metric(decode, "vllm:turnkv_host_tier_configured_bytes")
    log = (STATE_DIR / "logs" / "decode-0.log").read_text()
    line = [ln for ln in log.splitlines() if "turnkv: host tier: rank 0" in ln][-1]  # this start's (logs append)
    print(f"granted {granted / 2**30:.2f} GiB of {configured / 2**30:.0f} GiB: {line[line.index('rank 0'):]}")
    assert configured == BUDGET * 2**20 and 0 < granted < 20 * 2**30  # this machine: 24 GiB
    assert "(host-available)" in line and "SHRUNK" in line
