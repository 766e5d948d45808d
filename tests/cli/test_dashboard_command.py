"""`stagecache dashboard`: one-line errors with exit 2, and a real process serving a saved report."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
from plans import report
from serve_helpers import get_once_up
from stagecache.runtime.cli.main import main


@pytest.mark.parametrize("argv, message", [
    (["--from-json", "/nonexistent/report.json"], "cannot read"),
    (["--from-check", "--model", "tiny-v4", "--pp-size", "4", "--fault", "nope"], "unknown --fault 'nope'"),
    (["--from-check", "--model", "no-such-model"], "no-such-model"),
])
def test_cli_bad_input_is_one_line_exit_2(argv, message, capsys):
    assert main(["dashboard", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err


def test_cli_rejects_json_that_is_not_a_report(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["dashboard", "--from-json", str(bad)]) == 2
    assert "not JSON (line 1" in capsys.readouterr().err
    bad.write_text(json.dumps({"ok": True, "stages": []}))
    assert main(["dashboard", "--from-json", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "not a startup report: model: Field required" in err and len(err.strip().splitlines()) == 1
    good = tmp_path / "good.json"
    good.write_text(json.dumps(report("tiny-v4", 4).to_dict()))
    assert main(["dashboard", "--from-json", str(good), "--model", "deepseek-v4-flash"]) == 2
    assert "--from-json takes model" in capsys.readouterr().err


def test_cli_busy_port_is_exit_2(free_port, tmp_path, capsys):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(report("tiny-v4", 4).to_dict()))
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port))
        s.listen()
        assert main(["dashboard", "--from-json", str(good), "--port", str(free_port)]) == 2
    assert f"cannot listen on 127.0.0.1:{free_port}" in capsys.readouterr().err


def test_cli_from_json_serves_a_saved_check_report(tmp_path, free_port):
    """`stagecache check --json` output, saved, then served by a real `stagecache dashboard` process."""
    check = subprocess.run(
        [sys.executable, "-m", "stagecache.runtime", "check", "--model", "tiny-v4", "--pp-size", "4",
         "--fault", "missing-c4-state", "--json"], capture_output=True, text=True, timeout=60)
    assert check.returncode == 1, check.stderr
    saved = tmp_path / "check.json"
    saved.write_text(check.stdout)
    proc = subprocess.Popen(
        [sys.executable, "-m", "stagecache.runtime", "dashboard", "--from-json", str(saved),
         "--port", str(free_port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        assert f"http://127.0.0.1:{free_port}/" in line and "MAPPING ERRORS" in line
        r = get_once_up(proc, f"http://127.0.0.1:{free_port}/api/stages")
        body = r.json()
        assert body["faults"] == ["missing-c4-state"]
        bad = {(row["stage"], p["pool"]) for row in body["stages"] for p in row["pools"] if not p["ok"]}
        assert bad == {(1, "c4_state"), (2, "c4_state"), (3, "c4_state")}
        assert any("state_pools must not contain None" in row["status"] for row in body["stages"])
    finally:
        proc.terminate()
        proc.wait(timeout=10)
