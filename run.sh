#!/usr/bin/env bash
# homagg's one entry point: installs what the project needs, then runs the main job or the tests.
#
#   ./run.sh demo [args]   the main job (see README)
#   ./run.sh test [args]   ruff, mypy and the test suite (what CI runs); extra args go to pytest
#   ./run.sh quick [args]  ruff, mypy and the quick tier (no slow, bmv2 or Mininet tests), its
#                          tests on HOMAGG_TEST_WORKERS (default 4) workers where it can
#   ./run.sh setup         only the installation steps
#
# Installs: Debian packages (Mininet and friends; only as root, only when missing) and a venv in
# .venv (HOMAGG_VENV to move it) made from /usr/bin/python3 with system site packages, because
# Debian's Mininet lives there. bmv2 and p4c are never installed here: see README, "bmv2 and p4c".
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$PWD
VENV=${HOMAGG_VENV:-$ROOT/.venv}
PY=${HOMAGG_PYTHON:-/usr/bin/python3}
# gcc and libc6-dev: the native data path (homagg/native), built with the package
APT_PACKAGES=(mininet bridge-utils iputils-ping iproute2 ethtool python3-venv gcc libc6-dev)

log() { printf '[run.sh] %s\n' "$*" >&2; }

setup_system() {
    local missing=()
    for p in "${APT_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        log "not root or no apt-get: skipping Debian packages ${missing[*]} (Mininet tests will skip)"
        return 0
    fi
    log "installing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=600 update -qq
    apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

setup_venv() {
    if [ ! -x "$VENV/bin/python" ]; then
        [ -x "$PY" ] || PY=$(command -v python3)
        log "creating venv $VENV from $PY"
        "$PY" -m venv --system-site-packages "$VENV"
    fi
    local stamp="$VENV/.homagg-installed"
    if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
        log "installing homagg and its Python dependencies into $VENV"
        "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[controller,test,bench]"
        # the stubs' generator, for their currency test, in its own directory: it declares
        # protobuf 4 and p4runtime-shell pins 3.20, so in the venv pip would report a conflict
        # (homagg/membership/__init__.py says how it is run)
        "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --upgrade \
            --target "$VENV/protogen" "grpcio-tools==1.49.1" \
            || log "grpcio-tools not installed: the stubs' test will skip"
        touch "$stamp"
    fi
    build_native
    # numba's kernels, compiled now rather than inside the first run's rounds (a no-op, a few
    # hundred milliseconds, once they are in numba's cache beside the sources)
    "$VENV/bin/python" -c 'import sys; from homagg.host_agent.warm import main; sys.exit(main())'
    # torch is optional (the DDP hook and its test). Install it only from a CPU wheel already on
    # this machine's disk: from PyPI, plain torch is a CUDA build of several GB.
    if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
        local whl
        whl=$(ls /opt/wheels/torch-*+cpu-cp3*.whl 2>/dev/null | head -n 1 || true)
        if [ -n "$whl" ]; then
            log "installing torch (CPU) from $whl"
            "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$whl"
        else
            log "no local CPU torch wheel: the DDP hook test will skip"
        fi
    fi
}

# The native data path (homagg/native, setup.py): pip builds it with the package; this builds
# it again whenever its sources are newer than the library (an editable install does not).
# Without a compiler, or if the build fails, homagg runs its Python engines and says so.
build_native() {
    local so newer
    so=$(ls homagg/native/_homagg_native*.so 2>/dev/null | head -n 1 || true)
    if [ -n "$so" ]; then
        newer=$(find setup.py homagg/native -newer "$so" \( -name '*.c' -o -name '*.h' \
                -o -name setup.py \) 2>/dev/null | head -n 1)
        [ -z "$newer" ] && return 0
    fi
    if ! command -v cc >/dev/null; then
        log "no C compiler: the native data path is not built (the Python engines run)"
        return 0
    fi
    log "building the native data path (homagg/native)"
    rm -f homagg/native/_homagg_native*.so  # (a failed build must not leave the old one in use)
    local out
    if ! out=$("$VENV/bin/python" setup.py -q build_ext --inplace 2>&1); then
        printf '%s\n' "$out" >&2
        log "the native build failed: the Python engines run"
    elif [ -z "$(ls homagg/native/_homagg_native*.so 2>/dev/null)" ]; then
        printf '%s\n' "$out" >&2
        log "the native library was not built (see above): the Python engines run"
    fi
}

setup() { setup_system; setup_venv; }

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
    setup) setup ;;
    test)
        setup
        # Lint and types first (seconds), then the suite; any failure fails the command.
        log "ruff check"
        "$VENV/bin/python" -m ruff check .
        log "mypy (config in pyproject.toml)"
        "$VENV/bin/python" -m mypy
        set +e
        "$VENV/bin/python" -m pytest "$@"
        rc=$?
        set -e
        # pytest's 5 means "no tests collected": not a failure of the project.
        [ $rc -eq 5 ] && { log "pytest collected no tests"; rc=0; }
        exit $rc
        ;;
    quick)
        setup
        log "ruff check"
        "$VENV/bin/python" -m ruff check .
        log "mypy (config in pyproject.toml)"
        "$VENV/bin/python" -m mypy
        tier=(-m "not slow and not bmv2 and not mininet")
        # Parallel workers, each in a network namespace of its own (tools/isolated-python):
        # the tests wait on timers far more than they compute, and bind fixed loopback
        # addresses. Without root, unshare or pytest-xdist: one process, as ./run.sh test.
        workers=${HOMAGG_TEST_WORKERS:-4}
        if [ "$workers" -gt 1 ] && "$VENV/bin/python" -c "import xdist" 2>/dev/null \
                && unshare --net true 2>/dev/null && command -v ip >/dev/null; then
            export HOMAGG_ISOLATED_PYTHON="$VENV/bin/python"
            tier+=(--tx "$workers*popen//python=$ROOT/tools/isolated-python" --dist load)
            log "quick tier on $workers workers, each in a network namespace of its own"
        else
            log "quick tier in one process (parallel workers need root, unshare and pytest-xdist)"
        fi
        set +e
        "$VENV/bin/python" -m pytest "${tier[@]}" "$@"
        rc=$?
        set -e
        [ $rc -eq 5 ] && { log "pytest collected no tests"; rc=0; }
        exit $rc
        ;;
    demo)
        setup
        # Mininet demo: 4 workers train through bmv2 where installed, else the software
        # aggregator (it says which); every aggregate is checked bit for bit.
        exec "$VENV/bin/python" -m homagg.launcher demo "$@"
        ;;
    *)
        echo "usage: ./run.sh {demo|test|quick|setup} [args]" >&2
        exit 2
        ;;
esac
