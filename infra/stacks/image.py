"""Image: the engine AMI of ``ami/recipes.py``, baked by the deploy itself.

One ``AWS::ImageBuilder::Image`` per flavor: CloudFormation creates it by running the bake and waits until the
AMI exists (or the bake fails, with its logs in the BuildLogs bucket). Its ``ImageId`` goes into the SSM
parameter ``/turnkv/<deployment>/ami/<flavor>`` (an ``AWS::SSM::Parameter`` of this stack, so it exists once
this stack is deployed), which the serving stack's launch templates read through an SSM-typed stack parameter.
The serving stack depends on this one, so ``cdk deploy --all`` bakes, then serves.

Why a parameter and not an export: an export in use cannot change value, and a new AMI must change it. With the
parameter, a changed recipe (its name carries a fingerprint of everything in it) makes a new image, a new
parameter value, and on the serving stack's next deploy (the CDK CLI always deploys stacks that read SSM
parameters) a new launch template version and a rolling replacement of the engines (``EngineGroup``).
A config with ``image.ami_id`` skips this stack (bring your own AMI).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aws_cdk import Stack
from aws_cdk import aws_imagebuilder as imagebuilder
from aws_cdk import aws_ssm as ssm
from constructs import Construct

from infra.config import DeploymentConfig, build_types_offered
from infra.constructs.engine_image import (  # noqa: F401  (ComponentLike re-exported with ImageLike)
    BakeInputs,
    BakeInputsProps,
    ComponentLike,
    FlavorImage,
    FlavorImageProps,
    ImageComponents,
    ImageComponentsProps,
    ImageLike,
)


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
    """Built from scope-preserving constructs (``infra.constructs.engine_image``): the logical ids are the ones
    the inline constructor had."""

    def __init__(self, scope: Construct, construct_id: str, *, config: DeploymentConfig, sources: ImageSources,
                 flavors: tuple[str, ...], **kwargs) -> None:
        super().__init__(scope, construct_id, **kwargs)
        self.config = config
        missing = [f for f in flavors if f not in sources.images]
        if missing:
            raise ValueError(f"ami.recipes has no image for flavor(s) {missing}; known: {sorted(sources.images)}")

        inputs = BakeInputs(self, BakeInputsProps(scripts_dir=sources.scripts_dir, wheel=sources.wheel))
        self.logs_bucket = inputs.logs_bucket
        self.wheel_prefix = inputs.wheel_prefix
        self.components: dict[str, imagebuilder.CfnComponent] = ImageComponents(self, ImageComponentsProps(
            prefix=config.prefix, deployment=config.name,
            components=[c for flavor in flavors for c in sources.images[flavor].components])).by_name

        self.images: dict[str, imagebuilder.CfnImage] = {}
        self.ami_parameters: dict[str, ssm.StringParameter] = {}
        self.distributions: dict[str, imagebuilder.CfnDistributionConfiguration] = {}
        for flavor in flavors:
            baked = FlavorImage(self, FlavorImageProps(
                flavor=flavor, spec=sources.images[flavor], prefix=config.prefix, deployment=config.name,
                region=config.region, ami_parameter=config.ami_parameter(flavor), inputs=inputs,
                components=self.components, recipe_fingerprint=sources.recipe_fingerprint,
                deploy_parameters=sources.deploy_parameters,
                # Only the recipe's build types the region offers (trn2.3xlarge is not offered where trn2.48xlarge
                # is in us-east-2): the bake would otherwise spend its first launch on a type EC2 refuses there.
                build_instance_types=config.image.build_instance_types or build_types_offered(
                    sources.images[flavor].build_instance_types, config.region),
                build_subnet_id=config.image.build_subnet_id,
                build_security_group_id=config.image.build_security_group_id))
            self.distributions[flavor] = baked.distribution
            self.images[flavor] = baked.image
            self.ami_parameters[flavor] = baked.ami_parameter
