#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Step 31: the vLLM Neuron plugin (vllm-project/vllm-neuron at the pinned tag) in /opt/turnkv/venv.
# It brings the vLLM version it supports and the Neuron framework packages from the Neuron pip repository.
# Env: TURNKV_VLLM_NEURON_VERSION; optional TURNKV_NEURON_PIP_INDEX, TURNKV_VLLM_NEURON_GIT_URL.
STEP=31-vllm-neuron
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

require TURNKV_VLLM_NEURON_VERSION
version="$TURNKV_VLLM_NEURON_VERSION"
index="${TURNKV_NEURON_PIP_INDEX:-https://pip.repos.neuron.amazonaws.com}"
git_url="${TURNKV_VLLM_NEURON_GIT_URL:-https://github.com/vllm-project/vllm-neuron.git}"

verify() {
    local have
    have="$("$VENV/bin/pip" show vllm-neuron 2>/dev/null | sed -n 's/^Version: *//p')"
    [[ "$have" == "$version" ]] || die "vllm-neuron ${have:-(none)} is installed, the pin is $version"
    "$VENV/bin/pip" show vllm >/dev/null 2>&1 || die "vllm-neuron is installed without vllm"
}

if [[ "${1:-}" == "--verify" ]]; then verify; exit 0; fi

if ! done_with vllm-neuron "$version"; then
    log "installing vllm-neuron $version from $git_url"
    "$VENV/bin/pip" install --no-cache-dir --extra-index-url "$index" "vllm-neuron @ git+$git_url@$version"
    record vllm-neuron "$version"
fi
verify
log "ok: vllm-neuron $version"
