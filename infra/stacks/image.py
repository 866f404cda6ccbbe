"""Image: the engine AMI of ``ami/recipes.py``, baked by the deploy itself.

One ``AWS::ImageBuilder::Image`` per flavor: CloudFormation creates it by running the bake and waits until the
AMI exists (or the bake fails, with its logs in the BuildLogs bucket). Its ``ImageId`` goes into the SSM
parameter ``/turnkv/<deployment>/ami/<flavor>`` (an ``AWS::SSM::Parameter`` of this stack, so it exists once
this stack is deployed), which the serving stack's launch templates read through an SSM-typed stack parameter.
The serving stack depends on this one, so ``cdk deploy --all`` bakes, then serves.

Why a parameter and not an export: an export in use cannot change value, and a new AMI must change it. With the
parameter, a changed recipe (its name carries a fingerprint of everything in it) makes a new image, a new
parameter value, and on the serving stack's next deploy (the CDK CLI always deploys stacks that read SSM
parameters) a new launch template version and a rolling replacement of the engines (``EnginePool``).
A config with ``image.ami_id`` skips this stack (bring your own AMI).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from aws_cdk import Duration, RemovalPolicy, Stack
from aws_cdk import aws_iam as iam
from aws_cdk import aws_imagebuilder as imagebuilder
from aws_cdk import aws_s3 as s3
from aws_cdk import aws_s3_assets as s3_assets
from aws_cdk import aws_s3_deployment as s3deploy
from aws_cdk import aws_ssm as ssm
from constructs import Construct

from infra.config import DeploymentConfig
from infra.wheel import digest


class ComponentLike(Protocol):
    name: str
    path: Path
    version: str
    parameters: dict[str, str]


class ImageLike(Protocol):
    flavor: str
    parent_image_ssm_parameter: str
    components: tuple[ComponentLike, ...]
    build_instance_types: tuple[str, ...]
    volume_size_gib: int


@dataclass(frozen=True)
class ImageSources:
    """What the AMI side provides (``ami.recipes`` after the merge) plus the wheel this repo builds."""

    images: Mapping[str, ImageLike]
    scripts_dir: Path
    wheel: Path
    #: ``ami.recipes.deploy_parameters(component, assets)``: a component's pins plus the asset URLs it takes.
    deploy_parameters: Any
    #: ``ami.recipes.recipe_fingerprint(flavor, assets)``.
    recipe_fingerprint: Any


class ImageStack(Stack):
    def __init__(self, scope: Construct, construct_id: str, *, config: DeploymentConfig, sources: ImageSources,
                 flavors: tuple[str, ...], **kwargs) -> None:
        super().__init__(scope, construct_id, **kwargs)
        self.config = config
        missing = [f for f in flavors if f not in sources.images]
        if missing:
            raise ValueError(f"ami.recipes has no image for flavor(s) {missing}; known: {sorted(sources.images)}")

        logs_bucket = s3.Bucket(
            self, "BuildLogs", encryption=s3.BucketEncryption.S3_MANAGED, enforce_ssl=True,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL, removal_policy=RemovalPolicy.DESTROY,
            auto_delete_objects=True, lifecycle_rules=[s3.LifecycleRule(expiration=Duration.days(90))])
        artifacts = s3.Bucket(
            self, "Artifacts", encryption=s3.BucketEncryption.S3_MANAGED, enforce_ssl=True,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL, removal_policy=RemovalPolicy.DESTROY,
            object_ownership=s3.ObjectOwnership.BUCKET_OWNER_ENFORCED, versioned=True, auto_delete_objects=True,
            server_access_logs_bucket=logs_bucket, server_access_logs_prefix="artifacts-access/")
        # Both buckets fill during a bake: emptied on delete (every version), or `cdk destroy` fails on them.
        self.logs_bucket = logs_bucket

        scripts = s3_assets.Asset(self, "Scripts", path=str(sources.scripts_dir))
        # The AMI's connector step checks the file name (turnkv-<version>-*.whl), so the wheel is copied to a
        # named key; the content digest in the prefix makes a new wheel a new URL (and a new recipe).
        wheel_digest = digest(sources.wheel)
        wheel_prefix = f"wheels/{wheel_digest}/"
        self.wheel_prefix = wheel_prefix
        deployment = s3deploy.BucketDeployment(
            self, "Wheel", sources=[s3deploy.Source.asset(str(sources.wheel.parent))],
            destination_bucket=artifacts, destination_key_prefix=wheel_prefix, prune=False, retain_on_delete=False,
            memory_limit=512)
        wheel_uri = f"s3://{artifacts.bucket_name}/{wheel_prefix}{sources.wheel.name}"
        assets = {"ScriptsS3Uri": scripts.s3_object_url, "TurnkvWheelS3Uri": wheel_uri}
        fingerprint_inputs = {"ScriptsS3Uri": f"asset:{scripts.asset_hash}", "TurnkvWheelS3Uri": wheel_digest}

        role = iam.Role(self, "BuildRole", assumed_by=iam.ServicePrincipal("ec2.amazonaws.com"),
                        managed_policies=[
                            iam.ManagedPolicy.from_aws_managed_policy_name("AmazonSSMManagedInstanceCore"),
                            iam.ManagedPolicy.from_aws_managed_policy_name("EC2InstanceProfileForImageBuilder"),
                        ])
        scripts.grant_read(role)
        artifacts.grant_read(role, f"{wheel_prefix}*")
        logs_bucket.grant_put(role, "imagebuilder/*")
        profile = iam.InstanceProfile(self, "BuildProfile", role=role)

        # Components are shared between flavors (one version serves both; parameters belong to the recipe).
        self.components: dict[str, imagebuilder.CfnComponent] = {}
        for flavor in flavors:
            for c in sources.images[flavor].components:
                if c.name not in self.components:
                    self.components[c.name] = imagebuilder.CfnComponent(
                        self, f"Component-{c.name}", name=f"{config.prefix}-{c.name}", platform="Linux",
                        version=c.version, data=Path(c.path).read_text(),
                        description=f"turnkv {c.name} ({config.name})")

        self.images: dict[str, imagebuilder.CfnImage] = {}
        self.ami_parameters: dict[str, ssm.StringParameter] = {}
        self.distributions: dict[str, imagebuilder.CfnDistributionConfiguration] = {}
        for flavor in flavors:
            spec = sources.images[flavor]
            fingerprint = sources.recipe_fingerprint(flavor, fingerprint_inputs)
            recipe = imagebuilder.CfnImageRecipe(
                self, f"Recipe-{flavor}", name=f"{config.prefix}-{flavor}-{fingerprint}", version="1.0.0",
                parent_image=f"ssm:{spec.parent_image_ssm_parameter}",
                components=[imagebuilder.CfnImageRecipe.ComponentConfigurationProperty(
                    component_arn=self.components[c.name].attr_arn,
                    parameters=[imagebuilder.CfnImageRecipe.ComponentParameterProperty(name=k, value=[v])
                                for k, v in sources.deploy_parameters(c, assets).items()] or None,
                ) for c in spec.components],
                block_device_mappings=[imagebuilder.CfnImageRecipe.InstanceBlockDeviceMappingProperty(
                    device_name="/dev/sda1",
                    ebs=imagebuilder.CfnImageRecipe.EbsInstanceBlockDeviceSpecificationProperty(
                        volume_size=spec.volume_size_gib, volume_type="gp3", encrypted=True,
                        delete_on_termination=True))],
                working_directory="/var/tmp",
            )
            recipe.node.add_dependency(deployment)
            infra_config = imagebuilder.CfnInfrastructureConfiguration(
                self, f"Infrastructure-{flavor}", name=f"{config.prefix}-{flavor}",
                instance_profile_name=profile.instance_profile_name,
                instance_types=list(config.image.build_instance_types or spec.build_instance_types),
                terminate_instance_on_failure=True,
                # No subnet: the build runs in the account's default VPC (it downloads the EFA installer,
                # NIXL and vLLM), away from the engines' endpoint-only VPC; image.build_subnet_id names another.
                subnet_id=config.image.build_subnet_id,
                security_group_ids=[config.image.build_security_group_id] if config.image.build_security_group_id
                else None,
                instance_metadata_options=imagebuilder.CfnInfrastructureConfiguration.InstanceMetadataOptionsProperty(
                    http_tokens="required", http_put_response_hop_limit=2),
                logging=imagebuilder.CfnInfrastructureConfiguration.LoggingProperty(
                    s3_logs=imagebuilder.CfnInfrastructureConfiguration.S3LogsProperty(
                        s3_bucket_name=logs_bucket.bucket_name, s3_key_prefix=f"imagebuilder/{flavor}")),
            )
            distribution = imagebuilder.CfnDistributionConfiguration(
                self, f"Distribution-{flavor}", name=f"{config.prefix}-{flavor}",
                distributions=[imagebuilder.CfnDistributionConfiguration.DistributionProperty(
                    region=config.region,
                    ami_distribution_configuration={
                        "Name": f"{config.prefix}-{flavor}-{{{{ imagebuilder:buildDate }}}}",
                        "AmiTags": {"turnkv:deployment": config.name, "turnkv:flavor": flavor},
                    },
                )],
            )
            self.distributions[flavor] = distribution
            # CloudFormation waits for the bake (create: build, test, distribute; hours at most). A recipe change
            # replaces the resource: the new AMI is built first, the old one stays registered (deleting an
            # Image Builder image leaves its AMI) while the engines roll over to the new one.
            self.images[flavor] = imagebuilder.CfnImage(
                self, f"Image-{flavor}",
                image_recipe_arn=recipe.attr_arn,
                infrastructure_configuration_arn=infra_config.attr_arn,
                distribution_configuration_arn=distribution.attr_arn,
                image_tests_configuration=imagebuilder.CfnImage.ImageTestsConfigurationProperty(
                    image_tests_enabled=True, timeout_minutes=120),
                enhanced_image_metadata_enabled=True,
                tags={"turnkv:deployment": config.name, "turnkv:flavor": flavor},
            )
            self.ami_parameters[flavor] = ssm.StringParameter(
                self, f"AmiId-{flavor}", parameter_name=config.ami_parameter(flavor),
                string_value=self.images[flavor].attr_image_id, data_type=ssm.ParameterDataType.AWS_EC2_IMAGE,
                description=f"turnkv {config.name}: the {flavor} engine AMI baked by this stack")

