"""Stub commands for baking an image into a fake root (tests only).

Every stub appends one line, ``<name> <args>``, to ``$STUB_LOG``, so a test can read the order of steps.
Real commands that are safe (sha256sum, tar) are wrapped: they log and then run the real binary.
The stubs act on ``$TURNKV_ROOT`` only. Knobs, all environment variables:
  FAKE_EFA_DEVICE=1|0          whether `fi_info -p efa` finds a device
  FAKE_EFA_DEVICE_AFTER=N      the device appears on the N-th `fi_info -p efa` call (late EFA on p5en)
  FAKE_NIXL_WHEEL_PLUGIN=efa|bundled|none   what the nixl wheel's LIBFABRIC plugin links
  FAKE_NIXL_BUILT_PLUGIN=efa|distro         what a NIXL source build's plugin links
  FAKE_SIGNING_DIR=DIR         where curl finds *.sig / *.key / *.gpg downloads (none: they are unreachable)
  FAKE_LIBCUDA=1|0             whether the image already has libcuda.so.1 (the Neuron bake links a stub if not)
  FAKE_LIBCUDART=1|0           whether the image already has libcudart.so.13 (the Neuron bake links it if not)
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

HEADER = '#!/usr/bin/env bash\nset -euo pipefail\nprintf \'%s\\n\' "$(basename "$0") $*" >>"$STUB_LOG"\n'

STUBS: dict[str, str] = {
    "apt-get": "",
    "sleep": "",
    "meson": "",
    "curl": r'''
out=""; url=""
while (($#)); do case "$1" in -o) out="$2"; shift 2;; -*) shift;; *) url="$1"; shift;; esac; done
[[ -z "${FAKE_CURL_FAIL:-}" ]] || exit 22
case "$url" in
  *aws-efa-installer-*.tar.gz) cp "$FAKE_EFA_TARBALL" "$out";;
  *amazon-cloudwatch-agent.deb) v="${url%/amazon-cloudwatch-agent.deb}"; printf 'fake-deb %s\n' "${v##*/}" >"$out";;
  */cuda-keyring_*_all.deb) printf 'fake-keyring\n' >"$out";;
  *.sig|*.key|*.gpg)  # signatures and signing keys: served from FAKE_SIGNING_DIR when a test provides them
    [[ -n "${FAKE_SIGNING_DIR:-}" && -f "$FAKE_SIGNING_DIR/${url##*/}" ]] || exit 22
    cp "$FAKE_SIGNING_DIR/${url##*/}" "$out";;
  *) echo "curl stub: unexpected URL $url" >&2; exit 22;;
esac
''',
    "python3": r'''
if [[ "${1:-}" == "-m" && "${2:-}" == "venv" ]]; then
  venv="$3"; mkdir -p "$venv/bin" "$venv/lib/python3.12/site-packages"
  cp "$STUB_DIR/venv-python" "$venv/bin/python"; cp "$STUB_DIR/venv-pip" "$venv/bin/pip"
  exit 0
fi
exec "$REAL_PYTHON" "$@"
''',
    "venv-python": r'''
venv="$(cd "$(dirname "$0")/.." && pwd)"
case "$*" in
  *sysconfig*) echo "$venv/lib/python3.12/site-packages";;
  "-m turnkv.versions"*) PYTHONPATH="$TURNKV_REPO" exec "$REAL_PYTHON" "$@";;
  # Step 31's load check of NIXL's plugins: the LIBFABRIC one links libcudart.so.13 (NIXL 1.5.1, readelf).
  "-c "*"import ctypes"*)
    if [[ "${FAKE_LIBCUDART:-0}" != 1 && ! -L "$TURNKV_ROOT/usr/local/lib/libcudart.so.13" ]]; then
      echo "libcudart.so.13: cannot open shared object file: No such file or directory"; exit 1
    fi
    echo "1 NIXL plugins load";;
  *) echo "venv-python stub: unexpected $*" >&2; exit 2;;
esac
''',
    "venv-pip": r'''
venv="$(cd "$(dirname "$0")/.." && pwd)"; db="$venv/.fake-pip"; site="$venv/lib/python3.12/site-packages"
mkdir -p "$db"
plugin() {  # plugin FILE LINK
  mkdir -p "$(dirname "$1")"; printf 'LINK=%s\n' "$2" >"$1"
}
case "$1" in
  show) [[ -f "$db/$2" ]] || exit 1; printf 'Name: %s\nVersion: %s\n' "$2" "$(<"$db/$2")";;
  install)
    shift
    deps=1; for arg in "$@"; do [[ "$arg" == --no-deps ]] && deps=0; done
    for arg in "$@"; do
      case "$arg" in
        -*|https://*) ;;
        *.whl) name="$(basename "$arg")"; rest="${name#turnkv-}"; echo "${rest%%-*}" >"$db/turnkv"
               printf '#!/usr/bin/env bash\nprintf "%%s\\n" "turnkv $*" >>"$STUB_LOG"\n' >"$venv/bin/turnkv"
               chmod +x "$venv/bin/turnkv";;
        # Tag v<release>; what vllm-neuron itself requires of vLLM is left to the vllm==... argument.
        "vllm-neuron @ git+"*) tag="${arg##*@}"; echo "${tag#v}" >"$db/vllm-neuron";;
        *==*) echo "${arg##*==}" >"$db/${arg%%==*}"
              pkg="${arg%%==*}"
              if [[ "$pkg" == nixl-cu* && "${FAKE_NIXL_WHEEL_PLUGIN:-efa}" != none ]]; then
                plugin "$site/${pkg//-/_}.libs/nixl/libplugin_LIBFABRIC.so" "${FAKE_NIXL_WHEEL_PLUGIN:-efa}"
              fi
              # The nixl meta package requires both CUDA variants; the other one's plugin links a distro
              # libfabric here, so a step that looks at the wrong variant is caught.
              if [[ "$pkg" == nixl && "$deps" == 1 && ! -f "$db/nixl-cu12" ]]; then
                echo "${arg##*==}" >"$db/nixl-cu12"
                plugin "$site/nixl_cu12.libs/nixl/libplugin_LIBFABRIC.so" distro
              fi;;
        *) echo "pip stub: unexpected $arg" >&2; exit 2;;
      esac
    done;;
  *) echo "pip stub: unexpected $*" >&2; exit 2;;
esac
''',
    "readelf": r'''
file="${*: -1}"
case "$(<"$file")" in
  LINK=bundled) echo ' 0x0000000000000001 (NEEDED)             Shared library: [libfabric-7c1f3a2b.so.1.27.0]';;
  *) echo ' 0x0000000000000001 (NEEDED)             Shared library: [libfabric.so.1]';;
esac
echo ' 0x0000000000000001 (NEEDED)             Shared library: [libstdc++.so.6]'
''',
    "ldd": r'''
file="$1"
case "$(<"$file")" in
  LINK=efa) echo "	libfabric.so.1 => ${LD_LIBRARY_PATH%%:*}/libfabric.so.1 (0x00007f0000000000)";;
  LINK=distro) echo "	libfabric.so.1 => /usr/lib/x86_64-linux-gnu/libfabric.so.1 (0x00007f0000000000)";;
  LINK=bundled) echo "	libfabric-7c1f3a2b.so.1.27.0 => $(dirname "$file")/../libfabric-7c1f3a2b.so.1.27.0 (0x1)";;
esac
echo "	libstdc++.so.6 => /lib/x86_64-linux-gnu/libstdc++.so.6 (0x00007f0000100000)"
''',
    "git": r'''
[[ "$1" == clone ]] || { echo "git stub: unexpected $*" >&2; exit 2; }
mkdir -p "${*: -1}"
''',
    "ninja": r'''
mkdir -p "$TURNKV_ROOT/opt/turnkv/nixl/lib/x86_64-linux-gnu/plugins"
printf 'LINK=%s\n' "${FAKE_NIXL_BUILT_PLUGIN:-efa}" \
  >"$TURNKV_ROOT/opt/turnkv/nixl/lib/x86_64-linux-gnu/plugins/libplugin_LIBFABRIC.so"
''',
    # The loader cache: libcuda.so.1 is there when the image ships it (FAKE_LIBCUDA=1) or a step linked the stub.
    "ldconfig": r'''
[[ "${1:-}" == -p ]] || exit 0
if [[ "${FAKE_LIBCUDA:-0}" == 1 || -L "$TURNKV_ROOT/usr/local/lib/libcuda.so.1" ]]; then
  printf '\tlibcuda.so.1 (libc6,x86-64) => /usr/local/lib/libcuda.so.1\n'
fi
if [[ "${FAKE_LIBCUDART:-0}" == 1 || -L "$TURNKV_ROOT/usr/local/lib/libcudart.so.13" ]]; then
  printf '\tlibcudart.so.13 (libc6,x86-64) => /usr/local/lib/libcudart.so.13\n'
fi
''',
    "aws": r'''
[[ "$1 $2" == "s3 cp" ]] || { echo "aws stub: unexpected $*" >&2; exit 2; }
printf 'fake wheel from %s\n' "${*: -2:1}" >"${*: -1}"
''',
    "dpkg": r'''
root="/"; deb=""
for a in "$@"; do case "$a" in --root=*) root="${a#--root=}";; *.deb) deb="$a";; esac; done
[[ "$deb" == *cuda-keyring.deb ]] && exit 0  # NVIDIA's repository keyring: nothing to record
mkdir -p "$root/var/lib/dpkg/turnkv-fake"
read -r _ version <"$deb"
echo "$version-1" >"$root/var/lib/dpkg/turnkv-fake/amazon-cloudwatch-agent"
mkdir -p "$root/opt/aws/amazon-cloudwatch-agent/bin"
''',
    "dpkg-query": r'''
admin=""; for a in "$@"; do case "$a" in --admindir=*) admin="${a#--admindir=}";; esac; done
f="$admin/turnkv-fake/${*: -1}"
[[ -f "$f" ]] || exit 1
printf '%s' "$(<"$f")"
''',
    "systemctl": r'''
root="/"; unit="${*: -1}"
for a in "$@"; do case "$a" in --root=*) root="${a#--root=}";; esac; done
mkdir -p "$root/etc/systemd/system/timers.target.wants"
ln -sfn "/etc/systemd/system/$unit" "$root/etc/systemd/system/timers.target.wants/$unit"
''',
}

#: Real binaries wrapped so their calls are logged.
PASSTHROUGH = ("sha256sum", "tar")

#: The fake EFA installer (inside the fake tarball): what efa_installer.sh leaves on a root.
EFA_INSTALLER = r'''#!/usr/bin/env bash
set -euo pipefail
printf '%s\n' "efa_installer.sh $*" >>"$STUB_LOG"
r="${TURNKV_ROOT%/}"
mkdir -p "$r/opt/amazon/efa/bin" "$r/opt/amazon/efa/lib"
echo "fake libfabric" >"$r/opt/amazon/efa/lib/libfabric.so.1"
printf '# EFA installer version: @VERSION@\n# Debug packages installed: no\nlibfabric-aws\n' \
  >"$r/opt/amazon/efa_installed_packages"
cat >"$r/opt/amazon/efa/bin/fi_info" <<'FI'
#!/usr/bin/env bash
printf '%s\n' "fi_info $*" >>"$STUB_LOG"
if [[ "${1:-}" == --version ]]; then
  printf 'fi_info: @LIBFABRIC@1.0\nlibfabric: @LIBFABRIC@1.0\nlibfabric api: 2.7\n'; exit 0
fi
n=1
if [[ -n "${FAKE_EFA_DEVICE_AFTER:-}" ]]; then
  n=$(( $(cat "$STUB_STATE/fi_info_calls" 2>/dev/null || echo 0) + 1 )); echo "$n" >"$STUB_STATE/fi_info_calls"
fi
if [[ "${FAKE_EFA_DEVICE:-1}" == 1 && "$n" -ge "${FAKE_EFA_DEVICE_AFTER:-1}" ]]; then
  printf 'provider: efa\n    fabric: efa\n    domain: rdmap79s0-rdm\n    version: 203.10\n    type: FI_EP_RDM\n'
  exit 0
fi
echo "fi_getinfo: -61 (No data available)" >&2
exit 61
FI
chmod +x "$r/opt/amazon/efa/bin/fi_info"
'''


def write_stubs(stub_dir: Path) -> None:
    stub_dir.mkdir(parents=True, exist_ok=True)
    for name, body in STUBS.items():
        path = stub_dir / name
        path.write_text(HEADER + body.lstrip("\n"))
        path.chmod(0o755)
    for name in PASSTHROUGH:
        real = shutil.which(name)
        assert real, f"{name} is needed for the bake tests"
        path = stub_dir / name
        path.write_text(HEADER + f'exec {real} "$@"\n')
        path.chmod(0o755)


def fake_cloudwatch_deb(version: str) -> bytes:
    """What the curl stub downloads as the CloudWatch agent .deb of ``version``."""
    return f"fake-deb {version}\n".encode()


def make_efa_tarball(directory: Path, version: str, libfabric: str) -> Path:
    """A tarball laid out like the real one (aws-efa-installer/efa_installer.sh), built with the real tar."""
    import tarfile

    src = directory / "aws-efa-installer"
    src.mkdir(parents=True, exist_ok=True)
    installer = src / "efa_installer.sh"
    installer.write_text(EFA_INSTALLER.replace("@VERSION@", version).replace("@LIBFABRIC@", libfabric))
    installer.chmod(0o755)
    tarball = directory / f"aws-efa-installer-{version}.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(src, arcname="aws-efa-installer")
    return tarball


def base_env(stub_dir: Path, root: Path, work: Path, log: Path, state: Path) -> dict[str, str]:
    import sys

    return {
        "PATH": f"{stub_dir}:/usr/bin:/bin",
        "HOME": str(work),
        "LANG": "C.UTF-8",
        "STUB_DIR": str(stub_dir),
        "STUB_LOG": str(log),
        "STUB_STATE": str(state),
        "REAL_PYTHON": sys.executable,
        "TURNKV_REPO": str(Path(__file__).resolve().parents[2]),
        "TURNKV_ROOT": str(root),
        "TURNKV_WORK_DIR": str(work / "downloads"),
        "TMPDIR": str(work),
        "SYSTEMD_OFFLINE": "1",
        **{k: v for k, v in os.environ.items() if k in {"TERM"}},
    }
