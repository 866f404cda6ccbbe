"""`turnkv config validate` and deploy/example.yaml: every problem in one pass, without a synth, no traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from infra.config import check, validate_file
from tests.infra import configs
from turnkv.cli import app

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "example.yaml"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "deploy-aws.md"


def _validate(path: Path):
    return CliRunner().invoke(app, ["config", "validate", str(path)])


def test_the_example_is_valid_once_its_placeholders_are_replaced_and_the_docs_deploy_it(tmp_path):
    """As shipped, the example's "yours" values (an acme bucket, the cr-0123456789abcdef0 reservation) are refused:
    a deploy with them fails after the 1-2 h bake. With real-looking values in their place it is valid."""
    config, problems = validate_file(EXAMPLE)
    assert config is None and sorted(f for f, _ in problems) == [
        "model.s3_uri", "pools[0].capacity_reservation_id", "pools[1].capacity_reservation_id"], problems
    done = _validate(EXAMPLE)
    assert done.exit_code == 2 and "placeholder" in done.output
    text = EXAMPLE.read_text().replace("s3://acme-llm-weights/", "s3://weights-1234/").replace(
        "cr-0123456789abcdef0", "cr-0a1b2c3d4e5f60718")
    (tmp_path / "mine.yaml").write_text(text)
    config, problems = validate_file(tmp_path / "mine.yaml")
    assert problems == [] and config is not None
    done = _validate(tmp_path / "mine.yaml")
    assert done.exit_code == 0 and "valid" in done.output
    docs = DOCS.read_text()
    assert "npx cdk deploy --all -c turnkv:config=deploy/example.yaml" in docs
    assert "turnkv config validate deploy/example.yaml" in docs


def test_field_and_cross_field_problems_come_in_one_pass(tmp_path):
    raw = configs.variant(configs.GPU, name="Prod_1", **{
        "pools.0.instance_type": "p4d.24xlarge",  # per field
        "router.max_replicas": 1,                 # cross field: below replicas (2)
        "model.s3_uri": None,                     # cross field: no NAT and no weights in S3
        "router.allowed_cidrs": [],               # cross field: a public router needs its client CIDRs
    })
    _, problems = check(raw)
    fields = [f for f, _ in problems]
    assert {"name", "pools[0].instance_type", "router.max_replicas", "model.s3_uri",
            "router.allowed_cidrs"} <= set(fields), problems
    # the bad pool is not reported again as a cross-field problem (no spurious "no prefill pool")
    assert "pools" not in fields
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    done = _validate(path)
    assert done.exit_code == 2
    lines = [ln for ln in done.output.splitlines() if ": " in ln and not ln.startswith(str(path))]
    assert all(";" in ln for ln in lines), lines  # field: what is wrong; how to fix it


@pytest.mark.parametrize(("name", "text", "where"), [
    ("unclosed.yaml", "name: prod\npools: [\n  {role: prefill\n", "malformed YAML at line"),
    ("tabs.yaml", "name: prod\nmodel:\n\tid: x\n", "malformed YAML at line 3"),
    ("trailing.json", '{"name": "prod",}', "malformed JSON at line 1"),
    ("list.yaml", "- name: prod\n", "must hold a mapping"),
])
def test_malformed_files_are_one_problem_not_a_traceback(tmp_path, name, text, where):
    path = tmp_path / name
    path.write_text(text)
    done = _validate(path)
    assert done.exit_code == 2 and (done.exception is None or isinstance(done.exception, SystemExit))
    assert where in done.output and "Traceback" not in done.output


def test_a_missing_file_says_so(tmp_path):
    done = _validate(tmp_path / "nope.yaml")
    assert done.exit_code == 2 and "does not exist" in done.output


def test_the_image_build_settings_are_checked_together():
    _, problems = check(configs.variant(configs.GPU, image={"build_subnet_id": "subnet-0123456789abcdef0",
                                                            "build_instance_types": ["g6.2xlarge", "bogus"]}))
    fields = dict(problems)
    assert "image.build_security_group_id" in fields and "image.build_instance_types[1]" in fields


def test_json_configs_validate_too(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(configs.GPU))
    assert _validate(path).exit_code == 0


def test_a_bad_value_in_a_pool_does_not_hide_a_missing_role():
    """pools[0].count is reported and its default stands in; the cross-field rule still sees no prefill pool."""
    raw = configs.variant(configs.GPU, pools=[{"role": "decode", "instance_type": "p5en.48xlarge", "count": 80}])
    fields = dict(check(raw)[1])
    assert "1 .. 64" in fields["pools[0].count"] and "no prefill pool" in fields["pools"]


def test_engine_settings_are_checked_and_what_a_node_runs_is_shown(tmp_path):
    """fp8 KV, a tool-call parser and remote code validate; `turnkv config engine-env` prints the pool's engine.env
    and `turnkv engine run --dry-run` the argv it execs from it (the token's secret named, the token redacted).
    Bad values exit 2, each naming its fix."""
    raw = configs.variant(configs.GPU, **{"model.kv_cache_dtype": "fp8", "model.tool_call_parser": "hermes",
                                          "model.trust_remote_code": True, "model.hf_token_secret": "turnkv/hf"})
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(raw))
    assert _validate(good).exit_code == 0
    shown = CliRunner().invoke(app, ["config", "engine-env", str(good), "--pool", "decode"])
    assert shown.exit_code == 0, shown.output
    env = tmp_path / "engine.env"
    env.write_text(shown.stdout + "TURNKV_ENGINE_ID=gpu-decode-i-1\nTURNKV_SIDE_CHANNEL_HOST=10.40.1.2\n")
    run = CliRunner().invoke(app, ["engine", "run", "--env-file", str(env), "--dry-run"])
    assert run.exit_code == 0, run.output
    out = json.loads(run.stdout)
    flags = out["argv"][out["argv"].index("--enable-prefix-caching") + 1:]
    assert flags[:7] == ["--kv-cache-dtype", "fp8", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                         "--reasoning-parser", "qwen3"] and "--trust-remote-code" in flags
    assert out["env"]["HF_TOKEN"] == "<redacted>"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(configs.variant(raw, **{
        "model.kv_cache_dtype": "fp16", "model.tool_call_parser": "qwen3", "model.gpu_memory_utilization": 0,
        "model.extra_args": ["--kv-transfer-config={}"]})))
    done = _validate(bad)
    assert done.exit_code == 2
    lines = done.output.replace("\n", " ")
    for fix in ("model.kv_cache_dtype: 'fp16' is not a KV cache dtype vLLM accepts (--kv-cache-dtype); use one of",
                "model.tool_call_parser: 'qwen3' is not a tool-call parser", "model.gpu_memory_utilization: 0",
                "model.extra_args[0]: --kv-transfer-config is one turnkv sets itself"):
        assert fix in lines
    assert CliRunner().invoke(app, ["config", "engine-env", str(bad)]).exit_code == 2
