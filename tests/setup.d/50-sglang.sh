#!/usr/bin/env bash
# The real sglang (pinned) for tests/integrations/test_sglang_live*.py and test_storage_keys.py:
# built once per user into a cache and reused by every checkout, then .venv-sglang in this
# checkout (a few MB) layered on it.
#
# Why a separate environment: sglang 0.5.23 hard-imports torchvision, and PyPI's torchvision
# wheels are CUDA builds whose ops do not load into the CPU torch 2.13.0 of the main
# environment ("operator torchvision::nms does not exist").  torch 2.14.1 (the version
# sglang pins; a CUDA build on local disk, ~5.5 GB) + torchvision 0.29.1 import fine on a
# CPU-only machine.
#
# sglang goes in with --no-deps: its full dependency list pulls GPU kernels and dozens of
# serving packages.  SGLANG_DEPS is what importing
#   sglang.srt.mem_cache.deepseek_v4_memory_pool and
#   sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler
# really needs (found by importing until nothing was missing), plus the Mooncake wheel
# (check --sglang-storage mooncake calls sglang's own Mooncake key builder) and the tests' tools.
#
# The cache: $STAGECACHE_TEST_CACHE, else ${XDG_CACHE_HOME:-~/.cache}/stagecache-test, 0700 and
# ours (a directory another user made or can write is refused, a symlink is never followed), in
# a parent of ours or a sticky-bit one such as /tmp.
# One subdirectory per set of pins (sglang-<hash of pins, stagecache's dependencies and the
# Python>): a new pin builds a new one, an unchanged one is reused as is.  A build is complete
# when its .complete stamp exists (written last); a half-built one is removed and built again.
# Two checkouts building at once wait on one lock.  ~6 GB; remove the directory to free it.
#
# .venv-sglang (in the checkout): a venv whose site-packages adds the cached one
# (site.addsitedir in a .pth file) and holds this checkout's stagecache, editable, no deps.
#
# tests/run.sh runs this step alongside the suite (the marker below); the tests that use
# .venv-sglang wait for it (tests/support/sglang_env.py).
# set-up: background
set -euo pipefail
cd "$(dirname "$0")/../.."
. tests/setup.d/progress.bash
# --check-only: check (and make) the cache folder as below, then exit: 0 usable, 2 refused
CHECK_ONLY=0
[ "${1:-}" = --check-only ] && CHECK_ONLY=1

PY=${PYTHON:-python3}
VENV=.venv-sglang
SGLANG_VERSION=0.5.23
PREVIOUS_VERSION=0.5.22  # the release before, tested too (an overlay, below)
TORCH_VERSION=2.14.1
SGLANG_DEPS=(
    "torchvision==0.29.1" "transformers==5.19.0" "compressed-tensors==0.18.0"
    "apache-tvm-ffi==0.1.11" "sentencepiece==0.2.1"
    psutil pybase64 pillow msgspec pyzmq tqdm aiohttp dill gguf
    # what sglang imports at module level (starlette comes with fastapi), and the live tests' tools
    orjson ipython starlette pytest pytest-timeout hypothesis setuptools wheel
    "mooncake-transfer-engine-non-cuda==0.3.13.post1"
    # sglang's distributed-state and metrics-reporter import paths (the deployment tests): openai pinned
    # as sglang 0.5.23 pins it
    "openai==2.8.0" partial_json_parser einops
)
# stagecache's own runtime dependencies (pyproject.toml), installed into the cache (the
# checkout's package itself goes into .venv-sglang without them).
mapfile -t OWN_DEPS < <($PY -c '
import tomllib
for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    print(d)')
PY_ID=$($PY -c 'import sys; print(sys.version.split()[0], sys.base_prefix)')
WANT="sglang==$SGLANG_VERSION torch==$TORCH_VERSION ${SGLANG_DEPS[*]} ${OWN_DEPS[*]} python $PY_ID"
KEY=$(printf '%s' "$WANT" | sha256sum | cut -c1-16)

CACHE=${STAGECACHE_TEST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/stagecache-test}
no_symlink() {
    [ -L "$1" ] && { echo "$1 is a symlink: refusing it (set STAGECACHE_TEST_CACHE)" >&2; exit 2; }
    return 0
}
# The cache's parent: created 0700 if missing; ours and written by nobody else (700, 711, 750,
# 755), or a sticky-bit folder of root's or ours (/tmp, 1777): there nobody else can remove or
# rename the folder of ours inside it, so it stays as private as that folder's own mode says.
private_parent() {
    no_symlink "$1"
    mkdir -p -m 0700 "$1"
    local owner mode
    owner=$(stat -c %u "$1") mode=$(stat -c %a "$1")
    if (( 8#$mode & 8#1000 )) && { [ "$owner" = 0 ] || [ "$owner" = "$(id -u)" ]; }; then
        return 0
    fi
    if [ "$owner" != "$(id -u)" ] || ! [[ " 700 711 750 755 " == *" $mode "* ]]; then
        echo "$1 is owned by uid $owner with mode $mode, expected uid $(id -u) and mode 700, 711, 750" \
             "or 755, or a sticky-bit folder of root's or yours (such as /tmp, 1777): remove it or set" \
             "STAGECACHE_TEST_CACHE to a directory of yours" >&2
        exit 2
    fi
}
# The cache itself: created 0700 if missing; ours, 0700, not a symlink.
private_cache() {
    no_symlink "$1"
    mkdir -p -m 0700 "$1"
    no_symlink "$1"  # not swapped for one while it was made
    local owner mode
    owner=$(stat -c %u "$1") mode=$(stat -c %a "$1")
    if [ "$owner" != "$(id -u)" ] || [ "$mode" != 700 ]; then
        echo "$1 is owned by uid $owner with mode $mode, expected uid $(id -u) and mode 700:" \
             "remove it or set STAGECACHE_TEST_CACHE to a directory of yours" >&2
        exit 2
    fi
}
private_parent "$(dirname "$CACHE")"
private_cache "$CACHE"
if [ "$CHECK_ONLY" = 1 ]; then
    echo "$CACHE: a private cache folder"
    exit 0
fi
BASE="$CACHE/sglang-$KEY"

build_base() {
    local start=$SECONDS
    rm -rf "$BASE"
    echo "building the sglang environment (once per user, reused): $BASE"
    $PY -m venv "$BASE"
    # pip, minus the noise: "sglang requires X, which is not installed" is --no-deps by design.
    pip_base() {
        "$BASE/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1 \
            | { grep -v -e 'WARNING: Location' -e ' requires ' -e 'dependency resolver' || true; }
    }
    with_progress "torch $TORCH_VERSION (~5.5 GB)" pip_base "torch==$TORCH_VERSION"
    with_progress "sglang $SGLANG_VERSION" pip_base --no-deps "sglang==$SGLANG_VERSION"
    with_progress "sglang's imports and stagecache's dependencies" \
        pip_base "torch==$TORCH_VERSION" "${SGLANG_DEPS[@]}" "${OWN_DEPS[@]}"
    du -sh "$BASE" | cut -f1 > "$BASE/.size"
    echo "$WANT" > "$BASE/.complete"
    echo "built the sglang environment in $(( SECONDS - start )) s: $(cat "$BASE/.size")"
}

exec 9>"$CACHE/.lock"
with_progress "waiting for another build of the sglang environment" flock 9
if [ -f "$BASE/.complete" ] && [ "$(cat "$BASE/.complete")" = "$WANT" ]; then
    echo "sglang environment: reusing $BASE ($(cat "$BASE/.size" 2>/dev/null))"
else
    build_base
fi
flock -u 9

# The checkout's layer: the cached site-packages, then this checkout's stagecache (editable).
SITE=$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$VENV/.stagecache-base" 2>/dev/null)" != "$BASE" ]; then
    rm -rf "$VENV"
    $PY -m venv --without-pip "$VENV"
fi
VSITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('$SITE')" > "$VSITE/stagecache-sglang-base.pth"
echo "$BASE" > "$VENV/.stagecache-base"
# The cache's pip (the venv has none of its own); setuptools comes from the cache too.
with_progress "stagecache (editable) into $VENV" \
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
    --no-build-isolation -e . 2>&1 | { grep -v -e 'WARNING: Location' || true; }
# Fails the set-up (set -e) if any import the tests need is missing.
"$VENV/bin/python" -W ignore -c "
import sglang.srt.mem_cache.deepseek_v4_memory_pool
import sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler
import stagecache.runtime.integrations.sglang, os, stagecache.runtime
assert os.path.realpath(stagecache.runtime.__path__[0]) == os.path.realpath('runtime'), stagecache.runtime.__path__
"
echo "$VENV is ready (on $BASE)"

# The release before: sglang $PREVIOUS_VERSION --no-deps over the same environment (its own
# site directory in the cache, ahead of the base's on sys.path), in $VENV-$PREVIOUS_VERSION: the
# live suites run on both releases (tests/integrations/test_sglang_venv.py).
OVERLAY="$CACHE/sglang-$KEY-$PREVIOUS_VERSION"
exec 9>"$CACHE/.lock"
flock 9
if [ ! -f "$OVERLAY/.complete" ]; then
    rm -rf "$OVERLAY"
    with_progress "sglang $PREVIOUS_VERSION (overlay)" "$BASE/bin/python" -m pip install -q \
        --disable-pip-version-check --no-deps --ignore-installed --target "$OVERLAY/site" \
        "sglang==$PREVIOUS_VERSION" 2>&1 | { grep -v -e 'WARNING: Location' || true; }
    touch "$OVERLAY/.complete"
fi
flock -u 9
PREV_VENV="$VENV-$PREVIOUS_VERSION"
if [ ! -x "$PREV_VENV/bin/python" ] || [ "$(cat "$PREV_VENV/.stagecache-base" 2>/dev/null)" != "$OVERLAY" ]; then
    rm -rf "$PREV_VENV"
    $PY -m venv --without-pip "$PREV_VENV"
fi
PSITE=$("$PREV_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
printf "import site; site.addsitedir('%s')\nimport site; site.addsitedir('%s')\n" "$OVERLAY/site" "$SITE" \
    > "$PSITE/stagecache-sglang-base.pth"
echo "$OVERLAY" > "$PREV_VENV/.stagecache-base"
"$PREV_VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . \
    2>&1 | { grep -v -e 'WARNING: Location' || true; }
"$PREV_VENV/bin/python" -W ignore -c "
import sglang
assert sglang.__version__ == '$PREVIOUS_VERSION', sglang.__version__
import stagecache.runtime.integrations.sglang
"
echo "$PREV_VENV is ready (sglang $PREVIOUS_VERSION over $BASE)"
