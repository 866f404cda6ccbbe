"""Image stack: the deploy bakes one AMI per flavor in use (``AWS::ImageBuilder::Image``, which CloudFormation
waits for), publishes its id to SSM for the serving stack, delivers the turnkv wheel at a named S3 key, and
runs the build instance with IMDSv2."""

from __future__ import annotations

import json
import zipfile

import pytest

from infra.wheel import digest

pytestmark = pytest.mark.infra


def _by_type(synth, kind):
    return list(synth.resources("image", kind).values())


def test_the_deploy_bakes_the_image_and_the_serving_stack_reads_its_id(gpu, push):
    for synth, flavor in ((gpu, "gpu"), (push, "gpu")):
        assert _by_type(synth, "AWS::ImageBuilder::ImagePipeline") == [], "a pipeline nobody runs bakes nothing"
        images = synth.resources("image", "AWS::ImageBuilder::Image")
        ((image_id, image),) = images.items()
        props = image["Properties"]
        assert props["ImageTestsConfiguration"]["ImageTestsEnabled"] is True
        (recipe_id,) = synth.resources("image", "AWS::ImageBuilder::ImageRecipe")
        assert props["ImageRecipeArn"] == {"Fn::GetAtt": [recipe_id, "Arn"]}
        # The baked AMI id goes to the SSM parameter the serving stack's launch templates resolve.
        name = f"/turnkv/{synth.app.config.name}/ami/{flavor}"
        (param,) = [p["Properties"] for p in synth.resources("image", "AWS::SSM::Parameter").values()
                    if p["Properties"]["Name"] == name]
        assert param["Value"] == {"Fn::GetAtt": [image_id, "ImageId"]}
        assert param["DataType"] == "aws:ec2:image"
        serving_params = synth.template("serving")["Parameters"]
        assert any(p.get("Default") == name and p["Type"] == "AWS::SSM::Parameter::Value<AWS::EC2::Image::Id>"
                   for p in serving_params.values())
        # ...and is deployed after the image stack (cdk deploy --all follows the dependency).
        assert synth.app.image in synth.app.serving.dependencies


def test_a_recipe_change_makes_a_new_image(gpu, image_sources):
    """The recipe name carries a fingerprint of everything in it, so a changed pin is a new recipe and a new
    image (CloudFormation replaces the Image resource), hence a new AMI id in the parameter."""
    (recipe,) = _by_type(gpu, "AWS::ImageBuilder::ImageRecipe")
    assets = {"ScriptsS3Uri": "asset:x", "TurnkvWheelS3Uri": "y"}
    assert image_sources.recipe_fingerprint("gpu", assets) != image_sources.recipe_fingerprint(
        "gpu", {**assets, "TurnkvWheelS3Uri": "z"})
    assert recipe["Properties"]["Name"].rsplit("-", 1)[-1].isalnum()


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
