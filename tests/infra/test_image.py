"""Image stack: one Image Builder pipeline per flavor in use, AMI ids published to SSM through the
distribution configuration, the turnkv wheel delivered at a named S3 key, IMDSv2 on the build instance."""

from __future__ import annotations

import json
import zipfile

import pytest

from infra.wheel import digest

pytestmark = pytest.mark.infra


def _by_type(synth, kind):
    return list(synth.resources("image", kind).values())


def test_one_pipeline_per_flavor_publishing_the_ami_id_to_ssm(gpu, neuron):
    for synth, flavor in ((gpu, "gpu"), (neuron, "neuron")):
        (pipeline,) = _by_type(synth, "AWS::ImageBuilder::ImagePipeline")
        assert pipeline["Properties"]["Name"] == f"{synth.app.config.prefix}-{flavor}"
        assert pipeline["Properties"]["ImageTestsConfiguration"]["ImageTestsEnabled"] is True
        (dist,) = _by_type(synth, "AWS::ImageBuilder::DistributionConfiguration")
        (d,) = dist["Properties"]["Distributions"]
        assert d["Region"] == "us-east-2"
        assert d["SsmParameterConfigurations"] == [
            {"ParameterName": f"/turnkv/{synth.app.config.name}/ami/{flavor}", "DataType": "aws:ec2:image"}]
        # the serving stack reads exactly that parameter
        serving_params = synth.template("serving")["Parameters"]
        assert any(p.get("Default") == d["SsmParameterConfigurations"][0]["ParameterName"]
                   for p in serving_params.values())


def test_recipe_uses_the_ami_recipes(gpu, image_sources):
    spec = image_sources.images["gpu"]
    (recipe,) = _by_type(gpu, "AWS::ImageBuilder::ImageRecipe")
    props = recipe["Properties"]
    assert props["ParentImage"] == f"ssm:{spec.parent_image_ssm_parameter}"
    assert props["Name"].startswith("turnkv-gpu-gpu-") and props["Version"] == "1.0.0"
    assert len(props["Components"]) == len(spec.components)
    (root,) = props["BlockDeviceMappings"]
    assert root["Ebs"]["Encrypted"] is True and root["Ebs"]["VolumeSize"] == spec.volume_size_gib
    components = {c["Properties"]["Name"]: c["Properties"] for c in _by_type(gpu, "AWS::ImageBuilder::Component")}
    for c in spec.components:
        assert components[f"turnkv-gpu-{c.name}"]["Version"] == c.version
        assert components[f"turnkv-gpu-{c.name}"]["Data"] == c.path.read_text()


def test_wheel_goes_to_a_named_key_under_its_digest(gpu, image_sources):
    (recipe,) = _by_type(gpu, "AWS::ImageBuilder::ImageRecipe")
    params = [p for c in recipe["Properties"]["Components"] for p in c.get("Parameters", [])]
    (wheel_param,) = [p for p in params if p["Name"] == "TurnkvWheelS3Uri"]
    uri = json.dumps(wheel_param["Value"])
    name = image_sources.wheel.name
    assert name.startswith("turnkv-") and name.endswith("-py3-none-any.whl")
    assert f"/wheels/{digest(image_sources.wheel)}/{name}" in uri
    assert all(p["Value"] for p in params if p["Name"] == "ScriptsS3Uri")
    (deployment,) = _by_type(gpu, "Custom::CDKBucketDeployment")
    assert deployment["Properties"]["DestinationBucketKeyPrefix"] == f"wheels/{digest(image_sources.wheel)}/"
    with zipfile.ZipFile(image_sources.wheel) as whl:
        names = whl.namelist()
    assert "turnkv/node_env.py" in names and "turnkv/emf_bridge.py" in names and "turnkv/commands/params.py" in names


def test_build_instance_requires_imdsv2_and_terminates_on_failure(any_app):
    for infra_config in _by_type(any_app, "AWS::ImageBuilder::InfrastructureConfiguration"):
        props = infra_config["Properties"]
        assert props["InstanceMetadataOptions"]["HttpTokens"] == "required"
        assert props["TerminateInstanceOnFailure"] is True
        assert props["Logging"]["S3Logs"]["S3BucketName"]
