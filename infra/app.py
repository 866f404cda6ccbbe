"""The CDK app (``cdk.json``: ``python -m infra.app``): six stacks from one validated config.

    network, params, image -> serving -> router -> observability

``cdk deploy --all`` does everything: the image stack bakes the engine AMI (``AWS::ImageBuilder::Image``;
CloudFormation waits for it) and publishes its id to SSM, which the serving stack's launch templates read.
``image.ami_id`` in the config skips the bake (five stacks). Synth needs no credentials and no lookups
(AZs come from the config).
cdk-nag's AwsSolutions pack runs on every synth (``infra.nag`` holds each acknowledgement and its reason).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import aws_cdk as cdk
from aws_cdk import aws_ec2 as ec2

from infra import lint, nag
from infra.config import ConfigError, DeploymentConfig, from_context
from infra.instances import INSTANCE_TYPES
from infra.stacks.image import ImageSources, ImageStack
from infra.stacks.network import NetworkStack
from infra.stacks.observability import ObservabilityStack
from infra.stacks.params import ParamsStack
from infra.stacks.router import RouterStack
from infra.stacks.serving import ServingStack
from infra.wheel import REPO_ROOT, build_node_wheel

CONFIG_KEY = "turnkv"
CONFIG_FILE_KEY = "turnkv:config"
WHEEL_KEY = "turnkv:wheel"
NAG_KEY = "turnkv:nag"


@dataclass
class TurnkvApp:
    config: DeploymentConfig
    network: NetworkStack
    params: ParamsStack
    image: ImageStack | None
    serving: ServingStack
    router: RouterStack
    observability: ObservabilityStack

    @property
    def stacks(self) -> list[cdk.Stack]:
        return [s for s in (self.network, self.params, self.image, self.serving, self.router, self.observability)
                if s is not None]


def default_image_sources(app: cdk.App) -> ImageSources:
    """``ami.recipes`` (the AMI side's interface) and the turnkv wheel built from this tree."""
    if not (REPO_ROOT / "ami" / "recipes.py").is_file():
        raise ConfigError([("ami.recipes", f"{REPO_ROOT / 'ami' / 'recipes.py'} is missing; the image stack "
                                           "needs the AMI recipes (ami/ from the AMI work)")])
    from ami import recipes
    wheel = app.node.try_get_context(WHEEL_KEY)
    wheel_path = Path(wheel) if wheel else build_node_wheel(REPO_ROOT / "dist" / "turnkv-wheel")
    return ImageSources(images=recipes.IMAGES, scripts_dir=recipes.SCRIPTS_DIR, wheel=wheel_path,
                        deploy_parameters=recipes.deploy_parameters, recipe_fingerprint=recipes.recipe_fingerprint)


#: Feature flags the app relies on (set unless cdk.json or -c already decides).
FEATURE_FLAGS = {
    # Server access logs through a bucket policy instead of the legacy LogDeliveryWrite ACL (cfn-lint W3045).
    "@aws-cdk/aws-s3:serverAccessLogsUseBucketPolicy": True,
    # Cross-stack references as exports (what CloudFormation protects from deletion), stated explicitly.
    "@aws-cdk/core:defaultCrossStackReferences": "strong",
}


def build(app: cdk.App, config: DeploymentConfig | None = None, image_sources: ImageSources | None = None,
          run_nag: bool | None = None) -> TurnkvApp:
    for flag, value in FEATURE_FLAGS.items():
        if app.node.try_get_context(flag) is None:
            app.node.set_context(flag, value)
    if config is None:
        config = from_context(app.node.try_get_context(CONFIG_KEY), app.node.try_get_context(CONFIG_FILE_KEY))
    account = config.account or os.environ.get("CDK_DEFAULT_ACCOUNT")
    env = cdk.Environment(account=account, region=config.region)
    if account:
        # With a concrete account, CDK looks the region's AZs up (a call the CLI makes with credentials, and
        # that fails without them). The config names the AZs: answer the lookup from it, so synth stays offline.
        key = f"availability-zones:account={account}:region={config.region}"
        if app.node.try_get_context(key) is None:
            app.node.set_context(key, list(config.network.availability_zones))
    prefix = config.prefix
    tags = {"turnkv:deployment": config.name, "project": "turnkv"}

    network = NetworkStack(app, f"{prefix}-network", config=config, env=env,
                           description="turnkv: VPC, endpoints, flow logs")
    params = ParamsStack(app, f"{prefix}-params", config=config, env=env,
                         description="turnkv: tunables in SSM Parameter Store")
    flavors = tuple(sorted({INSTANCE_TYPES[p.instance_type].flavor.value for p in config.pools}))
    image: ImageStack | None = None
    if config.image.ami_id:
        images = {f: ec2.MachineImage.generic_linux({config.region: config.image.ami_id}) for f in flavors}
    else:
        image = ImageStack(app, f"{prefix}-image", config=config, flavors=flavors, env=env,
                           sources=image_sources or default_image_sources(app),
                           description="turnkv: engine AMI, baked by Image Builder during the deploy")
        images = {f: ec2.MachineImage.from_ssm_parameter(config.ami_parameter(f)) for f in flavors}
    serving = ServingStack(app, f"{prefix}-serving", config=config, network=network, images=images, env=env,
                           description="turnkv: engine pools on EFA, Cloud Map")
    if image is not None:
        serving.add_stack_dependency(image, "the launch templates read the AMI id the image stack publishes")
    serving.add_stack_dependency(params, "engines read their tunables at boot")
    router = RouterStack(app, f"{prefix}-router", config=config, network=network, serving=serving, env=env,
                         description="turnkv: KV-aware router on Fargate behind an ALB")
    router.add_stack_dependency(params, "the router reads its tunables")
    observability = ObservabilityStack(app, f"{prefix}-observability", config=config, serving=serving,
                                       env=env, description="turnkv: dashboard and alarms")
    observability.add_stack_dependency(router, "the dashboard and alarms read the ALB and service names the router "
                                               "stack publishes in SSM")
    result = TurnkvApp(config, network, params, image, serving, router, observability)
    for stack in result.stacks:
        lint.apply(stack, azs=stack is network)
        for key, value in tags.items():
            cdk.Tags.of(stack).add(key, value)
    if run_nag is None:
        run_nag = str(app.node.try_get_context(NAG_KEY) or "true").lower() != "false"
    if run_nag:
        nag.apply(app, result)
    return result


def main(app: cdk.App | None = None) -> int:
    app = app or cdk.App()
    try:
        build(app)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    app.synth()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
