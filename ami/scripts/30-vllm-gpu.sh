#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Step 30: vLLM (GPU build) at the pinned version in /opt/turnkv/venv.
# Env: TURNKV_VLLM_VERSION.
STEP=30-vllm-gpu
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

require TURNKV_VLLM_VERSION
version="$TURNKV_VLLM_VERSION"

verify() {
    local have
    have="$("$VENV/bin/pip" show vllm 2>/dev/null | sed -n 's/^Version: *//p')"
    [[ "$have" == "$version" ]] || die "vllm ${have:-(none)} is installed, the pin is $version"
}

if [[ "${1:-}" == "--verify" ]]; then verify; exit 0; fi

if ! done_with vllm "$version"; then
    # Keep the NIXL step's pin: vLLM must not replace the nixl wheel whose plugin step 20 checked.
    nixl="$("$VENV/bin/pip" show nixl 2>/dev/null | sed -n 's/^Version: *//p')"
    log "installing vllm==$version${nixl:+ (keeping nixl==$nixl)}"
    "$VENV/bin/pip" install --no-cache-dir "vllm==$version" ${nixl:+"nixl==$nixl"}
    record vllm "$version"
fi
verify
log "ok: vllm $version"
