"""The synthesized params template deployed with CloudFormation into moto (server mode, HTTP on 127.0.0.1),
then read and changed with `turnkv params`: the stack and the CLI agree on paths, defaults and patterns."""

from __future__ import annotations

import importlib.util
import json

import boto3
import pytest
from typer.testing import CliRunner

from infra.lambdas import KEEP_TUNABLES
from infra.stacks.params import deployment_defaults
from turnkv import params
from turnkv.cli import app

pytestmark = pytest.mark.infra
REGION = "us-east-2"


@pytest.fixture(scope="module")
def moto_env(moto_url):
    return moto_url


def _keeper():
    spec = importlib.util.spec_from_file_location("keep_tunables_under_test", KEEP_TUNABLES)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def as_deployed(template: dict, ssm) -> dict:
    """The params template as CloudFormation runs it: the ``Tunables`` custom resource answered by its own handler
    (infra/lambdas/keep_tunables.py) against the live parameters, its attributes put where the parameters read
    them; the function, its role and log group left out (moto would run the Lambda in Docker)."""
    template = json.loads(json.dumps(template))
    resources = template["Resources"]
    (keeper,) = [lid for lid, r in resources.items() if r["Type"] == "AWS::CloudFormation::CustomResource"]
    event = {"RequestType": "Update", "ResourceProperties": resources[keeper]["Properties"], "ResponseURL": "-",
             "StackId": "s", "RequestId": "r", "LogicalResourceId": keeper}
    answer = _keeper().handler(event, None, ssm=ssm, respond=lambda url, body: None)
    assert answer["Status"] == "SUCCESS", answer
    for lid, resource in list(resources.items()):
        if resource["Type"] == "AWS::SSM::Parameter":
            props = resource["Properties"]
            props["Value"] = answer["Data"][props["Value"]["Fn::GetAtt"][1]]
            # moto 5.2.5 expects a list for AWS::SSM::Parameter Tags; CloudFormation (and CDK) use a map
            props.pop("Tags", None)
        else:
            del resources[lid]
    return template


def test_params_stack_deploys_and_the_cli_reads_it(gpu, moto_env, monkeypatch):
    for key, value in {"AWS_ENDPOINT_URL": moto_env, "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": REGION}.items():
        monkeypatch.setenv(key, value)
    ssm = boto3.client("ssm", region_name=REGION, endpoint_url=moto_env)
    ssm.put_parameter(Name="/cdk-bootstrap/hnb659fds/version", Value="30", Type="String")
    cfn = boto3.client("cloudformation", region_name=REGION, endpoint_url=moto_env)
    name = next(s for s in gpu.templates if s.endswith("-params"))
    cfn.create_stack(StackName=name, TemplateBody=json.dumps(as_deployed(gpu.templates[name], ssm)))
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


def test_an_upgrade_keeps_the_operators_value_and_reports_the_new_default(gpu, moto_env, monkeypatch):
    """Issue 46: a kit upgrade that changes a tunable's description and default rewrites the description; the value
    `turnkv params set` wrote stays, and `turnkv params diff` names the default the upgrade did not apply."""
    for key, value in {"AWS_ENDPOINT_URL": moto_env, "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": REGION}.items():
        monkeypatch.setenv(key, value)
    ssm = boto3.client("ssm", region_name=REGION, endpoint_url=moto_env)
    cfn = boto3.client("cloudformation", region_name=REGION, endpoint_url=moto_env)
    name = next(s for s in gpu.templates if s.endswith("-params"))
    before = json.loads(json.dumps(gpu.templates[name]).replace("/turnkv/gpu/", "/turnkv/upgrade/"))
    cfn.create_stack(StackName="upgrade-params", TemplateBody=json.dumps(as_deployed(before, ssm)))
    path = "/turnkv/upgrade/engine/decoder_kv_blocks_ttl"
    assert ssm.get_parameter(Name=path)["Parameter"]["Value"] == "480"

    ok = CliRunner().invoke(app, ["params", "set", "decoder_kv_blocks_ttl=600", "-d", "upgrade", "--who", "ci"])
    assert ok.exit_code == 0, ok.output

    # The next kit: decoder_kv_blocks_ttl's default 480 -> 540 and new help text, as its synth would write them.
    after = json.loads(json.dumps(before))
    resources = after["Resources"]
    (keeper,) = [r for r in resources.values() if r["Type"] == "AWS::CloudFormation::CustomResource"]
    spec = json.loads(keeper["Properties"]["Tunables"])
    spec["decoder_kv_blocks_ttl"]["default"] = "540"
    keeper["Properties"]["Tunables"] = json.dumps(spec)
    keeper["Properties"]["Revision"] = "next-kit"
    ttl = resources["DecoderKvBlocksTtl"]["Properties"]
    ttl["Description"] = ttl["Description"].replace("default 480", "default 540") + " Reworded."
    cfn.update_stack(StackName="upgrade-params", TemplateBody=json.dumps(as_deployed(after, ssm)))
    assert cfn.describe_stacks(StackName="upgrade-params")["Stacks"][0]["StackStatus"] == "UPDATE_COMPLETE"

    stored = ssm.get_parameters(Names=[path])["Parameters"][0]
    assert stored["Value"] == "600"  # the operator's, not the old or the new default
    (described,) = ssm.describe_parameters(ParameterFilters=[{"Key": "Name", "Values": [path]}])["Parameters"]
    assert described["Description"].endswith("default 540. Reworded.")

    kit_defaults = params.defaults
    monkeypatch.setattr(params, "defaults", lambda: {**kit_defaults(), "decoder_kv_blocks_ttl": 540})  # the next kit
    diffed = CliRunner().invoke(app, ["params", "diff", "-d", "upgrade", "--json"])
    assert diffed.exit_code == 0, diffed.output
    assert json.loads(diffed.output)["decoder_kv_blocks_ttl"] == {
        "stored": "600", "default": 540,
        "reason": "kept: deploys never overwrite a stored value; `turnkv params set` applies the default"}
