"""The engine AMI bake's pieces (``infra.stacks.image``), scope-preserving (``infra.constructs``):

- ``BakeInputs``: the build-logs and artifacts buckets, the AMI scripts asset, the turnkv wheel copied to a
  digest-named prefix, and the build instances' role and instance profile;
- ``ImageComponents``: one Image Builder component per name, shared between flavors;
- ``FlavorImage``: one flavor's recipe, infrastructure and distribution configurations, the image
  CloudFormation waits on, and the SSM parameter holding its AMI id.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from aws_cdk import Duration, RemovalPolicy
from aws_cdk import aws_iam as iam
from aws_cdk import aws_imagebuilder as imagebuilder
from aws_cdk import aws_s3 as s3
from aws_cdk import aws_s3_assets as s3_assets
from aws_cdk import aws_s3_deployment as s3deploy
from aws_cdk import aws_ssm as ssm
from constructs import Construct

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
class BakeInputsProps:
    #: The AMI scripts (``ami.recipes.SCRIPTS_DIR``), uploaded as one asset.
    scripts_dir: Path
    #: The turnkv wheel the AMI installs.
    wheel: Path


class BakeInputs:
    """``logs_bucket``, ``artifacts``, ``scripts``, ``wheel_prefix``, ``wheel_deployment``, ``assets`` (what the
    components take: ``ScriptsS3Uri``, ``TurnkvWheelS3Uri``), ``fingerprint_inputs`` (the same, by content),
    ``role`` and ``profile``."""

    def __init__(self, scope: Construct, props: BakeInputsProps) -> None:
        self.logs_bucket = s3.Bucket(
            scope, "BuildLogs", encryption=s3.BucketEncryption.S3_MANAGED, enforce_ssl=True,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL, removal_policy=RemovalPolicy.DESTROY,
            auto_delete_objects=True, lifecycle_rules=[s3.LifecycleRule(expiration=Duration.days(90))])
        self.artifacts = s3.Bucket(
            scope, "Artifacts", encryption=s3.BucketEncryption.S3_MANAGED, enforce_ssl=True,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL, removal_policy=RemovalPolicy.DESTROY,
            object_ownership=s3.ObjectOwnership.BUCKET_OWNER_ENFORCED, versioned=True, auto_delete_objects=True,
            server_access_logs_bucket=self.logs_bucket, server_access_logs_prefix="artifacts-access/")
        # Both buckets fill during a bake: emptied on delete (every version), or `cdk destroy` fails on them.

        self.scripts = s3_assets.Asset(scope, "Scripts", path=str(props.scripts_dir))
        # The AMI's connector step checks the file name (turnkv-<version>-*.whl), so the wheel is copied to a
        # named key; the content digest in the prefix makes a new wheel a new URL (and a new recipe).
        wheel_digest = digest(props.wheel)
        self.wheel_prefix = f"wheels/{wheel_digest}/"
        self.wheel_deployment = s3deploy.BucketDeployment(
            scope, "Wheel", sources=[s3deploy.Source.asset(str(props.wheel.parent))],
            destination_bucket=self.artifacts, destination_key_prefix=self.wheel_prefix, prune=False,
            retain_on_delete=False, memory_limit=512)
        wheel_uri = f"s3://{self.artifacts.bucket_name}/{self.wheel_prefix}{props.wheel.name}"
        self.assets = {"ScriptsS3Uri": self.scripts.s3_object_url, "TurnkvWheelS3Uri": wheel_uri}
        self.fingerprint_inputs = {"ScriptsS3Uri": f"asset:{self.scripts.asset_hash}",
                                   "TurnkvWheelS3Uri": wheel_digest}

        self.role = iam.Role(scope, "BuildRole", assumed_by=iam.ServicePrincipal("ec2.amazonaws.com"),
                             managed_policies=[
                                 iam.ManagedPolicy.from_aws_managed_policy_name("AmazonSSMManagedInstanceCore"),
                                 iam.ManagedPolicy.from_aws_managed_policy_name("EC2InstanceProfileForImageBuilder"),
                             ])
        self.scripts.grant_read(self.role)
        self.artifacts.grant_read(self.role, f"{self.wheel_prefix}*")
        self.logs_bucket.grant_put(self.role, "imagebuilder/*")
        self.profile = iam.InstanceProfile(scope, "BuildProfile", role=self.role)


@dataclass(frozen=True)
class ImageComponentsProps:
    prefix: str
    deployment: str
    #: The components of every image baked, in order; a name seen twice is made once.
    components: Iterable[ComponentLike]


class ImageComponents:
    """``by_name``: one ``CfnComponent`` per component name (one version serves every flavor; parameters belong to
    the recipe)."""

    def __init__(self, scope: Construct, props: ImageComponentsProps) -> None:
        self.by_name: dict[str, imagebuilder.CfnComponent] = {}
        for c in props.components:
            if c.name not in self.by_name:
                self.by_name[c.name] = imagebuilder.CfnComponent(
                    scope, f"Component-{c.name}", name=f"{props.prefix}-{c.name}", platform="Linux",
                    version=c.version, data=Path(c.path).read_text(),
                    description=f"turnkv {c.name} ({props.deployment})")


@dataclass(frozen=True)
class FlavorImageProps:
    flavor: str
    spec: ImageLike
    prefix: str
    deployment: str
    region: str
    #: The SSM parameter name the AMI id goes to (DeploymentConfig.ami_parameter).
    ami_parameter: str
    inputs: BakeInputs
    components: Mapping[str, imagebuilder.CfnComponent]
    #: ``ami.recipes.recipe_fingerprint`` and ``ami.recipes.deploy_parameters``.
    recipe_fingerprint: Callable[[str, Mapping[str, str]], str]
    deploy_parameters: Callable[[Any, Mapping[str, str]], Mapping[str, str]]
    #: image.build_instance_types; empty: the recipe's own list.
    build_instance_types: tuple[str, ...] = ()
    #: image.build_subnet_id / build_security_group_id; None: the account's default VPC.
    build_subnet_id: str | None = None
    build_security_group_id: str | None = None


class FlavorImage:
    """``recipe``, ``infrastructure``, ``distribution``, ``image`` and ``ami_parameter``."""

    def __init__(self, scope: Construct, props: FlavorImageProps) -> None:
        flavor, spec, prefix = props.flavor, props.spec, props.prefix
        fingerprint = props.recipe_fingerprint(flavor, props.inputs.fingerprint_inputs)
        self.recipe = imagebuilder.CfnImageRecipe(
            scope, f"Recipe-{flavor}", name=f"{prefix}-{flavor}-{fingerprint}", version="1.0.0",
            parent_image=f"ssm:{spec.parent_image_ssm_parameter}",
            components=[imagebuilder.CfnImageRecipe.ComponentConfigurationProperty(
                component_arn=props.components[c.name].attr_arn,
                parameters=[imagebuilder.CfnImageRecipe.ComponentParameterProperty(name=k, value=[v])
                            for k, v in props.deploy_parameters(c, props.inputs.assets).items()] or None,
            ) for c in spec.components],
            block_device_mappings=[imagebuilder.CfnImageRecipe.InstanceBlockDeviceMappingProperty(
                device_name="/dev/sda1",
                ebs=imagebuilder.CfnImageRecipe.EbsInstanceBlockDeviceSpecificationProperty(
                    volume_size=spec.volume_size_gib, volume_type="gp3", encrypted=True,
                    delete_on_termination=True))],
            working_directory="/var/tmp",
        )
        self.recipe.node.add_dependency(props.inputs.wheel_deployment)
        self.infrastructure = imagebuilder.CfnInfrastructureConfiguration(
            scope, f"Infrastructure-{flavor}", name=f"{prefix}-{flavor}",
            instance_profile_name=props.inputs.profile.instance_profile_name,
            instance_types=list(props.build_instance_types or spec.build_instance_types),
            terminate_instance_on_failure=True,
            # No subnet: the build runs in the account's default VPC (it downloads the EFA installer,
            # NIXL and vLLM), away from the engines' endpoint-only VPC; image.build_subnet_id names another.
            subnet_id=props.build_subnet_id,
            security_group_ids=[props.build_security_group_id] if props.build_security_group_id else None,
            instance_metadata_options=imagebuilder.CfnInfrastructureConfiguration.InstanceMetadataOptionsProperty(
                http_tokens="required", http_put_response_hop_limit=2),
            logging=imagebuilder.CfnInfrastructureConfiguration.LoggingProperty(
                s3_logs=imagebuilder.CfnInfrastructureConfiguration.S3LogsProperty(
                    s3_bucket_name=props.inputs.logs_bucket.bucket_name, s3_key_prefix=f"imagebuilder/{flavor}")),
        )
        self.distribution = imagebuilder.CfnDistributionConfiguration(
            scope, f"Distribution-{flavor}", name=f"{prefix}-{flavor}",
            distributions=[imagebuilder.CfnDistributionConfiguration.DistributionProperty(
                region=props.region,
                ami_distribution_configuration={
                    "Name": f"{prefix}-{flavor}-{{{{ imagebuilder:buildDate }}}}",
                    "AmiTags": {"turnkv:deployment": props.deployment, "turnkv:flavor": flavor},
                },
            )],
        )
        # CloudFormation waits for the bake (create: build, test, distribute; hours at most). A recipe change
        # replaces the resource: the new AMI is built first, the old one stays registered (deleting an
        # Image Builder image leaves its AMI) while the engines roll over to the new one.
        self.image = imagebuilder.CfnImage(
            scope, f"Image-{flavor}",
            image_recipe_arn=self.recipe.attr_arn,
            infrastructure_configuration_arn=self.infrastructure.attr_arn,
            distribution_configuration_arn=self.distribution.attr_arn,
            image_tests_configuration=imagebuilder.CfnImage.ImageTestsConfigurationProperty(
                image_tests_enabled=True, timeout_minutes=120),
            enhanced_image_metadata_enabled=True,
            tags={"turnkv:deployment": props.deployment, "turnkv:flavor": flavor},
        )
        # The bake reads the scripts and the wheel with the build role's grants (its DefaultPolicy): through the
        # instance profile CloudFormation orders the image after the role only, so the build could start before
        # the policy exists and fail its first download.
        self.image.node.add_dependency(props.inputs.role)
        self.ami_parameter = ssm.StringParameter(
            scope, f"AmiId-{flavor}", parameter_name=props.ami_parameter,
            string_value=self.image.attr_image_id, data_type=ssm.ParameterDataType.AWS_EC2_IMAGE,
            description=f"turnkv {props.deployment}: the {flavor} engine AMI baked by this stack")
