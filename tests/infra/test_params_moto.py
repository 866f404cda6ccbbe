"""The synthesized params template deployed with CloudFormation into moto (server mode, HTTP on 127.0.0.1),
then read and changed with `turnkv params`: the stack and the CLI agree on paths, defaults and patterns."""

from __future__ import annotations

import json

import boto3
import pytest
from typer.testing import CliRunner

from infra.stacks.params import deployment_defaults
from turnkv import params
from turnkv.cli import app

pytestmark = pytest.mark.infra
REGION = "us-east-2"


@pytest.fixture(scope="module")
def moto_env(moto_url):
    return moto_url


def test_params_stack_deploys_and_the_cli_reads_it(gpu, moto_env, monkeypatch):
    for key, value in {"AWS_ENDPOINT_URL": moto_env, "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": REGION}.items():
        monkeypatch.setenv(key, value)
    ssm = boto3.client("ssm", region_name=REGION, endpoint_url=moto_env)
    ssm.put_parameter(Name="/cdk-bootstrap/hnb659fds/version", Value="30", Type="String")
    cfn = boto3.client("cloudformation", region_name=REGION, endpoint_url=moto_env)
    name = next(s for s in gpu.templates if s.endswith("-params"))
    template = json.loads(json.dumps(gpu.templates[name]))
    for resource in template["Resources"].values():
        # moto 5.2.5 expects a list for AWS::SSM::Parameter Tags; CloudFormation (and CDK) use a map
        resource.get("Properties", {}).pop("Tags", None)
    cfn.create_stack(StackName=name, TemplateBody=json.dumps(template))
    status = cfn.describe_stacks(StackName=name)["Stacks"][0]["StackStatus"]
    assert status == "CREATE_COMPLETE"

    pages = ssm.get_paginator("get_parameters_by_path").paginate(Path="/turnkv/gpu", Recursive=True)
    stored = {p["Name"]: p["Value"] for page in pages for p in page["Parameters"]}
    sized = deployment_defaults(gpu.app.config)  # the catalog's, the host tier sized from the decode nodes
    assert stored == {t.ssm_path("gpu"): str(sized[t.name]) for t in params.CATALOG}

    listed = CliRunner().invoke(app, ["params", "list", "--deployment", "gpu", "--json"])
    assert listed.exit_code == 0, listed.output
    table = json.loads(listed.output)
    assert all(row["stored"] == str(sized[name]) and row["error"] is None for name, row in table.items())

    ok = CliRunner().invoke(app, ["params", "set", "decoder_kv_blocks_ttl", "600", "--deployment", "gpu",
                                  "--who", "ci"])
    assert ok.exit_code == 0, ok.output
    assert ssm.get_parameter(Name="/turnkv/gpu/engine/decoder_kv_blocks_ttl")["Parameter"]["Value"] == "600"
    # docs/parameters.md: the engines' TTL alone lowers conversation_ttl to fit (400 - expiry_margin 10)
    fitted = CliRunner().invoke(app, ["params", "set", "decoder_kv_blocks_ttl=400", "-d", "gpu", "--who", "ci"])
    assert fitted.exit_code == 0, fitted.output
    assert ssm.get_parameter(Name="/turnkv/gpu/engine/decoder_kv_blocks_ttl")["Parameter"]["Value"] == "400"
    assert ssm.get_parameter(Name="/turnkv/gpu/router/conversation_ttl")["Parameter"]["Value"] == "390"
    assert "conversation_ttl lowered to fit" in fitted.output
    # raising it leaves the router's TTL alone; a router TTL that does not fit is still refused
    CliRunner().invoke(app, ["params", "set", "decoder_kv_blocks_ttl=900", "-d", "gpu", "--who", "ci"])
    assert ssm.get_parameter(Name="/turnkv/gpu/router/conversation_ttl")["Parameter"]["Value"] == "390"
    refused = CliRunner().invoke(app, ["params", "set", "conversation_ttl", "950", "--deployment", "gpu"])
    assert refused.exit_code == 2 and "conversation_ttl" in refused.output
