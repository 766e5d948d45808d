"""Every command on the DSA, MLA and MHA presets: ``check``, ``pools``, ``advise`` in-process, ``serve``
as real stage processes (the dashboard: tests/dashboard/test_family_legends.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from cli_traces import run_json, tokens_file
from stagecache.runtime.cli.main import main
from stagecache.runtime.model.config_file import PRESETS

FAMILY_OF = {"glm-5.2": "dsa", "deepseek-v3.2": "dsa", "deepseek-v3": "mla", "llama-3.1-8b": "mha"}


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return tokens_file(tmp_path_factory.mktemp("trace"), requests=80, seed=3)


@pytest.mark.parametrize("model", sorted(FAMILY_OF))
def test_check_pools_and_advise(capsys, tokens, model):
    assert model in PRESETS
    checked = run_json(capsys, "check", "--model", model, "--pp-size", "4")
    assert checked["ok"] and checked["family"] == FAMILY_OF[model]
    pooled = run_json(capsys, "pools", "--model", model, "--pp-size", "4")
    assert [s["device_bytes"] for s in pooled["stages"]] == [
        sum(p["device_bytes"] for p in s["pools"]) for s in pooled["stages"]]
    assert {k["pool"] for k in pooled["kinds"]} == ({"kv", "indexer"} if FAMILY_OF[model] == "dsa" else {"kv"})
    advice = run_json(capsys, "advise", "--model", model, "--pp-size", "2", "--trace", str(tokens),
                      "--page-size", "64")
    at_64 = run_json(capsys, "pools", "--model", model, "--pp-size", "2", "--page-size", "64")
    # the advice prices a page of the trace as the plan does: every paged buffer of the stage
    assert [s["token_page_bytes"] for s in advice["stages"]] == [s["token_page_bytes"] for s in at_64["stages"]]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", ["glm-5.2", "deepseek-v3", "llama-3.1-8b"])
def test_serve_runs_each_family(tmp_path, model):
    proc = subprocess.run(
        [sys.executable, "-m", "stagecache.runtime", "serve", "--model", model, "--pp-size", "2",
         "--page-size", "64", "--device-pages", "128", "--requests", "12", "--rate", "50", "--no-dashboard",
         "--exit-after-run", "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "startup ok: 2 stages validated" in proc.stdout
    assert "cache decisions identical on every stage" in proc.stdout


@pytest.mark.parametrize(("argv", "says"), [
    (["check", "--model", "llama-3.1-8b", "--tp-size", "2"],
     "--tp-size 2: llama-3.1-8b: sglang splits MHA's 8 KV heads over the TP ranks"),
    (["pools", "--model", "glm-5.2", "--hicache-size-gb", "64"],
     "--hicache-size: not modelled for DeepSeek sparse attention models"),
    (["pools", "--model", "deepseek-v4-flash", "--kv-cache-dtype", "fp8_e4m3"],
     "--kv-cache-dtype fp8_e4m3: not modelled for DeepSeek V4 models"),
])
def test_what_is_not_modelled_is_refused_in_one_line(capsys, argv, says):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1


def test_mla_and_dsa_bytes_hold_at_any_tp_size(capsys):
    one = run_json(capsys, "pools", "--model", "glm-5.2", "--pp-size", "2")
    four = run_json(capsys, "pools", "--model", "glm-5.2", "--pp-size", "2", "--tp-size", "4")
    assert [s["device_bytes"] for s in one["stages"]] == [s["device_bytes"] for s in four["stages"]]
