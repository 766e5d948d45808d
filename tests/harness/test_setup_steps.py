"""The test command itself: tests/run.sh and the sglang set-up step's cache folder checks.

The folder checks run ``tests/setup.d/50-sglang.sh --check-only`` on folders made here (never the
real per-user cache).  tests/run.sh runs in a tiny fake checkout: its own set-up steps, and a
``$PYTHON`` whose pip, ruff and lint-imports succeed at once and whose pytest is a process that
waits -- so what is tested is how run.sh starts, watches and stops things, in seconds.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEP = ROOT / "tests" / "setup.d" / "50-sglang.sh"


def _check(cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(STEP), "--check-only"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "STAGECACHE_TEST_CACHE": str(cache)})


def _accepted(cache: Path) -> None:
    proc = _check(cache)
    assert proc.returncode == 0, proc.stderr
    st = cache.lstat()
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()


def _refused(cache: Path, words: str, named: Path | None = None) -> None:
    """Exit 2 and one line that names the folder refused (``named``: the cache's parent)."""
    proc = _check(cache)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and lines[0].startswith(f"{named or cache} "), proc.stderr


def test_a_cache_in_a_fresh_sticky_world_writable_folder_is_accepted_and_made_0700(tmp_path):
    parent = tmp_path / "shared"
    parent.mkdir()
    parent.chmod(0o1777)
    _accepted(parent / "cache")


def test_a_cache_directly_under_tmp_is_accepted():
    cache = Path("/tmp") / f"stagecache-test-cache-{uuid.uuid4().hex[:12]}"
    try:
        _accepted(cache)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def test_a_world_writable_parent_without_the_sticky_bit_is_refused(tmp_path):
    parent = tmp_path / "open"
    parent.mkdir()
    parent.chmod(0o777)
    _refused(parent / "cache", "mode 777", parent)
    assert not (parent / "cache").exists()


def test_a_symlinked_cache_is_refused(tmp_path):
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    _refused(tmp_path / "link", "is a symlink")


def test_a_cache_others_can_read_is_refused(tmp_path):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache").chmod(0o755)
    _refused(tmp_path / "cache", "mode 755, expected")


@pytest.mark.skipif(os.getuid() != 0, reason="giving a folder to another user needs root")
def test_a_cache_or_sticky_parent_of_another_user_is_refused(tmp_path):
    (tmp_path / "cache").mkdir(mode=0o700)
    os.chown(tmp_path / "cache", 65534, 65534)
    _refused(tmp_path / "cache", "owned by uid 65534")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    theirs.chmod(0o1777)
    os.chown(theirs, 65534, 65534)
    _refused(theirs / "cache", "owned by uid 65534 with mode 1777", theirs)


# -- tests/run.sh in a fake checkout ----------------------------------------------------------
FAKE_PYTEST = """
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # as tests/conftest.py does
with open(os.path.join(os.environ["MARKS"], "pytest.pid"), "w") as f:
    f.write(str(os.getpid()))
time.sleep(float(os.environ.get("PYTEST_S", "60")))
"""


def _checkout(tmp_path: Path, steps: dict[str, str]) -> tuple[Path, dict[str, str]]:
    """A checkout with tests/run.sh, its progress library and ``steps`` (name -> body); the
    environment to run it in (``$MARKS``: where the steps and the fake pytest leave notes)."""
    co, marks = tmp_path / "co", tmp_path / "marks"
    (co / "tests" / "setup.d").mkdir(parents=True)
    marks.mkdir()
    shutil.copy(ROOT / "tests" / "run.sh", co / "tests" / "run.sh")
    shutil.copy(ROOT / "tests" / "setup.d" / "progress.bash", co / "tests" / "setup.d" / "progress.bash")
    for name, body in steps.items():
        (co / "tests" / "setup.d" / name).write_text(f"set -euo pipefail\n{body}\n")
    (tmp_path / "pytest.py").write_text(FAKE_PYTEST)
    fake = tmp_path / "python"
    # python: pip and the set-up's collection of the suite (nothing to compile here) do nothing;
    # a pytest run is the fake pytest
    fake.write_text('#!/usr/bin/env bash\n[ "$1 $2 $3" = "-m pytest --collect-only" ] && exit 0\n'
                    f'[ "$1 $2" = "-m pytest" ] && exec {sys.executable} {tmp_path}/pytest.py "${{@:3}}"\n'
                    "exit 0\n")
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "STAGECACHE_TEST_WORKERS"}  # run.sh's default
    return co, {**env, "PYTHON": str(fake), "MARKS": str(marks), "PROGRESS_EVERY": "60"}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] != "Z"


def _run(co: Path, env: dict[str, str], timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run(["bash", "tests/run.sh"], cwd=co, env=env, capture_output=True, text=True,
                          timeout=timeout)
    return proc, time.monotonic() - t0


def test_a_background_step_failing_while_pytest_runs_stops_it_within_5_s(tmp_path):
    co, env = _checkout(tmp_path, {"50-bg.sh": """# set-up: background
echo building the environment
while [ ! -s "$MARKS/pytest.pid" ]; do sleep 0.1; done  # fails once pytest runs
date +%s.%N > "$MARKS/failed_at"
echo "the cache folder is refused" >&2
exit 3"""})
    proc, _ = _run(co, env)
    ended = time.time()
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert ended - float((tmp_path / "marks" / "failed_at").read_text()) < 5
    assert "== set-up 50-bg failed (exit 3): the cache folder is refused" in proc.stderr
    assert "building the environment" in proc.stderr  # the end of its log
    assert not _alive(int((tmp_path / "marks" / "pytest.pid").read_text()))


def test_a_background_step_failing_during_set_up_stops_the_run_before_pytest(tmp_path):
    co, env = _checkout(tmp_path, {
        "10-slow.sh": "sleep 2",
        "20-after.sh": 'touch "$MARKS/after"',
        "50-bg.sh": "# set-up: background\necho 'no space left on device'\nexit 4",
    })
    proc, took = _run(co, env)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "== set-up 50-bg failed (exit 4): no space left on device" in proc.stderr
    assert not (tmp_path / "marks" / "pytest.pid").exists() and not (tmp_path / "marks" / "after").exists()
    assert took < 20


def test_a_foreground_step_failing_stops_the_run_at_once_with_its_exit_code(tmp_path):
    co, env = _checkout(tmp_path, {
        "10-fails.sh": "echo 'libibverbs1: not found' >&2\nexit 5",
        "20-after.sh": 'touch "$MARKS/after"',
        "50-bg.sh": '# set-up: background\necho $$ > "$MARKS/bg.pid"\nsleep 60',
    })
    proc, took = _run(co, env)
    assert proc.returncode == 5, proc.stdout + proc.stderr
    assert "libibverbs1: not found" in proc.stderr and "== set-up failed: tests/setup.d/10-fails.sh (exit 5)" \
        in proc.stderr
    assert not (tmp_path / "marks" / "pytest.pid").exists() and not (tmp_path / "marks" / "after").exists()
    assert took < 20
    deadline = time.monotonic() + 5  # the background step was stopped with the run
    while (tmp_path / "marks" / "bg.pid").exists() and _alive(int((tmp_path / "marks" / "bg.pid").read_text())):
        assert time.monotonic() < deadline, "the background step outlived the run"
        time.sleep(0.1)


def test_ctrl_c_stops_pytest_and_the_background_step_and_exits_130(tmp_path):
    co, env = _checkout(tmp_path, {"50-bg.sh": '# set-up: background\necho $$ > "$MARKS/bg.pid"\nsleep 60'})
    # its own session, as a terminal's foreground job: Ctrl-C is SIGINT to that process group
    proc = subprocess.Popen(["bash", "tests/run.sh"], cwd=co, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    pid_file, bg_file = tmp_path / "marks" / "pytest.pid", tmp_path / "marks" / "bg.pid"
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text() and bg_file.exists() and bg_file.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, out + err
    assert "interrupted" in err
    assert not _alive(int(pid_file.read_text())) and not _alive(int(bg_file.read_text()))


# A pytest that notes each run (its arguments, whether it was told where to list the `alone`
# tests) and, told so, lists two; $ALONE_RC: the exit status of a run of those.
PHASES_PYTEST = """
import json, os, sys
alone = os.environ.get("STAGECACHE_TEST_ALONE_FILE")
with open(os.path.join(os.environ["MARKS"], "runs"), "a") as f:
    f.write(json.dumps({"argv": sys.argv[1:], "listed_to": bool(alone)}) + "\\n")
if alone:
    with open(alone, "w") as f:
        f.write(os.environ.get("ALONE_IDS", ""))
    sys.exit(int(os.environ.get("PARALLEL_RC", "0")))
sys.exit(int(os.environ.get("ALONE_RC", "0")))
"""


def _phases(tmp_path: Path, ids: str, alone_rc: int = 0,
            parallel_rc: int = 0) -> tuple[subprocess.CompletedProcess, list[dict]]:
    import json

    tmp_path.mkdir(exist_ok=True)
    co, env = _checkout(tmp_path, {})
    (tmp_path / "pytest.py").write_text(PHASES_PYTEST)
    env = {k: v for k, v in env.items() if k != "STAGECACHE_TEST_ALONE_FILE"}  # this suite's own, if any
    proc, _ = _run(co, {**env, "ALONE_IDS": ids, "ALONE_RC": str(alone_rc), "PARALLEL_RC": str(parallel_rc)})
    runs = [json.loads(line) for line in (tmp_path / "marks" / "runs").read_text().splitlines()]
    return proc, runs


def test_the_alone_tests_run_after_the_parallel_run_in_a_pytest_of_their_own(tmp_path):
    ids = "suite/a.py::test_fast\nsuite/b.py::test_flood[2000]\n"
    proc, runs = _phases(tmp_path, ids)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(runs) == 2, runs
    assert runs[0]["listed_to"] and runs[0]["argv"][:4] == ["-q", "-n", "3", "--dist"], runs[0]
    # the second run: those tests alone, in one process (no -n), not told to set any aside
    assert runs[1] == {"argv": ["-q", "suite/a.py::test_fast", "suite/b.py::test_flood[2000]"],
                       "listed_to": False}, runs[1]
    assert "== pytest: the 2 timing-sensitive test(s), alone on the machine" in proc.stdout


def test_a_failing_alone_run_fails_the_command_and_none_listed_means_no_second_run(tmp_path):
    proc, runs = _phases(tmp_path / "fails", "suite/a.py::test_fast\n", alone_rc=1)
    assert proc.returncode == 1 and len(runs) == 2, proc.stdout + proc.stderr
    proc, runs = _phases(tmp_path / "none", "")
    assert proc.returncode == 0 and len(runs) == 1, proc.stdout + proc.stderr
    assert "timing-sensitive" not in proc.stdout


def test_the_parallel_run_sets_the_alone_tests_aside_and_lists_them(tmp_path):
    """tests/conftest.py, as tests/run.sh's parallel run uses it (real pytest, collection only)."""
    listed = tmp_path / "alone.txt"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                           "tests/dashboard/test_guard.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "STAGECACHE_TEST_ALONE_FILE": str(listed)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    flood = "tests/dashboard/test_guard.py::test_under_ulimit_1024_a_flood_of_2000_idle_sockets_leaves_healthz_fast"
    assert listed.read_text().splitlines() == [flood]
    assert "(1 deselected)" in proc.stdout
    collected = [line for line in proc.stdout.splitlines() if line.startswith("tests/")]
    assert flood not in collected and len(collected) >= 5, collected


def test_the_list_file_is_not_passed_on_to_what_a_test_starts():
    """Run with $STAGECACHE_TEST_ALONE_FILE set (the next test does): the collection took it out
    of the environment, so a pytest this process starts cannot overwrite the list."""
    assert "STAGECACHE_TEST_ALONE_FILE" not in os.environ


def test_a_pytest_started_by_a_test_leaves_the_list_alone(tmp_path):
    """The sglang suites run as a pytest inside a test of the parallel run; the list that run
    wrote must survive them, or the flood test runs nowhere."""
    listed = tmp_path / "alone.txt"
    me = "tests/harness/test_setup_steps.py::test_the_list_file_is_not_passed_on_to_what_a_test_starts"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           "tests/dashboard/test_guard.py::test_the_socket_budget_follows_the_descriptor_limit", me,
                           "tests/dashboard/test_guard.py::"
                           "test_under_ulimit_1024_a_flood_of_2000_idle_sockets_leaves_healthz_fast"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "STAGECACHE_TEST_ALONE_FILE": str(listed)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "2 passed, 1 deselected" in proc.stdout, proc.stdout[-2000:]
    assert listed.read_text().splitlines() == [
        "tests/dashboard/test_guard.py::test_under_ulimit_1024_a_flood_of_2000_idle_sockets_leaves_healthz_fast"]


def test_a_selection_of_alone_tests_only_runs_them_alone_and_a_failed_parallel_run_fails(tmp_path):
    # the parallel run had nothing left (pytest's 5: no tests ran): not a failure
    proc, runs = _phases(tmp_path / "only", "suite/a.py::test_fast\n", parallel_rc=5)
    assert proc.returncode == 0 and len(runs) == 2, proc.stdout + proc.stderr
    proc, runs = _phases(tmp_path / "none", "", parallel_rc=5)  # nothing selected at all
    assert proc.returncode == 5 and len(runs) == 1, proc.stdout + proc.stderr
    # a failed parallel run fails the command, and the alone tests still run
    proc, runs = _phases(tmp_path / "failed", "suite/a.py::test_fast\n", parallel_rc=1)
    assert proc.returncode == 1 and len(runs) == 2, proc.stdout + proc.stderr


def test_a_list_file_named_by_the_caller_is_neither_used_nor_written(tmp_path):
    """run.sh run by a run.sh (this suite's parallel run names its own list file): its runs are
    told only of the list file it made itself."""
    outer = tmp_path / "outer-alone.txt"
    outer.write_text("the outer list\n")
    tmp_path.mkdir(exist_ok=True)
    co, env = _checkout(tmp_path, {})
    (tmp_path / "pytest.py").write_text(PHASES_PYTEST)
    proc, _ = _run(co, {**env, "ALONE_IDS": "suite/a.py::test_fast\n", "STAGECACHE_TEST_ALONE_FILE": str(outer)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert outer.read_text() == "the outer list\n"


# -- the progress line of a set-up step ----------------------------------------------------------
PROGRESS_RACE = """
. "$1"
trap 'echo "a TERM trap of the caller ran" >&2' TERM  # as tests/run.sh sets one
export PROGRESS_EVERY=3
for i in $(seq 1 "$2"); do
    with_progress step true >/dev/null
done
echo "$2 steps done"
"""


def test_the_progress_ticker_stops_when_a_step_ends_at_once():
    """A step that ends at once kills its ticker a moment after forking it, while the ticker may
    still hold the caller's TERM trap: a SIGTERM then was lost, and the run hung (seen once in a
    fake checkout on a loaded machine; here within a few hundred steps)."""
    steps = 3000
    try:
        proc = subprocess.run(["bash", "-c", PROGRESS_RACE, "race", str(ROOT / "tests" / "setup.d" / "progress.bash"),
                               str(steps)], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"with_progress hung: {exc.stderr!r}")
    assert proc.returncode == 0 and proc.stdout.strip() == f"{steps} steps done", proc.stdout + proc.stderr
    assert "TERM trap of the caller ran" not in proc.stderr, proc.stderr
