#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Step 40: the turnkv wheel (CLI + connector, built from this repo and delivered as an S3 asset), the
# systemd units, the environment templates the serving stack's user data fills in, and helpers.
# Env: TURNKV_WHEEL_S3_URI (s3://.../turnkv-<version>-py3-none-any.whl), TURNKV_VERSION, TURNKV_FLAVOR.
STEP=40-connector
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

require TURNKV_WHEEL_S3_URI TURNKV_VERSION TURNKV_FLAVOR
version="$TURNKV_VERSION"
uri="$TURNKV_WHEEL_S3_URI"
wheel="$(basename "$uri")"
FILES="$SCRIPTS_DIR/files"
UNITS=(turnkv-engine.service turnkv-params-sync.service turnkv-params-sync.timer)

[[ "$uri" == s3://* ]] || die "TURNKV_WHEEL_S3_URI must be an s3:// URL, not '$uri'"
[[ "$wheel" == turnkv-"$version"-*.whl ]] ||
    die "the wheel '$wheel' is not turnkv $version (pin TURNKV in turnkv/versions.py and pyproject agree?)"

verify() {
    local have unit
    have="$("$VENV/bin/pip" show turnkv 2>/dev/null | sed -n 's/^Version: *//p')"
    [[ "$have" == "$version" ]] || die "turnkv ${have:-(none)} is installed, the pin is $version"
    [[ -x "$VENV/bin/turnkv" ]] || die "${VENV#"$R"}/bin/turnkv is missing"
    for unit in "${UNITS[@]}"; do
        [[ -f "$R/etc/systemd/system/$unit" ]] || die "systemd unit $unit is missing"
    done
    [[ -x "$R/opt/turnkv/bin/turnkv-efa-wait" ]] || die "/opt/turnkv/bin/turnkv-efa-wait is missing"
}

if [[ "${1:-}" == "--verify" ]]; then verify; exit 0; fi

# The URL names the wheel's content (the image stack puts a digest in its key): a new wheel of the same
# version is a new URL, and is installed over the old one.
if ! done_with turnkv-wheel "$version $uri"; then
    mkdir -p "$WORK_DIR/wheel"
    log "fetching $uri"
    aws s3 cp --only-show-errors "$uri" "$WORK_DIR/wheel/$wheel"
    "$VENV/bin/pip" install --no-cache-dir "$WORK_DIR/wheel/$wheel"
    "$VENV/bin/pip" install --no-cache-dir --no-deps --force-reinstall "$WORK_DIR/wheel/$wheel"
    record turnkv-wheel "$version $uri"
fi

for unit in "${UNITS[@]}"; do
    install_file "$FILES/$unit" "$R/etc/systemd/system/$unit"
done
install_file "$FILES/engine.env.template" "$ETC_DIR/engine.env.template"
install_file "$FILES/node.env.template" "$ETC_DIR/node.env.template"
install_file "$SCRIPTS_DIR/efa-wait.sh" "$R/opt/turnkv/bin/turnkv-efa-wait" 0755
install_file "$SCRIPTS_DIR/lib.sh" "$R/opt/turnkv/bin/lib.sh"

# The timer starts at boot once user data has written node.env (its units check that the file exists).
# The engine is enabled by user data after it writes engine.env.
timer_link="$R/etc/systemd/system/timers.target.wants/turnkv-params-sync.timer"
# -L as well as -e: under a fake root the link's absolute target resolves outside it.
if [[ ! -L "$timer_link" && ! -e "$timer_link" ]]; then
    systemctl --root="$TURNKV_ROOT" enable turnkv-params-sync.timer
fi
verify
log "ok: turnkv $version, units and templates installed"
