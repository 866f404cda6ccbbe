#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Step 10: the EFA installer at the pinned version (checksum pinned, GPG signature checked when AWS's key is
# reachable), and its libfabric checked. A base image that already carries the pinned version or a newer one
# (the installer's own record of its version) is kept as it is: never downgraded. `fi_info -p efa` is no test of
# that: it needs EFA interfaces, which the build instance has none of.
# Env: TURNKV_EFA_INSTALLER_VERSION, TURNKV_EFA_INSTALLER_SHA256, TURNKV_LIBFABRIC_VERSION, TURNKV_EFA_PREFIX,
#      TURNKV_EFA_GPG_FINGERPRINT; optional TURNKV_EFA_BASE_URL (download host), TURNKV_REQUIRE_EFA_DEVICE (true
#      on a node with EFA interfaces; Image Builder instances have none, so the components leave it false).
STEP=10-efa
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

require TURNKV_EFA_INSTALLER_VERSION TURNKV_EFA_INSTALLER_SHA256 TURNKV_LIBFABRIC_VERSION TURNKV_EFA_PREFIX
version="$TURNKV_EFA_INSTALLER_VERSION"
sha="$TURNKV_EFA_INSTALLER_SHA256"
prefix="$TURNKV_EFA_PREFIX"
tarball_name="aws-efa-installer-$version.tar.gz"
base="${TURNKV_EFA_BASE_URL:-https://efa-installer.amazonaws.com}"
url="$base/$tarball_name"
export PATH="$R$prefix/bin:$PATH"

# The version the installer wrote down (its own record of what is on this root).
installed_version() {
    local file="$R/opt/amazon/efa_installed_packages"
    [[ -f "$file" ]] || return 0
    sed -n 's/^# EFA installer version: *//p' "$file" | head -n 1
}

# True when the base image's own EFA installation is at least the pin (a newer one is kept, never downgraded).
base_image_efa_ok() {
    local have
    have="$(installed_version)"
    [[ -n "$have" ]] && version_ge "$have" "$version"
}

verify() {
    local have fi_path libfabric
    have="$(installed_version)"
    if [[ -z "$have" ]] || ! version_ge "$have" "$version"; then
        die "EFA installer ${have:-(none)} is installed, the pin is $version (or newer)"
    fi
    fi_path="$(command -v fi_info || true)"
    [[ "$fi_path" == "$R$prefix/bin/fi_info" ]] ||
        die "fi_info resolves to '${fi_path:-nothing}', not $prefix/bin/fi_info: a distro libfabric shadows EFA's"
    libfabric="$(fi_info --version | sed -n 's/^libfabric: *//p' | head -n 1)"
    # The pinned installer brings exactly the pinned libfabric; a newer installer kept from the base image, a newer one.
    if [[ "$have" == "$version" ]]; then
        [[ "$libfabric" == "$TURNKV_LIBFABRIC_VERSION"* ]] ||
            die "libfabric at $prefix is '${libfabric:-unknown}', the pin is $TURNKV_LIBFABRIC_VERSION"
    else
        if [[ -z "$libfabric" ]] || ! version_ge "$libfabric" "$TURNKV_LIBFABRIC_VERSION"; then
            die "libfabric at $prefix is '${libfabric:-unknown}', older than the pin $TURNKV_LIBFABRIC_VERSION"
        fi
    fi
    [[ -e "$R$prefix/lib/libfabric.so.1" ]] || die "$prefix/lib/libfabric.so.1 is missing"
    if [[ "${TURNKV_REQUIRE_EFA_DEVICE:-false}" == "true" ]]; then
        TURNKV_EFA_PREFIX="$prefix" bash "$SCRIPTS_DIR/efa-wait.sh"
    fi
}

if [[ "${1:-}" == "--verify" ]]; then verify; exit 0; fi

if [[ "$(installed_version)" == "$version" ]] && done_with efa-installer "$version"; then
    log "EFA installer $version already installed"
elif base_image_efa_ok; then
    log "the base image carries EFA installer $(installed_version) (pin $version or newer): keeping it"
    record efa-installer "$(installed_version)"
else
    [[ "$sha" =~ ^[0-9a-f]{64}$ ]] ||
        die "the EFA installer checksum is not pinned (EFA_INSTALLER_SHA256='$sha' in turnkv/versions.py). \
Download $url, check its GPG signature as the EFA user guide describes, and record its sha256sum there."
    mkdir -p "$WORK_DIR/efa"
    tarball="$WORK_DIR/efa/$tarball_name"
    log "downloading $url"
    curl -fsSL --retry 3 -o "$tarball" "$url" || die "could not download $url"
    actual="$(sha256_of "$tarball")"
    if [[ "$actual" != "$sha" ]]; then
        rm -f "$tarball"
        die "checksum mismatch for $tarball_name: expected $sha, got $actual. Not installing it. \
A corrupt or tampered download, or a re-published release: check the GPG signature before changing \
EFA_INSTALLER_SHA256 in turnkv/versions.py."
    fi
    log "checksum ok ($actual)"
    require TURNKV_EFA_GPG_FINGERPRINT
    verify_signature "$tarball" "$url.sig" "$base/aws-efa-installer.key" "$TURNKV_EFA_GPG_FINGERPRINT"
    tar -xzf "$tarball" -C "$WORK_DIR/efa"
    (cd "$WORK_DIR/efa/aws-efa-installer" && ./efa_installer.sh -y)
    record efa-installer "$version"
fi
verify
log "ok: EFA installer $(installed_version) (pin $version), libfabric at $prefix"
