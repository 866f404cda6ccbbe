#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Step 50: the Amazon CloudWatch agent, installed the way the CloudWatch user guide documents for Ubuntu (the
# .deb from its versioned download path, its detached GPG signature checked against AWS's agent key, whose
# fingerprint is pinned), at the pinned version with its SHA-256; and turnkv's agent configuration (GPU or
# Neuron metrics, EFA counters, the EMF listener on tcp:25888 for engine metrics).
# Env: TURNKV_CLOUDWATCH_AGENT_VERSION, TURNKV_CLOUDWATCH_AGENT_SHA256, TURNKV_CLOUDWATCH_AGENT_GPG_FINGERPRINT,
#      TURNKV_FLAVOR; optional TURNKV_CLOUDWATCH_AGENT_BASE_URL.
STEP=50-cloudwatch-agent
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

require TURNKV_CLOUDWATCH_AGENT_VERSION TURNKV_FLAVOR
version="$TURNKV_CLOUDWATCH_AGENT_VERSION"
base="${TURNKV_CLOUDWATCH_AGENT_BASE_URL:-https://amazoncloudwatch-agent.s3.amazonaws.com}"
url="$base/ubuntu/amd64/$version/amazon-cloudwatch-agent.deb"
config="$R/opt/aws/amazon-cloudwatch-agent/etc/turnkv.json"

installed_version() {
    dpkg-query --admindir="$R/var/lib/dpkg" -W -f='${Version}' amazon-cloudwatch-agent 2>/dev/null || true
}

verify() {
    local have
    have="$(installed_version)"
    [[ "$have" == "$version"* ]] || die "CloudWatch agent ${have:-(none)} is installed, the pin is $version"
    [[ -f "$config" ]] || die "${config#"$R"} is missing"
}

if [[ "${1:-}" == "--verify" ]]; then verify; exit 0; fi

if [[ "$(installed_version)" != "$version"* ]]; then
    require TURNKV_CLOUDWATCH_AGENT_SHA256 TURNKV_CLOUDWATCH_AGENT_GPG_FINGERPRINT
    mkdir -p "$WORK_DIR/cloudwatch"
    deb="$WORK_DIR/cloudwatch/amazon-cloudwatch-agent.deb"
    log "downloading $url"
    curl -fsSL --retry 3 -o "$deb" "$url" ||
        die "could not download $url: is CLOUDWATCH_AGENT=$version (turnkv/versions.py) a published build?"
    actual="$(sha256_of "$deb")"
    if [[ "$actual" != "$TURNKV_CLOUDWATCH_AGENT_SHA256" ]]; then
        rm -f "$deb"
        die "checksum mismatch for the CloudWatch agent $version: expected $TURNKV_CLOUDWATCH_AGENT_SHA256, got \
$actual. Not installing it."
    fi
    verify_signature "$deb" "$url.sig" "$base/assets/amazon-cloudwatch-agent.gpg" \
        "$TURNKV_CLOUDWATCH_AGENT_GPG_FINGERPRINT"
    dpkg --root="$TURNKV_ROOT" -i -E "$deb"
fi
install_file "$SCRIPTS_DIR/files/cloudwatch-agent-$TURNKV_FLAVOR.json" "$config"
verify
log "ok: CloudWatch agent $version"
