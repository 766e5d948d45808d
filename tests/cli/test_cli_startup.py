"""What a command imports before it does its work: torch (about 2 CPU seconds) only where it is used.

``serve`` validates every flag in its parent process before any stage starts; the stages import
torch in their forkserver.  A bad flag, or the whole validation of good ones, must not pay for
torch in the parent (a ``stagecache serve --model typo`` answers in half a second).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _fresh(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120)


def test_serve_validates_its_flags_without_importing_torch():
    proc = _fresh("""
        import sys
        from stagecache.runtime.cli.main import build_parser, main
        from stagecache.runtime.cli.serve import options_from_args

        assert main(["serve", "--port", "0", "--model", "no-such-model"]) == 2
        opts = options_from_args(build_parser().parse_args(["serve", "--device", "auto", "--requests", "8"]))
        assert opts.device == "cpu" and opts.requests == 8, opts
        print("torch imported:", "torch" in sys.modules)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "unknown model 'no-such-model'" in proc.stderr
    assert proc.stdout.strip() == "torch imported: False", proc.stdout


def test_check_and_pools_run_without_importing_torch():
    proc = _fresh("""
        import sys
        from stagecache.runtime.cli.main import main

        assert main(["check", "--model", "tiny-v4", "--pp-size", "4"]) == 0
        assert main(["pools", "--model", "tiny-v4", "--pp-size", "2", "--json"]) == 0
        print("torch imported:", "torch" in sys.modules, file=sys.stderr)
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().endswith("torch imported: False"), proc.stderr
