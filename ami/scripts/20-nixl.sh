#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Step 20: NIXL with a LIBFABRIC plugin linked against the EFA libfabric.
# The wheel's plugin is used when it links $TURNKV_EFA_PREFIX/lib/libfabric.so.1; otherwise NIXL is built
# from source at the pinned tag with -Dlibfabric_path=$TURNKV_EFA_PREFIX. /etc/turnkv/nixl.env tells the
# engine which plugin folder to load (NIXL_PLUGIN_DIR) and puts the EFA libfabric first (LD_LIBRARY_PATH).
# Env: TURNKV_NIXL_VERSION, TURNKV_NIXL_CUDA_PACKAGE, TURNKV_NIXL_GIT_TAG, TURNKV_EFA_PREFIX;
#      optional TURNKV_NIXL_GIT_URL.
STEP=20-nixl
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

require TURNKV_NIXL_VERSION TURNKV_NIXL_CUDA_PACKAGE TURNKV_NIXL_GIT_TAG TURNKV_EFA_PREFIX
version="$TURNKV_NIXL_VERSION"
prefix="$TURNKV_EFA_PREFIX"
efa_lib="$R$prefix/lib"
source_prefix="$R/opt/turnkv/nixl"
git_url="${TURNKV_NIXL_GIT_URL:-https://github.com/ai-dynamo/nixl.git}"

# links_efa PLUGIN: the plugin NEEDS libfabric.so.1 (readelf) and the loader resolves it to the EFA copy (ldd).
links_efa() {
    local plugin="$1" needed resolved
    needed="$(readelf -d "$plugin" | grep -o 'Shared library: \[libfabric[^]]*\]' || true)"
    if [[ "$needed" != *"[libfabric.so.1]"* ]]; then
        log "$(basename "$plugin") does not need libfabric.so.1 (${needed:-no libfabric at all}): bundled or static"
        return 1
    fi
    resolved="$(LD_LIBRARY_PATH="$efa_lib" ldd "$plugin" 2>&1 | grep 'libfabric' || true)"
    if [[ "$resolved" == *"not found"* || "$resolved" != *"=> $efa_lib/libfabric.so"* ]]; then
        log "$(basename "$plugin") resolves libfabric elsewhere: ${resolved:-nothing}"
        return 1
    fi
    return 0
}

site_packages() {
    "$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'
}

find_plugin() {
    [[ -d "$1" ]] || return 0
    find "$1" -name 'libplugin_LIBFABRIC*.so' -print | sort | head -n 1
}

write_env() {
    local plugin_dir="$1" tmp
    tmp="$(mktemp)"
    printf '# written by the turnkv AMI (step 20-nixl)\nNIXL_PLUGIN_DIR=%s\nLD_LIBRARY_PATH=%s\n' \
        "${plugin_dir#"$R"}" "$prefix/lib" >"$tmp"
    install_file "$tmp" "$ETC_DIR/nixl.env"
    rm -f "$tmp"
}

verify() {
    local plugin_dir plugin
    [[ -f "$ETC_DIR/nixl.env" ]] || die "$ETC_DIR/nixl.env is missing"
    plugin_dir="$R$(sed -n 's/^NIXL_PLUGIN_DIR=//p' "$ETC_DIR/nixl.env")"
    plugin="$(find_plugin "$plugin_dir")"
    [[ -n "$plugin" ]] || die "no LIBFABRIC plugin in ${plugin_dir#"$R"}"
    links_efa "$plugin" || die "the NIXL LIBFABRIC plugin ${plugin#"$R"} does not link $prefix/lib/libfabric.so.1"
    [[ "$("$VENV/bin/pip" show nixl 2>/dev/null | sed -n 's/^Version: *//p')" == "$version" ]] ||
        die "nixl $version is not what the venv has"
}

if [[ "${1:-}" == "--verify" ]]; then verify; exit 0; fi

if ! done_with nixl-wheel "$version"; then
    # --no-deps: nixl's dependencies (torch, numpy, the other CUDA variant) come with vLLM's own torch in the
    # next step, which pins nixl==$version again; resolving them here would download a second torch.
    log "installing nixl==$version $TURNKV_NIXL_CUDA_PACKAGE==$version"
    "$VENV/bin/pip" install --no-cache-dir --no-deps "nixl==$version" "$TURNKV_NIXL_CUDA_PACKAGE==$version"
    record nixl-wheel "$version"
fi

# nixl imports the variant that matches the CUDA it detects (nixl_cu13 for CUDA 13): check that one's plugin,
# not another variant's that pip may also have installed.
wheel_plugin="$(find_plugin "$(site_packages)/${TURNKV_NIXL_CUDA_PACKAGE//-/_}.libs")"
if [[ -n "$wheel_plugin" ]] && links_efa "$wheel_plugin"; then
    log "the wheel's LIBFABRIC plugin links the EFA libfabric: using it"
    write_env "$(dirname "$wheel_plugin")"
    record nixl-plugin "wheel $version"
else
    log "the wheel's LIBFABRIC plugin is ${wheel_plugin:+unusable}${wheel_plugin:-missing}: building NIXL $TURNKV_NIXL_GIT_TAG"
    if ! done_with nixl-source "$TURNKV_NIXL_GIT_TAG $prefix"; then
        src="$WORK_DIR/nixl-src"
        rm -rf "$src"
        git clone --depth 1 --branch "$TURNKV_NIXL_GIT_TAG" "$git_url" "$src"
        meson setup "$src/build" "$src" --prefix="$source_prefix" --buildtype=release \
            -Dlibfabric_path="$prefix" -Dinstall_headers=false
        ninja -C "$src/build" install
        record nixl-source "$TURNKV_NIXL_GIT_TAG $prefix"
    fi
    built_plugin="$(find_plugin "$source_prefix")"
    [[ -n "$built_plugin" ]] || die "the NIXL build at ${source_prefix#"$R"} produced no libplugin_LIBFABRIC.so"
    links_efa "$built_plugin" ||
        die "the NIXL LIBFABRIC plugin built from source does not link $prefix/lib/libfabric.so.1: check meson's libfabric_path"
    write_env "$(dirname "$built_plugin")"
    record nixl-plugin "source $TURNKV_NIXL_GIT_TAG"
fi
verify
log "ok: nixl $version, LIBFABRIC plugin linked to $prefix/lib/libfabric.so.1"
