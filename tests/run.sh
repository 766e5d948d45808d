#!/usr/bin/env bash
# Install everything the test suite needs on a fresh Debian machine, then run it.
# Used as-is by .ci/run and by a newcomer:  bash tests/run.sh [pytest arguments]
#
# Set-up steps are tests/setup.d/*.sh, one per concern, run in name order.  A step marked
# "# set-up: background" (the sglang environment, minutes on a fresh machine) runs alongside
# the rest and the suite; the tests that need it run last and wait for it (bounded), reading
# its exit status from $STAGECACHE_TEST_SETUP_DIR.  pytest runs on $STAGECACHE_TEST_WORKERS
# processes (default 3, also on 2 cores: much of a test's time is spent waiting on the servers,
# ranks and link cuts it starts; 1 runs it in one process).  A step that fails stops the run at once with
# the end of its log and its exit code: a foreground one when it returns, a background one when
# it is seen (after each set-up step, then every second while pytest runs: pytest is stopped).
# Ctrl-C stops pytest (its own process group) and everything started here: exit 130.
# The tests marked `alone` (timing-sensitive) are not in the parallel run: they run after it, in
# one pytest process with nothing else running, and their time counts in the suite's.
set -euo pipefail
cd "$(dirname "$0")/.."
. tests/setup.d/progress.bash
started=$SECONDS
PY=${PYTHON:-python3}
# The suite starts hundreds of Python processes.  With PYTHONDONTWRITEBYTECODE set (some images set
# it) each one compiles every module it imports and rewrites every test module's asserts again
# (pytest keeps a rewritten module only where bytecode may be written): a collection of the suite
# took 12.9 CPU-seconds so, 7.0 with the compiled modules kept.  Here the first process to import
# a module keeps its bytecode for the others (the venv's and the checkout's __pycache__).
unset PYTHONDONTWRITEBYTECODE

STAGECACHE_TEST_SETUP_DIR=$(mktemp -d -t stagecache-setup-XXXXXX)  # 0700
export STAGECACHE_TEST_SETUP_DIR
background=()
pytest_pid=
main_pid=$$
stop_background() {  # on any exit: a background step still running is stopped, by its group
    # Only the main shell cleans up.  A subshell (a progress ticker, the background launcher)
    # killed right after its fork may still run this inherited trap, with $BASHPID not yet its
    # own: the kernel's answer, the pid of whoever reads its own /proc/self/stat, is the truth.
    local me entry
    read -r me _ </proc/self/stat
    [ "$me" = "$main_pid" ] || return 0
    for entry in "${background[@]}"; do
        # its group; or, not yet in a group of its own (setsid not run yet), the process alone
        kill -- "-${entry##*:}" 2>/dev/null || kill "${entry##*:}" 2>/dev/null || true
    done
    [ -z "${warm_pid:-}" ] || kill_tree "$warm_pid"
    rm -rf "$STAGECACHE_TEST_SETUP_DIR"
}
trap stop_background EXIT
stop_pytest() {  # pytest runs in its own process group: $1 (TERM) to all of it, SIGKILL after 5 s
    [ -n "$pytest_pid" ] || return 0
    kill -"$1" -- "-$pytest_pid" 2>/dev/null || true
    local waited=0
    while kill -0 "$pytest_pid" 2>/dev/null && [ "$waited" -lt 50 ]; do
        sleep 0.1
        waited=$(( waited + 1 ))
    done
    kill -KILL -- "-$pytest_pid" 2>/dev/null || true
    wait "$pytest_pid" 2>/dev/null || true
    pytest_pid=
}
kill_tree() {  # $1 and everything it started, children first
    local child
    for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do
        kill_tree "$child"
    done
    kill -TERM "$1" 2>/dev/null || true
}
interrupted() {  # Ctrl-C (SIGINT) or SIGTERM: pytest's group gets it too; exit 130 or 143
    trap - INT TERM
    echo "== tests/run.sh: interrupted" >&2
    stop_pytest "$1"
    local job  # a set-up step runs as a job (with_progress), where SIGINT is ignored: stop it
    for job in $(jobs -p); do
        kill_tree "$job"
    done
    exit "$2"
}
trap 'interrupted INT 130' INT
trap 'interrupted TERM 143' TERM
# A background step that failed ends the run at once: its last line and the end of its log,
# pytest stopped, and the step's exit code.  Looked at after each set-up step and every second
# while pytest runs.
check_background() {
    local entry name step_rc log
    for entry in "${background[@]}"; do
        name=${entry%%:*}
        step_rc=$(cat "$STAGECACHE_TEST_SETUP_DIR/$name.rc" 2>/dev/null) || continue
        [ "$step_rc" = 0 ] && continue
        log=$STAGECACHE_TEST_SETUP_DIR/$name.log
        echo "== set-up $name failed (exit $step_rc): $(tail -n 1 "$log" 2>/dev/null)" >&2
        echo "== the end of its log ($log):" >&2
        tail -n 30 "$log" >&2 || true
        stop_pytest TERM
        echo "== tests/run.sh: exit $step_rc after $(( SECONDS - started )) s (set-up $name failed)" >&2
        exit "$step_rc"
    done
}
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
# A foreground step that fails ends the run at once with its exit code (its output is above).
foreground() {
    local label=$1 step_rc=0
    shift
    with_progress "$label" "$@" || step_rc=$?
    if [ "$step_rc" != 0 ]; then
        echo "== set-up failed: $label (exit $step_rc)" >&2
        echo "== tests/run.sh: exit $step_rc after $(( SECONDS - started )) s" >&2
        exit "$step_rc"
    fi
    check_background
}

pip_install() {
    $PY -m pip install -q --disable-pip-version-check "$@" 2>&1 \
        | { grep -v -e 'WARNING: Location' || true; }
}
# The CPU build of torch lies on local disk (pip's find-links); a plain `torch` would pull a
# multi-GB CUDA build.  One resolve: torch, stagecache with its test tools and the Mooncake wheel
# (l3; tests/setup.d/60-mooncake.sh then finds it importable once its Debian library is there).
# Where that wheel is found, uv installs the lot without a cache (about 24 s against pip's 50:
# parallel downloads and unpacking), pinned to the wheel's own `+cpu` version so that it can
# never take the CUDA build; not byte-compiled whole (20 s against 8 for a venv of 10,000
# modules, of which the suite's collection imports about a quarter: each is compiled once, where first
# imported); otherwise, or if uv fails, pip does.
torch_wheel_dir() {
    local dir
    for dir in ${PIP_FIND_LINKS:-} /opt/wheels; do
        compgen -G "$dir/torch-2.13.0+cpu-*.whl" >/dev/null && { echo "$dir"; return 0; }
    done
    return 1
}
install_test_env() {
    local wheels
    if wheels=$(torch_wheel_dir) && pip_install uv \
        && $PY -m uv pip install -q --no-cache --python "$(command -v "$PY")" --find-links "$wheels" \
            "torch==2.13.0+cpu" -e ".[test,l3]"; then
        return 0
    fi
    pip_install "torch==2.13.0" -e ".[test,l3]"
}
echo "== set-up: the test environment"
foreground "torch 2.13.0 (CPU), stagecache and its test tools" install_test_env
# One collection of the suite before the parallel run: it compiles what the tests import and keeps
# every test module's rewritten asserts, so that the pytest processes (each collects the whole
# suite) start from bytecode.  It runs beside the steps below, ruff and the import contracts, and
# is waited for before pytest.  A collection error shows in the run itself.
warm_collect() {
    $PY -m pytest --collect-only -q -p no:cacheprovider >/dev/null 2>&1 || true
}
warm_collect &
warm_pid=$!

for step in tests/setup.d/*.sh; do
    [ -e "$step" ] || continue
    grep -q '^# set-up: background' "$step" && continue
    echo "== set-up: $step"
    foreground "$step" bash "$step"
done
echo "== set-up done in $(( SECONDS - started )) s (background steps still running are waited for by their tests)"

echo "== ruff"
$PY -m ruff check runtime exporters dashboard tests
echo "== lint-imports (layers point one way, no cycles)"
$PY -c "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
check_background
settled() { while kill -0 "$1" 2>/dev/null; do sleep 0.2; done; }
with_progress "compile the suite's modules" settled "$warm_pid"
wait "$warm_pid" || true
warm_pid=
echo "== pytest"
workers=${STAGECACHE_TEST_WORKERS:-3}
parallel=()
[ "$workers" -gt 1 ] && parallel=(-n "$workers" --dist loadfile)
wait_gone() { while kill -0 "$1" 2>/dev/null; do sleep 1; done; }
rc=0
unset STAGECACHE_TEST_ALONE_FILE  # set below for the parallel run alone (not one a caller set)
run_pytest() {  # pytest in its own process group (setsid), watched every second: a failed
    # background step stops it.  Returns pytest's exit status.
    local status=0
    setsid $PY -m pytest "$@" &
    pytest_pid=$!
    while kill -0 "$pytest_pid" 2>/dev/null; do
        check_background
        sleep 1
    done
    wait "$pytest_pid" || status=$?
    pytest_pid=
    return "$status"
}
# The tests marked `alone` (latencies that hold only on a machine to itself) are left out of the
# parallel run, which lists them here, and run after it in one process of their own.
alone=$STAGECACHE_TEST_SETUP_DIR/alone.txt
STAGECACHE_TEST_ALONE_FILE=$alone run_pytest -q "${parallel[@]}" --durations=15 "$@" || rc=$?
# pytest's 5 (no tests ran): every test selected was set aside for the run alone
if [ "$rc" = 5 ] && [ -s "$alone" ]; then rc=0; fi

# A background step the tests did not wait for (a subset was run) still finishes: its result is
# cached for the next run, and a failed set-up fails the command (with the step's exit code).
for entry in "${background[@]}"; do
    name=${entry%%:*} pid=${entry##*:}
    with_progress "set-up $name" wait_gone "$pid"
    wait "$pid" || true
    [ -f "$STAGECACHE_TEST_SETUP_DIR/$name.rc" ] || echo 1 >"$STAGECACHE_TEST_SETUP_DIR/$name.rc"
    check_background
    tail -n 2 "$STAGECACHE_TEST_SETUP_DIR/$name.log"
done
# after the background steps: nothing else runs beside them
if [ -s "$alone" ]; then
    echo "== pytest: the $(wc -l <"$alone") timing-sensitive test(s), alone on the machine"
    mapfile -t alone_ids <"$alone"
    alone_rc=0
    run_pytest -q "${alone_ids[@]}" || alone_rc=$?
    [ "$rc" != 0 ] || rc=$alone_rc
fi
echo "== tests/run.sh: exit $rc after $(( SECONDS - started )) s"
exit "$rc"
