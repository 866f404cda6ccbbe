"""Deploy rehearsal, offline: every synthesized stack of the GPU app created in dependency order through the
CloudFormation API of moto in server mode, as `cdk deploy --all` would: file assets published to the bootstrap
bucket, the bootstrap version parameter present, each stack's imports resolved from the previous stacks' exports,
SSM-typed parameters resolved from SSM (the serving stack's AMI id comes from the parameter the image stack
writes), and every stack at CREATE_COMPLETE.

What moto cannot model is listed, never passed silently:
- resource types its CloudFormation does not implement are taken out of the template and what other resources
  read of them (Ref, Fn::GetAtt: the baked AMI id, ARNs) inlined as the service would answer; printed per stack;
- custom resources (Lambda-backed: moto would run them in Docker) are answered by this test as their provider
  would (the S3 prefix list lookup answers with a prefix list id);
- known moto deviations are adapted and printed (moto reads AWS::SSM::Parameter Tags as a list; CloudFormation
  takes a map).
Security-group egress, placement groups and the rest that moto skips are checked on the templates (test_serving,
test_compliance), not here.
"""

from __future__ import annotations

import contextlib
import io
import json
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.infra

REGION = "us-east-2"


def _modeled_types() -> dict[str, type]:
    """Resource types moto's CloudFormation implements (every backend imported first: the map fills on import)."""
    import importlib

    from moto.backends import list_of_moto_modules
    from moto.cloudformation import parsing

    for module in list_of_moto_modules():
        with contextlib.suppress(ImportError):
            importlib.import_module(f"moto.{module}.models")
    model_map = parsing.get_model_map() if hasattr(parsing, "get_model_map") else parsing.MODEL_MAP
    return dict(model_map)


def _stack_order(outdir: Path) -> list[str]:
    manifest = json.loads((outdir / "manifest.json").read_text())
    stacks = {n: a for n, a in manifest["artifacts"].items() if a["type"] == "aws:cloudformation:stack"}
    order: list[str] = []
    while len(order) < len(stacks):
        ready = [n for n, a in stacks.items() if n not in order
                 and all(d in order for d in a.get("dependencies", []) if d in stacks)]
        assert ready, f"a dependency cycle among {sorted(set(stacks) - set(order))}"
        order += sorted(ready)
    return order


def _publish_assets(s3, outdir: Path, account: str) -> int:
    """What `cdk deploy` does before the stacks: file assets (zips of folders) into the bootstrap bucket."""
    count, buckets = 0, set()
    for manifest in outdir.glob("*.assets.json"):
        for asset in json.loads(manifest.read_text()).get("files", {}).values():
            source = outdir / asset["source"]["path"]
            if source.is_dir():
                buf = io.BytesIO()
                with zipfile.ZipFile(buf, "w") as zf:
                    for path in sorted(source.rglob("*")):
                        if path.is_file():
                            zf.write(path, path.relative_to(source).as_posix())
                data = buf.getvalue()
            else:
                data = source.read_bytes()
            for dest in asset["destinations"].values():
                bucket = dest["bucketName"].replace("${AWS::AccountId}", account).replace("${AWS::Region}", REGION)
                if bucket not in buckets:
                    s3.create_bucket(Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": REGION})
                    buckets.add(bucket)
                s3.put_object(Bucket=bucket, Key=dest["objectKey"], Body=data)
                count += 1
    return count


def _getatts(template: dict) -> dict[str, set[str]]:
    """Logical id -> the attributes other resources or outputs read with Fn::GetAtt."""
    out: dict[str, set[str]] = {}

    def walk(node) -> None:
        if isinstance(node, dict):
            if "Fn::GetAtt" in node and isinstance(node["Fn::GetAtt"], list):
                lid, attr = node["Fn::GetAtt"]
                out.setdefault(lid, set()).add(attr)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(template)
    return out


#: Resource types whose Ref is an ARN (the rest: a name or an id).
REF_IS_ARN = {"AWS::SecretsManager::Secret": "secretsmanager", "AWS::SNS::TopicPolicy": "sns"}


def _literal(lid: str, attr: str | None, ami: str, kind: str = "") -> str:
    """What the provider (or the real service) would return for ``lid``'s attribute (None: its Ref)."""
    if attr is None and kind in REF_IS_ARN:
        return f"arn:aws:{REF_IS_ARN[kind]}:{REGION}:123456789012:secret:{lid}-AbCdEf"
    if attr == "ImageId":
        return ami  # the baked AMI, as Image Builder reports it
    if attr == "PrefixLists.0.PrefixListId":
        return "pl-0123456789abcdef0"  # the S3 prefix list, as DescribeManagedPrefixLists answers
    if attr == "Arn":
        return f"arn:aws:rehearsal:{REGION}:123456789012:{lid.lower()}"
    return f"{lid}-{attr or 'ref'}-rehearsal"


#: Attributes moto claims but leaves unresolved (found by this test: the raw Fn::GetAtt came back as the output).
MOTO_UNRESOLVED = {("AWS::ElasticLoadBalancingV2::LoadBalancer", "LoadBalancerFullName"),
                   ("AWS::ElasticLoadBalancingV2::TargetGroup", "TargetGroupFullName")}


def _attribute_modeled(cls: type, attr: str, kind: str) -> bool:
    if (kind, attr) in MOTO_UNRESOLVED or not hasattr(cls, "get_cfn_attribute"):
        return False
    has = getattr(cls, "has_cfn_attr", None)
    return bool(has(attr)) if has is not None else True


def _adapt(template: dict, modeled: dict[str, type], ami: str) -> tuple[dict, dict[str, str], list[str]]:
    """The template moto can take. Resources of types moto does not implement are taken out and what others read
    of them (Ref, Fn::GetAtt) inlined as the value the service would return; so are custom resources'
    attributes (moto resolves them before the provider answers). Known moto deviations are adapted."""
    template = json.loads(json.dumps(template))
    resources = template["Resources"]
    removed = {lid: r["Type"] for lid, r in resources.items() if r["Type"] not in modeled
               and not r["Type"].startswith("Custom::") and r["Type"] != "AWS::CloudFormation::CustomResource"}
    customs = {lid for lid, r in resources.items()
               if r["Type"].startswith("Custom::") or r["Type"] == "AWS::CloudFormation::CustomResource"}
    adapted: list[str] = []

    def inline(node):
        if isinstance(node, dict):
            if "Fn::GetAtt" in node and isinstance(node["Fn::GetAtt"], list):
                lid, attr = node["Fn::GetAtt"]
                kind = resources.get(lid, {}).get("Type", "")
                if lid in removed or lid in customs:
                    return _literal(lid, attr, ami)
                if kind in modeled and not _attribute_modeled(modeled[kind], attr, kind):
                    adapted.append(f"{lid}.{attr}: {kind} attribute moto does not model, inlined")
                    return _literal(lid, attr, ami)
            if set(node) == {"Ref"} and node["Ref"] in removed:
                return _literal(node["Ref"], None, ami, removed[node["Ref"]])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    template["Resources"] = inline(resources)
    for lid in removed:
        del template["Resources"][lid]
    if "Outputs" in template:
        template["Outputs"] = inline(template["Outputs"])
    for lid, res in template["Resources"].items():
        depends = res.get("DependsOn")
        if depends:
            kept = [d for d in ([depends] if isinstance(depends, str) else depends) if d not in removed]
            if kept:
                res["DependsOn"] = kept
            else:
                del res["DependsOn"]
        if res["Type"] == "AWS::SSM::Parameter" and isinstance(res.get("Properties", {}).get("Tags"), dict):
            res["Properties"]["Tags"] = [{"Key": k, "Value": v} for k, v in res["Properties"]["Tags"].items()]
            adapted.append(f"{lid}: AWS::SSM::Parameter Tags map -> list (moto reads a list)")
        if res["Type"] == "AWS::KMS::Key" and res.get("Properties", {}).get("Tags"):
            tags = res["Properties"]["Tags"]
            res["Properties"]["Tags"] = [{"TagKey": t["Key"], "TagValue": t["Value"]} for t in tags]
            adapted.append(f"{lid}: AWS::KMS::Key Tags Key/Value -> TagKey/TagValue (moto reads KMS API names)")
    return template, removed, adapted


def _answer(url: str, stack_id: str, lid: str, data: dict[str, str]) -> bool:
    """The provider's reply to CloudFormation's pre-signed response URL (moto's route for it)."""
    body = json.dumps({"Status": "SUCCESS", "StackId": stack_id, "LogicalResourceId": lid,
                       "PhysicalResourceId": f"{lid}-rehearsal", "Data": data}).encode()
    auth = f"AWS4-HMAC-SHA256 Credential=testing/20260101/{REGION}/cloudformation/aws4_request, " \
           "SignedHeaders=host, Signature=0"
    req = urllib.request.Request(f"{url}/cloudformation_{REGION}/cfnresponse?stack={stack_id}", data=body,
                                 method="PUT", headers={"Content-Type": "", "Authorization": auth})
    try:
        urllib.request.urlopen(req, timeout=10).read()
        return True
    except OSError:
        return False  # the stack has not reached this resource yet


@pytest.fixture
def moto_clean(moto_url):
    """In-process moto servers share one state: start empty and leave nothing for the next module."""
    def reset() -> None:
        urllib.request.urlopen(urllib.request.Request(f"{moto_url}/moto-api/reset", method="POST"), timeout=30)

    reset()
    yield moto_url
    reset()


def test_every_stack_deploys_in_order_through_moto_cloudformation(gpu, moto_clean, monkeypatch, capsys):
    import boto3

    moto_url = moto_clean
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": REGION}.items():
        monkeypatch.setenv(key, value)
    client = {name: boto3.client(name, endpoint_url=moto_url, region_name=REGION)
              for name in ("cloudformation", "s3", "ssm", "iam", "lambda", "ec2", "sts")}
    account = client["sts"].get_caller_identity()["Account"]
    # What `cdk bootstrap` leaves in an account, and the assets `cdk deploy` publishes.
    client["ssm"].put_parameter(Name="/cdk-bootstrap/hnb659fds/version", Value="30", Type="String")
    published = _publish_assets(client["s3"], gpu.outdir, account)
    ami = client["ec2"].describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    # The account's own ACM certificate (the config names it; moto issues its own ARNs, so the template's ARN is
    # swapped for the one moto issued).
    certificate = boto3.client("acm", endpoint_url=moto_url, region_name=REGION).request_certificate(
        DomainName="llm.acme.example")["CertificateArn"]

    modeled = _modeled_types()
    report: list[str] = [f"published {published} file assets; moto models {len(modeled)} resource types"]
    cfn = client["cloudformation"]
    order = _stack_order(gpu.outdir)
    at = {n.rsplit("-", 1)[-1]: i for i, n in enumerate(order)}
    assert max(at["network"], at["params"], at["image"]) < at["serving"] < at["router"] < at["observability"]
    for name in order:
        text = (gpu.outdir / f"{name}.template.json").read_text()
        original = json.loads(text.replace(gpu.app.config.router.certificate_arn, certificate))
        reads = _getatts(original)
        template, stand_ins, adapted = _adapt(original, modeled, ami)
        customs = [lid for lid, r in template["Resources"].items()
                   if r["Type"].startswith("Custom::") or r["Type"] == "AWS::CloudFormation::CustomResource"]
        cfn.create_stack(StackName=name, TemplateBody=json.dumps(template),
                         Capabilities=["CAPABILITY_IAM", "CAPABILITY_NAMED_IAM", "CAPABILITY_AUTO_EXPAND"])
        stack_id = cfn.describe_stacks(StackName=name)["Stacks"][0]["StackId"]
        answered: set[str] = set()
        deadline = time.monotonic() + 120
        while True:
            stack = cfn.describe_stacks(StackName=name)["Stacks"][0]
            if not stack["StackStatus"].endswith("IN_PROGRESS") or time.monotonic() > deadline:
                break
            for lid in customs:
                if lid in answered:
                    continue
                data = {attr: _literal(lid, attr, ami) for attr in reads.get(lid, ())}
                if _answer(moto_url, stack_id, lid, data):
                    answered.add(lid)
            time.sleep(0.2)
        events = [f"{e['LogicalResourceId']} {e['ResourceStatus']} {e.get('ResourceStatusReason', '')}"
                  for e in cfn.describe_stack_events(StackName=name)["StackEvents"][:5]]
        assert stack["StackStatus"] == "CREATE_COMPLETE", (name, stack.get("StackStatusReason"), events)
        created = cfn.list_stack_resources(StackName=name)["StackResourceSummaries"]
        outputs = {o["OutputKey"]: o["OutputValue"] for o in stack.get("Outputs", [])}
        for key, value in outputs.items():
            assert value and "Fn::" not in value and "${Token" not in value, (name, key, value)
        real_customs = sorted({original["Resources"][lid]["Type"] for lid in customs})
        report.append(f"{name}: CREATE_COMPLETE, {len(created)} of {len(original['Resources'])} resources created, "
                      f"{len(outputs)} outputs resolved; not modeled by moto (taken out, attributes inlined): "
                      f"{sorted(set(stand_ins.values())) or 'nothing'}; custom resources answered by the test: "
                      f"{real_customs or 'none'}; adapted for moto: {len(adapted)}")
    # The chain the one-command deploy rests on: the image stack's AMI id -> its SSM parameter -> the serving
    # stack's SSM-typed parameter -> every engine launch template.
    assert client["ssm"].get_parameter(Name=gpu.app.config.ami_parameter("gpu"))["Parameter"]["Value"] == ami
    for pool in gpu.app.config.pools:
        versions = client["ec2"].describe_launch_template_versions(
            LaunchTemplateName=f"{gpu.app.config.prefix}-{pool.name}")["LaunchTemplateVersions"]
        assert versions[-1]["LaunchTemplateData"]["ImageId"] == ami, pool.name
    report.append(f"every engine launch template boots {ami}, the AMI id the image stack published")
    with capsys.disabled():
        print("\ndeploy rehearsal (moto server-mode CloudFormation):\n  " + "\n  ".join(report))
