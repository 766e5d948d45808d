#!/usr/bin/env bash
# The Mooncake Store L3 backend for its tests (tests/storage, tests/serve/test_serve_l3.py,
# bench l3): the Debian package libibverbs1 that the wheel's libraries link against, then the
# wheel itself (stagecache[l3]) in the test environment (.venv-sglang gets it from
# tests/setup.d/50-sglang.sh, with its other pins).  Idempotent: each step is skipped when its
# import already works.  Tests that need Mooncake skip with a one-line
# reason where it cannot load.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
WHEEL="mooncake-transfer-engine-non-cuda==0.3.13.post1"

if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1'; then
    if [ "$(id -u)" = 0 ]; then
        echo "installing libibverbs1 (Debian)"
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libibverbs1 >/dev/null
    else
        echo "not root: cannot install libibverbs1; the Mooncake tests will skip" >&2
    fi
fi

install_into() {  # $1: a python; installs the wheel unless mooncake.store already imports there
    if "$1" -c "import mooncake.store" >/dev/null 2>&1; then
        echo "mooncake: already importable by $1"
        return
    fi
    echo "installing $WHEEL into $1"
    "$1" -m pip install -q --disable-pip-version-check "$WHEEL" 2>&1 \
        | { grep -v -e 'WARNING: Location' -e ' requires ' -e 'dependency resolver' || true; }
    "$1" -c "import mooncake.store" || echo "mooncake still does not import by $1; its tests will skip" >&2
}

install_into "$PY"
