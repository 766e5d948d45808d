# Sourced by tests/run.sh and the set-up steps (a library, not a step: run.sh runs *.sh only).
#
# with_progress LABEL CMD...: run CMD (a command or a shell function) and, while it runs, print
# "  ... LABEL: N s" every $PROGRESS_EVERY seconds (default 10), so a long install never looks
# hung.  Returns CMD's exit status.
with_progress() {
    local label=$1 start=$SECONDS pid ticker rc
    shift
    "$@" &
    pid=$!
    (
        # the sleep holds no output: once the ticker is killed, a sleep still running must not
        # keep the caller's stdout open (a pipe read to its end would wait for it)
        while sleep "${PROGRESS_EVERY:-10}" </dev/null >/dev/null 2>&1; do
            echo "  ... $label: $(( SECONDS - start )) s"
        done
    ) &
    ticker=$!
    rc=0
    wait "$pid" || rc=$?
    # SIGKILL, not SIGTERM: a subshell forked a moment ago still has its parent's TERM trap
    # (run.sh's) until it resets it, and a SIGTERM that lands then is lost: the ticker would go on
    # and the wait below never return (seen when CMD ends at once on a loaded machine)
    kill -KILL "$ticker" 2>/dev/null || true
    wait "$ticker" 2>/dev/null || true
    return "$rc"
}
