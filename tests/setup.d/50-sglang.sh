#!/usr/bin/env bash
# Build .venv-sglang: the real sglang (pinned) for tests/integrations/test_sglang_live.py.
#
# Why a separate venv: sglang 0.5.23 hard-imports torchvision, and PyPI's torchvision
# wheels are CUDA builds whose ops do not load into the CPU torch 2.13.0 of the main
# environment ("operator torchvision::nms does not exist").  torch 2.14.1 (the version
# sglang pins; a CUDA build on local disk, ~5.5 GB) + torchvision 0.29.1 import fine on a
# CPU-only machine.  The venv is self-contained: it installs its own test tools and
# stagecache's own dependencies, so it works the same whether the suite runs from the
# system Python or from a fresh virtualenv.
#
# sglang goes in with --no-deps: its full dependency list pulls GPU kernels and dozens of
# serving packages.  SGLANG_DEPS is what importing
#   sglang.srt.mem_cache.deepseek_v4_memory_pool and
#   sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler
# really needs (found by importing until nothing was missing).  Idempotent: a stamp file
# records the pins; a second run with the same pins does nothing.
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV=.venv-sglang
SGLANG_VERSION=0.5.23
TORCH_VERSION=2.14.1
SGLANG_DEPS=(
    "torchvision==0.29.1" "transformers==5.19.0" "compressed-tensors==0.18.0"
    "apache-tvm-ffi==0.1.11" "sentencepiece==0.2.1"
    psutil pybase64 pillow msgspec pyzmq tqdm aiohttp dill gguf
    # what sglang imports at module level (starlette comes with fastapi), and the live tests' tools
    orjson ipython starlette pytest pytest-timeout hypothesis
    # sglang's distributed-state and metrics-reporter import paths (the deployment tests): openai pinned
    # as sglang 0.5.23 pins it
    "openai==2.8.0" partial_json_parser einops
)
STAMP="$VENV/.stagecache-pins"
WANT="sglang==$SGLANG_VERSION torch==$TORCH_VERSION ${SGLANG_DEPS[*]}"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && "$VENV/bin/python" -c \
    "import sglang.srt.mem_cache.deepseek_v4_memory_pool" >/dev/null 2>&1; then
    # Only stagecache itself may have changed (entry points, package folders).
    # stagecache itself and its own dependencies (torch is already satisfied by the pin above)
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e . 2>&1 \
        | { grep -v -e 'WARNING: Location' || true; }
    echo "$VENV is up to date ($WANT)"
    exit 0
fi

start=$(date +%s)
PY=${PYTHON:-python3}
rm -rf "$VENV"
$PY -m venv "$VENV"
# pip, minus the noise: "sglang requires X, which is not installed" is --no-deps by design.
pip_install() {
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1 \
        | { grep -v -e 'WARNING: Location' -e ' requires ' -e 'dependency resolver' || true; }
}
pip_install "torch==$TORCH_VERSION"
pip_install --no-deps "sglang==$SGLANG_VERSION"
pip_install "torch==$TORCH_VERSION" "${SGLANG_DEPS[@]}"
pip_install -e .  # with stagecache's own dependencies; torch is already satisfied
# Fails the set-up (set -e) if any import the tests need is still missing.
"$VENV/bin/python" -W ignore -c "
import sglang.srt.mem_cache.deepseek_v4_memory_pool
import sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler
import stagecache.runtime.integrations.sglang
"
echo "$WANT" > "$STAMP"
echo "built $VENV in $(( $(date +%s) - start )) s"
