"""The ``stagecache`` CLI as real child processes forked from one interpreter that imported it once.

A table of a hundred CLI runs (tests/cli/test_bad_input.py) spent most of its time starting
Python and importing torch a hundred times: about 2 CPU seconds a run that gets past argparse.
Here a "zygote" process imports stagecache, its commands and torch once; each run is a
``fork()`` of it that sets argv, environment and working directory, points fds 0/1/2 at
/dev/null and two files, and calls the ``stagecache`` entry point.  Each run is a real process:
its own pid, its real exit status (``waitpid``; a signal is ``-signum`` as in ``subprocess``),
its own stdout and stderr, killable; only the interpreter's start-up and imports are shared.

Run as a script, this file is the zygote: requests come as JSON lines on stdin, replies (the
child's pid, then its exit status) go out as JSON lines on stdout; end of stdin ends it, and
the children it still has are killed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

#: What the zygote imports before its first fork: the CLI with every command, and the heavy
#: modules a command imports once its flags are parsed (torch, numpy, the plan and pools).
PRELOAD = ("torch", "numpy", "stagecache.runtime.cli.main", "stagecache.runtime.cli.serve",
           "stagecache.runtime.cli.bench", "stagecache.runtime.cli.check",
           "stagecache.runtime.cli.pools", "stagecache.runtime.cli.dashboard",
           "stagecache.runtime.cli.advise")


# -- the zygote (this file run as a script) ------------------------------------------------------
def _child(req: dict) -> None:
    """In the forked child: become the command, run it, exit as the interpreter would."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own process group, as a command started from a shell
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        fds = [os.open(os.devnull, os.O_RDONLY),
               os.open(req["out"], os.O_WRONLY | os.O_TRUNC),
               os.open(req["err"], os.O_WRONLY | os.O_TRUNC)]
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL if sig != signal.SIGPIPE else signal.SIG_IGN)
        sys.argv = ["stagecache", *req["argv"]]
        from stagecache.runtime.cli.main import entry

        try:
            entry()
            code = 0
        except SystemExit as exc:  # what the interpreter makes of sys.exit(x)
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                code = exc.code
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 - an uncaught exception: traceback, exit 1
            import traceback

            traceback.print_exc()
            code = 1
        import atexit

        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    finally:
        os._exit(code)


def _serve(preload: Sequence[str]) -> None:
    import importlib
    import selectors

    for name in preload:
        importlib.import_module(name)
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    requests = sys.stdin.buffer
    sel = selectors.DefaultSelector()
    sel.register(requests, selectors.EVENT_READ, None)
    live: dict[int, tuple[int, int]] = {}  # pidfd -> (request id, pid)
    print(json.dumps({"ready": os.getpid()}), file=replies)
    while True:
        for key, _ in sel.select():
            if key.data is None:  # a request, or the end of them
                line = requests.readline()
                if not line:
                    for _rid, pid in live.values():
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    return
                req = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    for fd in live:
                        os.close(fd)
                    _child(req)
                pidfd = os.pidfd_open(pid)
                live[pidfd] = (req["id"], pid)
                sel.register(pidfd, selectors.EVENT_READ, pidfd)
                print(json.dumps({"id": req["id"], "pid": pid}), file=replies)
            else:  # a child ended
                pidfd = key.data
                sel.unregister(pidfd)
                rid, pid = live.pop(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                print(json.dumps({"id": rid, "status": os.waitstatus_to_exitcode(status)}),
                      file=replies)


# -- the client (in the test process) ------------------------------------------------------------
class Zygote:
    """Runs ``stagecache ARGV`` as forks of one pre-imported interpreter; :meth:`run` answers as
    ``subprocess.run(capture_output=True, text=True)`` does."""

    def __init__(self, preload: Sequence[str] = PRELOAD):
        self._dir = tempfile.mkdtemp(prefix="stagecache-zygote-")  # 0700, ours
        self._proc = subprocess.Popen([sys.executable, __file__, *preload], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, bufsize=1,
                                      start_new_session=True)
        first = json.loads(self._proc.stdout.readline() or "{}")
        if "ready" not in first:
            raise RuntimeError(f"the CLI zygote did not start (exit {self._proc.wait(10)})")
        self._send = threading.Lock()  # one request at a time on the zygote's stdin
        self._next = 0
        self._waiting: dict[int, dict] = {}
        self._changed = threading.Condition()  # guards _next and _waiting; the reader notifies
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            msg = json.loads(line)
            with self._changed:
                if msg["id"] in self._waiting:  # not a run given up on (timed out) already
                    self._waiting[msg["id"]].update(msg)
                self._changed.notify_all()

    def run(self, argv: Sequence[str], timeout: float, env: dict[str, str] | None = None,
            cwd: str | None = None) -> subprocess.CompletedProcess:
        """``stagecache *argv`` in a forked child; raises ``subprocess.TimeoutExpired`` (the child
        killed) after ``timeout`` seconds."""
        with self._changed:
            rid = self._next
            self._next += 1
            self._waiting[rid] = {}
        out, err = Path(self._dir) / f"{rid}.out", Path(self._dir) / f"{rid}.err"
        out.touch(mode=0o600)
        err.touch(mode=0o600)
        req = {"id": rid, "argv": list(argv), "out": str(out), "err": str(err),
               "cwd": cwd or os.getcwd(), "env": dict(os.environ if env is None else env)}
        with self._send:
            self._proc.stdin.write(json.dumps(req) + "\n")
            self._proc.stdin.flush()
        with self._changed:
            done = self._changed.wait_for(lambda: "status" in self._waiting[rid], timeout)
            if not done:
                pid = self._waiting[rid].get("pid")
                if pid:
                    os.kill(pid, signal.SIGKILL)
                self._changed.wait_for(lambda: "status" in self._waiting[rid], 30)
            status = self._waiting.pop(rid).get("status")
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        out.unlink()
        err.unlink()
        if not done:
            raise subprocess.TimeoutExpired(["stagecache", *argv], timeout, stdout, stderr)
        return subprocess.CompletedProcess(["stagecache", *argv], status, stdout, stderr)

    def close(self) -> None:
        self._proc.stdin.close()  # the zygote ends, killing what it still runs
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)


if __name__ == "__main__":
    _serve(sys.argv[1:])
