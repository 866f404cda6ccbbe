# shellcheck shell=bash
# shellcheck disable=SC2034 # the variables below are used by the scripts that source this file
# Shared helpers for the turnkv AMI build steps. Sourced, never run.
#
# Every step works against a root folder, TURNKV_ROOT (default /), so tests can bake into a fake root
# with stubbed commands on PATH. Every external command is called by name through PATH.
# Idempotency: each step records what it installed in $STATE_DIR/<step> and skips work whose record
# matches; a second run changes nothing.

set -euo pipefail

TURNKV_ROOT="${TURNKV_ROOT:-/}"
# R is the root without its trailing slash: "$R/opt/..." is /opt/... on a real image.
R="${TURNKV_ROOT%/}"
export TURNKV_ROOT
VENV="$R/opt/turnkv/venv"
STATE_DIR="$R/var/lib/turnkv/ami"
ETC_DIR="$R/etc/turnkv"
SCRIPTS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# Downloads and build trees live outside the root: they are not part of the image.
WORK_DIR="${TURNKV_WORK_DIR:-/var/tmp/turnkv-ami}"

# The build steps per flavor, in order (ami/recipes.py ORDER lists the same components).
STEPS_gpu=(00-base 10-efa 20-nixl 30-vllm-gpu 40-connector 50-cloudwatch-agent)
STEPS_neuron=(00-base 10-efa 31-vllm-neuron 40-connector 50-cloudwatch-agent)

log() { printf 'turnkv-ami[%s]: %s\n' "${STEP:-?}" "$*" >&2; }

die() {
    printf 'turnkv-ami[%s]: ERROR: %s\n' "${STEP:-?}" "$*" >&2
    exit 1
}

# require VAR...: fail naming every unset or empty variable.
require() {
    local missing=() name
    for name in "$@"; do
        [[ -n "${!name:-}" ]] || missing+=("$name")
    done
    ((${#missing[@]} == 0)) || die "missing required variable(s): ${missing[*]} (the component passes them)"
}

# done_with KEY VALUE: true when the step recorded VALUE for KEY on an earlier run.
done_with() {
    [[ -f "$STATE_DIR/$1" && "$(<"$STATE_DIR/$1")" == "$2" ]]
}

# record KEY VALUE: remember that KEY is installed at VALUE (written only when it changes).
record() {
    mkdir -p "$STATE_DIR"
    done_with "$1" "$2" || printf '%s\n' "$2" >"$STATE_DIR/$1"
}

# install_file SRC DEST [MODE]: copy only when the content differs (keeps mtimes stable on re-runs).
install_file() {
    local src="$1" dest="$2" mode="${3:-0644}"
    if [[ -f "$dest" ]] && cmp -s "$src" "$dest"; then
        return 0
    fi
    mkdir -p "$(dirname "$dest")"
    install -m "$mode" "$src" "$dest"
    log "installed ${dest#"$R"}"
}

# sha256_of FILE: the hex digest, via sha256sum on PATH.
sha256_of() {
    local out
    out="$(sha256sum "$1")"
    printf '%s\n' "${out%% *}"
}

# on_real_root: true when building the running system (systemctl, ldconfig act on it).
on_real_root() { [[ -z "$R" ]]; }
