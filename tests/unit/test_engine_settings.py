"""turnkv.engine_settings: the recorded vLLM names match the installed vLLM (the pinned release), every
allow-listed ``extra_args`` flag exists in its ``vllm serve`` parser and none is one turnkv sets itself, each bad
value is refused naming its fix, and the settings become the flags vLLM needs (a tool-call parser with auto tool
choice). ``turnkv engine run --dry-run`` shows them, the Hugging Face token redacted."""

from __future__ import annotations

import json
import typing

import pytest

from turnkv import engine_run, engine_settings, node_env, versions
from turnkv.engine_args import EngineSpec, Role, serve_args
from turnkv.engine_settings import EngineSettings, SettingError
from turnkv.local.engine_env import installed_version


@pytest.fixture(scope="module")
def vllm_release() -> str:
    found = installed_version("vllm")
    if found.split("+")[0] != versions.VLLM_GPU:
        pytest.skip(f"the names are recorded for vLLM {versions.VLLM_GPU}; this venv has {found or 'none'}")
    return found


def test_the_recorded_names_are_the_installed_vllms(vllm_release):
    from vllm.config.cache import CacheDType
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    assert typing.get_args(CacheDType) == engine_settings.KV_CACHE_DTYPES
    assert set(engine_settings.TOOL_CALL_PARSERS) == set(ToolParserManager.tool_parsers) | set(
        ToolParserManager.lazy_parsers)
    assert set(engine_settings.REASONING_PARSERS) == set(ReasoningParserManager.reasoning_parsers) | set(
        ReasoningParserManager.lazy_parsers)
    assert {"hermes", "qwen3"} <= set(engine_settings.TOOL_CALL_PARSERS) | set(engine_settings.REASONING_PARSERS)


def test_every_flag_turnkv_permits_or_owns_is_a_vllm_serve_flag(vllm_release):
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    flags = {o for action in parser._actions for o in action.option_strings}
    assert set(engine_settings.ALLOWED_EXTRA_FLAGS) - flags == set()
    assert set(engine_settings.OWNED_FLAGS) - flags == set()
    takes_value = {o: action.nargs != 0 for action in parser._actions for o in action.option_strings}
    wrong = {f for f, value in engine_settings.ALLOWED_EXTRA_FLAGS.items() if takes_value[f] != value}
    assert not wrong, f"the allow-list says the wrong thing about taking a value: {wrong}"


def test_the_allow_list_and_turnkvs_own_flags_are_apart_and_serve_args_sets_only_owned_ones():
    assert not set(engine_settings.ALLOWED_EXTRA_FLAGS) & set(engine_settings.OWNED_FLAGS)
    every = EngineSettings(kv_cache_dtype="fp8", tool_call_parser="hermes", reasoning_parser="qwen3",
                           trust_remote_code=True, gpu_memory_utilization=0.5, max_num_seqs=8)
    spec = EngineSpec(role=Role.DECODE, engine_id="d", model="m", port=1, side_channel_port=2, settings=every,
                      enforce_eager=False, load_format="auto", allowed_media_domains=("example.com",))
    emitted = {a for a in serve_args(spec) if a.startswith("--")}
    assert emitted - set(engine_settings.OWNED_FLAGS) == set()


@pytest.mark.parametrize(("check", "value", "fix"), [
    (engine_settings.kv_cache_dtype, "fp9", "use one of auto, float16"),
    (engine_settings.tool_call_parser, "qwen3", "use one of apertus"),
    (engine_settings.reasoning_parser, "hermes", "use one of cohere_command3"),
    (engine_settings.gpu_memory_utilization, 0.0, "(0, 1]"),
    (engine_settings.gpu_memory_utilization, 1.01, "(0, 1]"),
    (engine_settings.max_num_seqs, 0, "use 1 .. 65536"),
    (engine_settings.extra_arg, "--kv-transfer-config={}", "turnkv sets itself (connector.mode"),
    (engine_settings.extra_arg, "--port=9", "drop it from extra_args"),
    (engine_settings.extra_arg, "--max-num-seqs=9", "set model.max_num_seqs instead"),
    (engine_settings.extra_arg, "--enable-sleep-mode", "not a vllm serve flag turnkv permits"),
    (engine_settings.extra_arg, "--seed", "write it as --seed=VALUE"),
    (engine_settings.extra_arg, "--seed=1 2", "write it as --seed=VALUE"),
    (engine_settings.extra_arg, "--enforce-eager=true", "takes no value"),
    (engine_settings.extra_args, ("--seed=1", "--seed=2"), "--seed given more than once"),
])
def test_a_bad_value_is_refused_naming_the_fix(check, value, fix):
    with pytest.raises(SettingError, match=None) as raised:
        check(value)
    assert fix in str(raised.value)


def test_a_tool_call_parser_turns_auto_tool_choice_on_and_unset_settings_write_no_flag():
    assert EngineSettings().args() == []
    assert EngineSettings(tool_call_parser="hermes").args() == ["--enable-auto-tool-choice", "--tool-call-parser",
                                                                 "hermes"]


ENV = {node_env.ROLE: "decode", node_env.ENGINE_ID: "d-1", node_env.MODEL: "Qwen/Qwen3-32B",
       node_env.SIDE_CHANNEL_HOST: "10.0.0.5", node_env.KV_CACHE_DTYPE: "fp8", node_env.TOOL_CALL_PARSER: "hermes",
       node_env.TRUST_REMOTE_CODE: "true", node_env.HF_TOKEN_SECRET: "turnkv/hf-token"}


def test_engine_run_reads_the_token_from_secrets_manager_into_the_engines_environment_only():
    asked = []

    def get_secret(secret, region):
        asked.append((secret, region))
        return json.dumps({"HF_TOKEN": "hf_abc"}) + "\n"

    node = node_env.render(node_env.NodeEnv("prod", "us-east-2").variables())
    argv, env, notes = engine_run.prepare(ENV, read_text=lambda p: node if p == node_env.NODE_ENV_FILE else None,
                                          run=lambda cmd: 0, get_secret=get_secret)
    assert asked == [("turnkv/hf-token", "us-east-2")] and env["HF_TOKEN"] == "hf_abc"
    assert "hf_abc" not in " ".join(argv + notes)
    _, dry, _ = engine_run.prepare(ENV, read_text=lambda p: None, run=lambda cmd: 0, sync=False,
                                   get_secret=lambda *a: pytest.fail("a dry run reads no secret"))
    assert dry["HF_TOKEN"] == engine_run.REDACTED
    with pytest.raises(engine_run.EngineEnvError, match="JSON secret must hold an HF_TOKEN key"):
        engine_run.prepare(ENV, read_text=lambda p: None, run=lambda cmd: 0, get_secret=lambda *a: '{"x": 1}')


def test_engine_env_refuses_bad_settings_naming_each():
    bad = {**ENV, node_env.KV_CACHE_DTYPE: "fp9", node_env.TRUST_REMOTE_CODE: "yes",
           node_env.EXTRA_ARGS: "--seed=1,--block-size=64", node_env.MAX_NUM_SEQS: "many"}
    with pytest.raises(node_env.NodeEnvError) as raised:
        node_env.EngineEnv.from_variables(bad)
    text = str(raised.value)
    for name in (node_env.KV_CACHE_DTYPE, node_env.TRUST_REMOTE_CODE, node_env.EXTRA_ARGS, node_env.MAX_NUM_SEQS):
        assert name in text


def test_the_local_stack_starts_both_engines_with_a_deploy_configs_settings(tmp_path):
    """`turnkv local up --model-config FILE` (turnkv.local.settings): the config's model section, flags on top,
    into both engines' argv from the stack's own plan; a bad config or flag is refused naming the fix."""
    import yaml

    from tests.infra import configs
    from turnkv.local import stack
    from turnkv.local.settings import engine_settings_for

    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(configs.variant(configs.GPU, **{"model.trust_remote_code": True})))
    settings = engine_settings_for(path, max_num_seqs=8, reasoning_parser=None)
    assert settings == EngineSettings(kv_cache_dtype="fp8", tool_call_parser="hermes", reasoning_parser="qwen3",
                                      trust_remote_code=True, max_num_seqs=8,
                                      extra_args=("--max-num-batched-tokens=8192",))
    config = stack.StackConfig(state_dir=tmp_path, engine_settings=settings)
    for proc in (p for p in stack.plan(config) if p.kind != "router"):
        tail = proc.argv[proc.argv.index("--enforce-eager") + 1:]
        assert tail[:5] == ["--kv-cache-dtype", "fp8", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
        assert "--trust-remote-code" in tail and tail[-3:] == ["--max-num-seqs", "8", "--max-num-batched-tokens=8192"]
    with pytest.raises(SettingError, match="not a tool-call parser"):
        engine_settings_for(path, tool_call_parser="qwen3")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(configs.variant(configs.GPU, **{"model.kv_cache_dtype": "fp9"})))
    with pytest.raises(SettingError, match=r"bad.yaml: model.kv_cache_dtype: 'fp9' is not a KV cache dtype"):
        engine_settings_for(bad)


def test_turnkv_local_up_refuses_a_bad_setting_before_starting_anything(tmp_path):
    from typer.testing import CliRunner

    from turnkv.cli import app

    for args, fix in ((["--tool-call-parser", "qwen3"], "not a tool-call parser"),
                      (["--engine-arg=--port=1"], "--port is one turnkv sets itself"),
                      (["--model-config", str(tmp_path / "none.yaml")], "does not exist")):
        done = CliRunner().invoke(app, ["local", "up", "--state-dir", str(tmp_path / "state"), *args],
                                  env={"COLUMNS": "1000"})
        assert done.exit_code == 2 and fix in done.output, done.output
    assert not (tmp_path / "state").exists()
