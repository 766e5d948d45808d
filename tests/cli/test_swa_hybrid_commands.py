"""Every command on the SWA-hybrid preset (gpt-oss-20b): advise prices its stages by the family's
bytes, serve runs four real stage processes that take identical cache decisions."""

from __future__ import annotations

import json
import subprocess
import sys

from stagecache.runtime.cli.main import main
from stagecache.runtime.traces.readers import WorkloadConfig, generate, write_trace

TOKEN_LAYER_BYTES = 8 * (64 + 64) * 2  # gpt-oss-20b: 8 KV heads of 64, K and V, bf16


def test_advise_prices_each_stage_by_its_sub_pools(tmp_path, capsys):
    trace = tmp_path / "conv.jsonl"
    write_trace(trace, generate(WorkloadConfig(seed=3, requests=120, think_time_s=5.0)))
    assert main(["advise", "--trace", str(trace), "--model", "gpt-oss-20b", "--pp-size", "2",
                 "--page-size", "16", "--json", "--no-belady"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [(s["start_layer"], s["end_layer"]) for s in rep["stages"]] == [(0, 12), (12, 24)]
    # one page of every layer of the stage, both sub-pools (6 sliding + 6 full layers)
    assert {s["token_page_bytes"] for s in rep["stages"]} == {16 * TOKEN_LAYER_BYTES * 12}
    assert rep["ceiling_hit_rate"] > 0


def test_serve_runs_the_preset_with_identical_decisions_on_every_stage(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "stagecache.runtime", "serve", "--model", "gpt-oss-20b",
                           "--requests", "12", "--rate", "0", "--no-dashboard", "--exit-after-run"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "startup ok: 4 stages validated (0:[0,6), 1:[6,12), 2:[12,18), 3:[18,24))" in proc.stdout
    assert "cache decisions identical on every stage" in proc.stdout
