"""`stagecache check` as a user runs it: a real subprocess, exit codes, table and JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stagecache.runtime", "check", *args],
                          capture_output=True, text=True, timeout=60)


def test_clean_flash_pp4_tp2_table_exits_0():
    r = check("--model", "deepseek-v4-flash", "--pp-size", "4", "--tp-size", "2")
    assert r.returncode == 0, r.stderr
    for rng in ("[0, 10)", "[10, 21)", "[21, 32)", "[32, 43)"):
        assert rng in r.stdout
    assert r.stdout.count("OK") == 4 and "all stages valid" in r.stdout


def test_global_swa_fault_exits_1_naming_stages_and_counts():
    r = check("--model", "deepseek-v4-flash", "--pp-size", "4", "--fault", "global-swa")
    assert r.returncode == 1
    assert "got 43 buffers for 10 local layers" in r.stdout
    assert r.stdout.count("got 43 buffers for 11 local layers") == 3
    assert "4 mapping error(s)" in r.stdout


def test_output_into_a_pipe_is_never_hard_wrapped():
    """stdout is a pipe here (not a terminal): every table row stays one line, however wide, even
    with COLUMNS=40 in the environment, so it can be grepped, copied and read in a CI log."""
    import os

    r = subprocess.run([sys.executable, "-m", "stagecache", "check", "--model", "deepseek-v4-flash",
                        "--fault", "global-swa", "--fault", "global-c4"], capture_output=True,
                       text=True, timeout=60,
                       env={**os.environ, "COLUMNS": "40"})
    assert r.returncode == 1
    rows = [ln for ln in r.stdout.splitlines() if "SWA KV pool must be PP-stage-local" in ln]
    assert len(rows) == 4 and all(ln.rstrip().endswith("│") for ln in rows), rows
    assert all(len(ln) > 400 for ln in rows)  # every error of the stage on its row (was cut at 200)


def test_json_shape():
    r = check("--model", "deepseek-v4-flash", "--pp-size", "4", "--json", "--fault", "global-swa@2")
    assert r.returncode == 1
    doc = json.loads(r.stdout)
    assert {"ok", "model", "num_layers", "pp_size", "stages", "errors"} <= doc.keys()
    assert doc["ok"] is False and doc["num_layers"] == 43 and doc["pp_size"] == 4
    s = doc["stages"][2]
    assert {"stage", "start_layer", "end_layer", "local_layers", "layers", "buffers", "errors"} <= s.keys()
    assert set(s["buffers"]) == {"swa", "c4", "c128", "c4_state", "c128_state", "indexer", "c4_indexer_state"}
    assert s["buffers"]["swa"] == 43 and s["local_layers"] == 11
    assert s["errors"] == [{"stage": 2, "pool": "swa", "expected": 11, "got": 43,
                            "message": "DeepSeek V4 SWA KV pool must be PP-stage-local: got 43 buffers for 11 local layers"}]
    layer = s["layers"][0]
    assert layer == {"local": 0, "global": 21, "compress_ratio": 128, "compress_layer_id": 0, "c4_state_id": None}
    assert all(not st["errors"] for i, st in enumerate(doc["stages"]) if i != 2)
    assert doc["errors"] == []


def test_cross_stage_errors_in_json():
    doc = json.loads(check("--model", "tiny-v4", "--pp-size", "4", "--json", "--fault", "overlap").stdout)
    assert doc["errors"] and doc["errors"][0]["stage"] is None and doc["errors"][0]["pool"] == "partition"


@pytest.mark.parametrize("args,needle", [
    (["--model", "no-such-model", "--pp-size", "2"], "unknown model 'no-such-model'"),
    (["--model", "tiny-v4", "--pp-size", "0"], "expected a positive integer"),
    (["--model", "tiny-v4", "--pp-size", "x"], "expected a positive integer"),
    (["--model", "tiny-v4", "--pp-size", "13"], "larger than the model's 12 layers"),
    (["--model", "tiny-v4", "--pp-size", "4", "--pp-partition", "3,3,3"], "has 3 entries"),
    (["--model", "tiny-v4", "--pp-size", "4", "--pp-partition", "3,3,3,4"], "sums to 13"),
    (["--model", "tiny-v4", "--pp-size", "4", "--page-size", "100"], "multiple of 128"),
    (["--model", "tiny-v4", "--pp-size", "4", "--fault", "bogus"], "unknown --fault 'bogus'"),
    (["--model", "/nonexistent/config.json", "--pp-size", "1"], "model config '/nonexistent/config.json': cannot read"),
    (["--model", "", "--pp-size", "1"], "--model is empty"),
])
def test_bad_input_exits_2_with_one_line(args, needle):
    r = check(*args)
    assert r.returncode == 2
    assert needle in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_bare_command_prints_usage_and_exits_2():
    r = subprocess.run([sys.executable, "-m", "stagecache.runtime"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("usage: stagecache ")
    assert "name a command (check, pools, serve, dashboard, bench)" in r.stderr


def test_top_level_help_is_written_for_users():
    r = subprocess.run([sys.executable, "-m", "stagecache.runtime", "--help"], capture_output=True,
                       text=True, timeout=60)
    text = " ".join(r.stdout.split())  # argparse wraps to the terminal width
    assert r.returncode == 0
    assert "stage-local KV cache for DeepSeek-V4" in text and "exit codes: 0 ok" in text
    assert "``" not in r.stdout and "registered" not in r.stdout  # no developer docstring
