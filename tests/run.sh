#!/usr/bin/env bash
# Install everything the test suite needs on a fresh Debian machine, then run it.
# Used as-is by .ci/run and by a newcomer:  bash tests/run.sh [pytest arguments]
#
# Set-up steps are tests/setup.d/*.sh, one per concern, run in name order.  A step marked
# "# set-up: background" (the sglang environment, minutes on a fresh machine) runs alongside
# the rest and the suite; the tests that need it run last and wait for it (bounded), reading
# its exit status from $STAGECACHE_TEST_SETUP_DIR.  pytest runs on $STAGECACHE_TEST_WORKERS
# processes (default 2; 1 runs it in one process).
set -euo pipefail
cd "$(dirname "$0")/.."
. tests/setup.d/progress.bash
started=$SECONDS
PY=${PYTHON:-python3}

STAGECACHE_TEST_SETUP_DIR=$(mktemp -d -t stagecache-setup-XXXXXX)  # 0700
export STAGECACHE_TEST_SETUP_DIR
background=()
stop_background() {  # on any exit: a background step still running is stopped, by its group
    local entry
    for entry in "${background[@]}"; do
        kill -- "-${entry##*:}" 2>/dev/null || true
    done
    rm -rf "$STAGECACHE_TEST_SETUP_DIR"
}
trap stop_background EXIT
for step in tests/setup.d/*.sh; do
    [ -e "$step" ] || continue
    if grep -q '^# set-up: background' "$step"; then
        name=$(basename "$step" .sh)
        echo "== set-up (in the background, log: $STAGECACHE_TEST_SETUP_DIR/$name.log): $step"
        # its own process group (setsid), so that an interrupted run stops it whole
        setsid bash -c 'rc=0; bash "$1" >"$2.log" 2>&1 || rc=$?; echo "$rc" >"$2.rc.tmp"; mv "$2.rc.tmp" "$2.rc"' \
            step "$step" "$STAGECACHE_TEST_SETUP_DIR/$name" &
        background+=("$name:$!")
    fi
done

pip_install() {
    $PY -m pip install -q --disable-pip-version-check "$@" 2>&1 \
        | { grep -v -e 'WARNING: Location' || true; }
}
echo "== set-up: the test environment"
# The CPU build of torch lies on local disk; a plain `torch` would pull a multi-GB CUDA build.
with_progress "torch 2.13.0 (CPU)" pip_install "torch==2.13.0"
with_progress "stagecache and its test tools" pip_install -e ".[test]"

for step in tests/setup.d/*.sh; do
    [ -e "$step" ] || continue
    grep -q '^# set-up: background' "$step" && continue
    echo "== set-up: $step"
    with_progress "$step" bash "$step"
done
echo "== set-up done in $(( SECONDS - started )) s (background steps still running are waited for by their tests)"

echo "== ruff"
$PY -m ruff check runtime exporters dashboard tests
echo "== lint-imports (layers point one way, no cycles)"
$PY -c "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
echo "== pytest"
workers=${STAGECACHE_TEST_WORKERS:-2}
parallel=()
[ "$workers" -gt 1 ] && parallel=(-n "$workers" --dist loadfile)
wait_gone() { while kill -0 "$1" 2>/dev/null; do sleep 1; done; }
rc=0
$PY -m pytest -q "${parallel[@]}" --durations=15 "$@" || rc=$?

# A background step the tests did not wait for (a subset was run) still finishes: its result is
# cached for the next run, and a failed set-up fails the command.
for entry in "${background[@]}"; do
    name=${entry%%:*} pid=${entry##*:}
    with_progress "set-up $name" wait_gone "$pid"
    wait "$pid" || true
    step_rc=$(cat "$STAGECACHE_TEST_SETUP_DIR/$name.rc" 2>/dev/null || echo 1)
    if [ "$step_rc" != 0 ]; then
        echo "== set-up $name failed (exit $step_rc); the end of its log:" >&2
        tail -n 30 "$STAGECACHE_TEST_SETUP_DIR/$name.log" >&2
        [ "$rc" = 0 ] && rc=1
    else
        tail -n 2 "$STAGECACHE_TEST_SETUP_DIR/$name.log"
    fi
done
echo "== tests/run.sh: exit $rc after $(( SECONDS - started )) s"
exit "$rc"
