#!/usr/bin/env bash
# Run pmaptap's test suite on each JAX release the package declares tested
# (pmaptap/_trace/jax_support.py: TESTED), each in a virtual environment of
# its own made with pip; the global site-packages are never touched.
#
#   scripts/test_jax_versions.sh                      # 0.9.2 and 0.10.2, whole suite
#   scripts/test_jax_versions.sh 0.9.2                # one release
#   scripts/test_jax_versions.sh 0.9.2 -- tests/trace # a subset (pytest arguments)
#
# JAX_VENVS (default ${TMPDIR:-/tmp}/pmaptap-jax-venvs) holds the venvs; one
# that exists is reused (its packages updated). The exit status is non-zero
# if any release fails; a line per release says how it went. CI (.ci/run)
# runs the suite on the newest release the extras install; this script is
# how the older ones are kept green (docs/contributing.md#jax-versions).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

versions=()
while [[ $# -gt 0 && "$1" != "--" ]]; do
    versions+=("$1")
    shift
done
[[ "${1:-}" == "--" ]] && shift
pytest_args=("$@")
[[ ${#versions[@]} -eq 0 ]] && versions=(0.9.2 0.10.2)
[[ ${#pytest_args[@]} -eq 0 ]] && pytest_args=(-n 2 -q -p no:cacheprovider tests)

VENVS=${JAX_VENVS:-${TMPDIR:-/tmp}/pmaptap-jax-venvs}
mkdir -p "$VENVS"
PY=${PYTHON:-python3}
status=0
summary=()
for v in "${versions[@]}"; do
    venv="$VENVS/jax-$v"
    echo "=== JAX $v: $venv"
    if [[ ! -x "$venv/bin/python" ]]; then
        "$PY" -m venv "$venv" || { summary+=("JAX $v: could not make the venv"); status=1; continue; }
    fi
    # The package's own pins, test extra included, with this JAX.
    if ! "$venv/bin/python" -m pip install -q -e ".[test]" "jax==$v" "jaxlib==$v"; then
        summary+=("JAX $v: pip could not install it with pmaptap's test extra")
        status=1
        continue
    fi
    got=$("$venv/bin/python" -c "import jax; print(jax.__version__)")
    if [[ "$got" != "$v" ]]; then
        summary+=("JAX $v: the venv has JAX $got")
        status=1
        continue
    fi
    PYTHONPATH="$ROOT" "$venv/bin/python" -m pytest "${pytest_args[@]}"
    rc=$?
    if [[ $rc -eq 0 ]]; then
        summary+=("JAX $v: passed")
    else
        summary+=("JAX $v: FAILED (pytest exit $rc)")
        status=1
    fi
done
echo
printf '%s\n' "${summary[@]}"
exit $status
