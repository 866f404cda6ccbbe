#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Wait for an EFA device to be visible to the EFA libfabric, then exit 0; fail hard if none shows up.
# Installed as /opt/turnkv/bin/turnkv-efa-wait and run before the engine (EFA devices come up late on p5en).
# Env: TURNKV_EFA_WAIT_SECONDS (default 300), TURNKV_EFA_WAIT_INTERVAL (default 5),
#      TURNKV_EFA_PREFIX (default /opt/amazon/efa), TURNKV_EFA_REQUIRED (default true; false skips the wait).
STEP=efa-wait
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

if [[ "${TURNKV_EFA_REQUIRED:-true}" == "false" ]]; then
    log "TURNKV_EFA_REQUIRED=false: not waiting for EFA"
    exit 0
fi
prefix="${TURNKV_EFA_PREFIX:-/opt/amazon/efa}"
wait_s="${TURNKV_EFA_WAIT_SECONDS:-300}"
interval="${TURNKV_EFA_WAIT_INTERVAL:-5}"
[[ "$wait_s" =~ ^[0-9]+$ && "$interval" =~ ^[1-9][0-9]*$ ]] ||
    die "TURNKV_EFA_WAIT_SECONDS and TURNKV_EFA_WAIT_INTERVAL must be whole seconds"
# The EFA libfabric's fi_info first, so a distro libfabric cannot answer for it.
export PATH="$R$prefix/bin:$PATH"

attempts=$(((wait_s + interval - 1) / interval + 1))
for ((i = 1; i <= attempts; i++)); do
    if out="$(fi_info -p efa 2>&1)" && grep -q "provider: efa" <<<"$out"; then
        log "EFA visible to libfabric (attempt $i)"
        exit 0
    fi
    if ((i < attempts)); then sleep "$interval"; fi
done
die "no EFA device visible to libfabric after ${wait_s}s ('fi_info -p efa' found nothing: ${out:-no output}). \
Check that the launch template attaches EFA interfaces (InterfaceType efa/efa-only), that no distro libfabric \
shadows $prefix (ldconfig -p | grep libfabric), and that /dev/infiniband is present (containers need it mounted)."
