#!/usr/bin/env bash
# The test suite on the newest JAX the registry offers, on a Python that JAX
# accepts (>= 3.12), on a machine whose own Python is older: a Debian trixie
# root (Python 3.13) made with debootstrap, this checkout bind-mounted into
# it at /src. Needs root (debootstrap, chroot, mount). CI's second leg
# (.ci/run); docs/contributing.md#jax-versions.
#
#   scripts/newest_jax.sh                       # newest JAX, the README's test command
#   scripts/newest_jax.sh -- tests/trace -x     # pytest arguments instead
#   JAX_SPEC="jax==0.11.2" scripts/newest_jax.sh  # another release
#
# NEWEST_JAX_ROOT (default /var/tmp/pmaptap-trixie) holds the root; one that
# is complete (its marker file exists) is reused, its venv updated. The
# JAX that pip installs first must still be there after
# `pip install -e ".[test]"` (the package's pins admit it), else this fails.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=$(pwd)
ROOT=${NEWEST_JAX_ROOT:-/var/tmp/pmaptap-trixie}
JAX_SPEC=${JAX_SPEC:-jax}
VENV=/opt/venv-$(echo "$JAX_SPEC" | tr -c 'A-Za-z0-9.\n' '_')
[[ "${1:-}" == "--" ]] && shift
if [[ $# -eq 0 ]]; then
    set -- -n 2 -q -p no:cacheprovider
fi

if [[ $(id -u) -ne 0 ]]; then
    echo "scripts/newest_jax.sh: needs root (debootstrap, chroot, mount)" >&2
    exit 2
fi

# The Debian mirror this machine's own apt uses (its deb822 or one-line
# sources), else Debian's default.
mirror() {
    local m
    m=$(grep -hsE '^URIs:.*/debian/?$' /etc/apt/sources.list.d/*.sources | head -1 |
        awk '{print $2}')
    [[ -z "$m" ]] && m=$(grep -hsE '^deb .*/debian/? ' /etc/apt/sources.list \
        /etc/apt/sources.list.d/*.list | head -1 | awk '{print $2}')
    echo "${m:-http://deb.debian.org/debian}"
}

if [[ ! -e "$ROOT/.pmaptap-root-complete" ]]; then
    if ! command -v debootstrap > /dev/null; then
        apt-get update -q > /dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap > /dev/null
    fi
    rm -rf "$ROOT"
    echo "=== debootstrap trixie into $ROOT from $(mirror)"
    debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
        trixie "$ROOT" "$(mirror)" > "$ROOT.log" 2>&1 ||
        { tail -20 "$ROOT.log" >&2; exit 1; }
    touch "$ROOT/.pmaptap-root-complete"
fi

# What the root needs of this machine: its CA bundle (the registry may sit
# behind a proxy that this machine trusts), name resolution, and its host
# name (gloo, which JAX's CPU collectives use, resolves it).
cp /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/host-ca.crt"
cp /etc/hosts /etc/resolv.conf "$ROOT/etc/"
mkdir -p "$ROOT/src"

mounted=()
cleanup() {
    local i
    for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do
        umount -l "${mounted[$i]}" 2> /dev/null || true
    done
}
trap cleanup EXIT
bind() {  # bind DIR: the machine's DIR at the same place in the root
    mkdir -p "$ROOT$2"
    mount --bind "$1" "$ROOT$2"
    mounted+=("$ROOT$2")
}
bind "$SRC" /src
bind /dev /dev
bind /dev/pts /dev/pts
bind /dev/shm /dev/shm
mount -t proc proc "$ROOT/proc"
mounted+=("$ROOT/proc")

inside() {
    chroot "$ROOT" env -i PATH="$VENV/bin:/usr/local/bin:/usr/bin:/bin" HOME=/root \
        LANG=C.UTF-8 TMPDIR=/tmp CI="${CI:-}" PIP_CERT=/etc/ssl/certs/host-ca.crt \
        PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=180 \
        bash -c 'cd /src && "$@"' bash "$@"
}

inside python3 -m venv "$VENV"
echo "=== pip install -U '$JAX_SPEC' (jaxlib with it), then -e '.[test]'"
inside pip install -q -U "$JAX_SPEC"
want=$(inside python -c "import jax; print(jax.__version__)")
inside pip install -q -e ".[test]"
got=$(inside python -c "import jax, sys; print(jax.__version__)")
py=$(inside python -c "import sys; print(sys.version.split()[0])")
if [[ "$got" != "$want" ]]; then
    echo "scripts/newest_jax.sh: pip install -e .[test] replaced JAX $want by $got" >&2
    exit 1
fi
echo "=== Python $py, JAX $got: python -m pytest $*"
inside python -m pytest "$@"
