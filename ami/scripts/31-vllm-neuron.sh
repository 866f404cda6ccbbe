#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Step 31: the Neuron SDK's vLLM plugin as Neuron ships it. The parent is the single-framework vLLM DLAMI of the
# pinned plugin (versioned SSM parameter, turnkv.neuron.dlami_parent_parameter); step 00 made /opt/turnkv/venv that
# DLAMI's vLLM venv, so the Neuron compiler, torch-neuronx, nki, vllm-neuron and vLLM are the SDK's own, and steps 20
# and 40 extend it with NIXL and turnkv's connector (the vllm-neuron setup guide, Options A and B). Should the venv
# lack the plugin, it comes from Neuron's pip repository (never a git tag). NIXL's LIBFABRIC plugin gets the shared
# libraries it links (libcuda.so.1: a stub, as the setup guide does; libcudart.so.13) when the image has none, and
# every NIXL plugin in the plugin folder is loaded (dlopen, RTLD_NOW) at bake: one that cannot load fails the bake,
# not the first engine start.
# Env: TURNKV_VLLM_NEURON_VERSION, TURNKV_VLLM_VERSION, TURNKV_NIXL_VERSION; optional TURNKV_NEURON_PIP_INDEX,
#      TURNKV_CUDA_KEYRING_URL.
STEP=31-vllm-neuron
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

require TURNKV_VLLM_NEURON_VERSION TURNKV_VLLM_VERSION TURNKV_NIXL_VERSION
version="$TURNKV_VLLM_NEURON_VERSION"
# The DLAMI names its vLLM venv after the plugin release (turnkv.neuron.dlami_vllm_venv; a test ties the two).
dlami_venv="/opt/aws_neuronx_venv_pytorch_inference_vllm_${version//./_}"
# NVIDIA's CUDA repository (its keyring): the driver stub from cuda-cudart-dev, the CUDA 13 runtime NIXL 1.5's
# LIBFABRIC plugin links (its GPUDirect path; never called on Neuron, but the loader needs it).
keyring_url="${TURNKV_CUDA_KEYRING_URL:-https://developer.download.nvidia.com/compute/cuda/repos/ubuntu2204/x86_64/cuda-keyring_1.0-1_all.deb}"
cuda_stub_package=cuda-cudart-dev-12-6
cuda_stub="/usr/local/cuda-12.6/targets/x86_64-linux/lib/stubs/libcuda.so"
cudart_package=cuda-cudart-13-0
cudart="/usr/local/cuda-13.0/targets/x86_64-linux/lib/libcudart.so.13"
# The SDK's own packages the DLAMI venv carries (a fresh venv has none of them: the setup guide's Option A).
SDK_PACKAGES="neuronx-cc torch-neuronx nki"

have_lib() { ldconfig -p | grep "${1//./\\.} " >/dev/null; }  # not -q: pipefail and an early exit
vllm_version="$TURNKV_VLLM_VERSION"
index="${TURNKV_NEURON_PIP_INDEX:-https://pip.repos.neuron.amazonaws.com}"

installed() { "$VENV/bin/pip" show "$1" 2>/dev/null | sed -n 's/^Version: *//p'; }

# Every NIXL plugin loads with all its libraries resolved now (RTLD_NOW), as NIXL's dlopen needs them at start.
load_plugins() {
    local plugin_dir library_path
    plugin_dir="$(sed -n 's/^NIXL_PLUGIN_DIR=//p' "$ETC_DIR/nixl.env")"
    library_path="$(sed -n 's/^LD_LIBRARY_PATH=//p' "$ETC_DIR/nixl.env")"
    LD_LIBRARY_PATH="$library_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$VENV/bin/python" -c '
import ctypes, glob, os, sys
found = sorted(glob.glob(os.path.join(sys.argv[1], "libplugin_*.so")))
bad = []
for path in found:
    try:
        ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_LOCAL)
    except OSError as exc:
        bad.append(str(exc))
print("\n".join(bad) if bad else f"{len(found)} NIXL plugins load")
sys.exit(1 if bad or not found else 0)' "$R$plugin_dir"
}

verify() {
    local have have_vllm have_nixl pkg
    [[ -L "$VENV" && "$(readlink -f "$VENV")" == "$(readlink -f "$R$dlami_venv")" ]] ||
        die "${VENV#"$R"} is not the DLAMI's $dlami_venv: the engine venv must extend the Neuron SDK's own"
    for pkg in $SDK_PACKAGES; do
        [[ -n "$(installed "$pkg")" ]] || die "$pkg is missing from $dlami_venv: not the Neuron DLAMI's vLLM venv"
    done
    have="$(installed vllm-neuron)"
    [[ "${have%%+*}" == "$version" ]] || die "vllm-neuron ${have:-(none)} is installed, the pin is $version"
    have_vllm="$(installed vllm)"
    # The connector runs only on vLLM releases our suites run: another one would be refused at engine start.
    [[ "${have_vllm%%+*}" == "$vllm_version" ]] ||
        die "vllm-neuron $version brought vllm ${have_vllm:-(none)}; turnkv's connector is tested on $vllm_version"
    have_nixl="$(installed nixl)"
    [[ "$have_nixl" == "$TURNKV_NIXL_VERSION" ]] ||
        die "nixl ${have_nixl:-(none)} is installed; step 20 checked the LIBFABRIC plugin of $TURNKV_NIXL_VERSION"
    have_lib libcuda.so.1 || die "no libcuda.so.1 on the loader path: NIXL's LIBFABRIC plugin cannot load"
    load_plugins || die "a NIXL plugin does not load (above): every engine would stop with 'unsupported backend'"
}

# The parent must be the DLAMI of the pinned plugin's Neuron SDK (its runtime, compiler and torch-neuronx).
[[ -d "$R$dlami_venv" ]] ||
    die "the parent image has no $dlami_venv: it is not the Neuron DLAMI of vllm-neuron $version (ami.recipes \
names that release's versioned SSM parameter); bake from it (image.ami_id for your own AMI) or move \
turnkv.versions.VLLM_NEURON to the parent's release"

if [[ "${1:-}" == "--verify" ]]; then verify; exit 0; fi

if [[ "$(installed vllm-neuron)" != "$version" ]]; then
    log "vllm-neuron $version from Neuron's pip repository ($index), keeping nixl==$TURNKV_NIXL_VERSION"
    "$VENV/bin/pip" install --no-cache-dir --extra-index-url "$index" \
        "vllm-neuron==$version" "vllm==$vllm_version" "nixl==$TURNKV_NIXL_VERSION"
fi
cuda_repo() {
    done_with cuda-keyring "$keyring_url" && return 0
    mkdir -p "$WORK_DIR/neuron"
    curl -fsSL --retry 3 -o "$WORK_DIR/neuron/cuda-keyring.deb" "$keyring_url"
    dpkg -i "$WORK_DIR/neuron/cuda-keyring.deb"
    apt-get -o DPkg::Lock::Timeout=600 update
    record cuda-keyring "$keyring_url"
}
# link_library NAME PACKAGE TARGET: install PACKAGE and put TARGET on the loader path as NAME when NAME is missing.
link_library() {
    have_lib "$1" && return 0
    log "no $1: installing $2 (NIXL's LIBFABRIC plugin links it; Neuron never calls it)"
    cuda_repo
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y --no-install-recommends "$2"
    mkdir -p "$R/usr/local/lib"
    ln -sf "$3" "$R/usr/local/lib/$1"
    ldconfig
}
link_library libcuda.so.1 "$cuda_stub_package" "$cuda_stub"
link_library libcudart.so.13 "$cudart_package" "$cudart"
verify
log "ok: vllm-neuron $version on vllm $vllm_version, nixl $TURNKV_NIXL_VERSION, in the DLAMI's ${dlami_venv}"
