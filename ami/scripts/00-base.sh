#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Step 00: OS packages, the turnkv folders and the Python virtualenv at /opt/turnkv/venv.
# Env: TURNKV_FLAVOR (gpu|neuron); optional TURNKV_PYTHON (interpreter for the venv, default python3).
STEP=00-base
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

require TURNKV_FLAVOR
case "$TURNKV_FLAVOR" in
    gpu | neuron) ;;
    *) die "TURNKV_FLAVOR must be gpu or neuron, not '$TURNKV_FLAVOR'" ;;
esac

# libhwloc15: the nixl wheel's libplugin_LIBFABRIC.so NEEDS libhwloc.so.15 (and libfabric.so.1, which the EFA
# installer provides) without bundling it. Build tools: only if that plugin has to be built from source (step 20).
PACKAGES="ca-certificates curl git jq libhwloc15 python3-venv python3-dev build-essential pkg-config meson ninja-build"

verify() {
    [[ -x "$VENV/bin/python" && -x "$VENV/bin/pip" ]] || die "no virtualenv at ${VENV#"$R"} (python/pip missing)"
    [[ -d "$ETC_DIR" && -d "$R/opt/turnkv/bin" ]] || die "turnkv folders missing under ${R:-/}"
    done_with flavor "$TURNKV_FLAVOR" || die "this image was started as flavor '$(cat "$STATE_DIR/flavor" 2>/dev/null)'"
}

if [[ "${1:-}" == "--verify" ]]; then verify; exit 0; fi

if ! done_with apt-packages "$PACKAGES"; then
    log "installing OS packages: $PACKAGES"
    export DEBIAN_FRONTEND=noninteractive
    # A fresh instance's unattended-upgrades may hold the dpkg lock for minutes: wait for it, don't fail.
    apt-get -o DPkg::Lock::Timeout=600 update -q
    # shellcheck disable=SC2086 # word splitting of the package list is intended
    apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends $PACKAGES
    record apt-packages "$PACKAGES"
fi

mkdir -p "$ETC_DIR" "$R/opt/turnkv/bin" "$R/opt/turnkv/models" "$STATE_DIR"
if [[ -f "$STATE_DIR/flavor" ]] && ! done_with flavor "$TURNKV_FLAVOR"; then
    die "this root was baked as flavor '$(<"$STATE_DIR/flavor")'; refusing to turn it into '$TURNKV_FLAVOR'"
fi
record flavor "$TURNKV_FLAVOR"

# Neuron: the engine venv is the DLAMI's vLLM venv, extended (its compiler, torch-neuronx, nki and plugin are the
# Neuron SDK's; the vllm-neuron setup guide: a fresh venv has none of them). A relative link, so it resolves in the
# image. A parent without exactly one such venv gets a fresh venv here, and step 31 refuses it by name.
dlami_venvs=()
if [[ "$TURNKV_FLAVOR" == neuron && ! -e "$VENV" ]]; then
    mapfile -t dlami_venvs < <(compgen -G "$R/opt/aws_neuronx_venv_pytorch_inference_vllm_*" || true)
fi
if ((${#dlami_venvs[@]} == 1)) && [[ -x "${dlami_venvs[0]}/bin/python" ]]; then
    log "extending the DLAMI's venv ${dlami_venvs[0]#"$R"} as ${VENV#"$R"}"
    ln -s "../$(basename "${dlami_venvs[0]}")" "$VENV"
elif [[ ! -x "$VENV/bin/python" ]]; then
    log "creating the virtualenv ${VENV#"$R"}"
    "${TURNKV_PYTHON:-python3}" -m venv "$VENV"
fi
verify
log "ok"
