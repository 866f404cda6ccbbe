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
STEPS_neuron=(00-base 10-efa 20-nixl 31-vllm-neuron 40-connector 50-cloudwatch-agent)

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

# version_ge A B: true when version A >= version B (sort -V order: 1.9.0 < 1.10.0, 2.5.0amzn < 2.5.0amzn1.0).
version_ge() {
    [[ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | head -n 1)" == "$2" ]]
}

# verify_signature FILE SIG_URL KEY_URL FINGERPRINT: check FILE's detached GPG signature with the vendor's key,
# whose fingerprint is pinned (turnkv/versions.py). When the key or the signature cannot be fetched (no route to
# the vendor's site) or gpg is missing, say so and rely on the pinned SHA-256 the caller already checked. A key
# with another fingerprint or a bad signature is a hard failure.
verify_signature() {
    local file="$1" sig_url="$2" key_url="$3" want="$4" home fpr
    if ! command -v gpg >/dev/null; then
        log "gpg is not installed: ${file##*/} rests on its pinned SHA-256"
        return 0
    fi
    if ! curl -fsSL --retry 2 -o "$file.key" "$key_url" || ! curl -fsSL --retry 2 -o "$file.sig" "$sig_url"; then
        log "signing key or signature not reachable ($key_url, $sig_url): ${file##*/} rests on its pinned SHA-256"
        return 0
    fi
    home="$(mktemp -d)"
    gpg --homedir "$home" --batch --quiet --import "$file.key" 2>/dev/null || die "could not import the key $key_url"
    fpr="$(gpg --homedir "$home" --batch --with-colons --fingerprint | awk -F: '$1 == "fpr" {print $10; exit}')"
    if [[ "$fpr" != "$want" ]]; then
        rm -rf "$home" "$file"
        die "the key at $key_url has fingerprint ${fpr:-(none)}, not the pinned $want: not installing ${file##*/}"
    fi
    if ! gpg --homedir "$home" --batch --quiet --verify "$file.sig" "$file" 2>/dev/null; then
        rm -rf "$home" "$file"
        die "bad GPG signature on ${file##*/} (key $want): not installing it"
    fi
    rm -rf "$home"
    log "GPG signature ok: ${file##*/} (key $want)"
}

# on_real_root: true when building the running system (systemctl, ldconfig act on it).
on_real_root() { [[ -z "$R" ]]; }
