"""``bench l3 --backend file``: the store against plain I/O in the same run, every round shown,
every read checked, nothing left behind."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from stagecache.runtime.bench.l3 import bench_file


def test_the_file_bench_times_store_and_baseline_and_leaves_nothing(tmp_path):
    out = bench_file(pages=4, page_bytes=1 << 16, rounds=2, directory=str(tmp_path))
    assert [r["operation"] for r in out["rows"]] == ["write", "read_cold", "read_warm"]
    for row in out["rows"]:
        assert row["baseline_gbps"] > 0 and row["store_gbps"] > 0
        assert row["ratio"] == pytest.approx(row["store_gbps"] / row["baseline_gbps"], rel=0.02)
        assert len(row["rounds_baseline_gbps"]) == len(row["rounds_store_gbps"]) == 2
    assert out["meets_target"] == all(r["ratio"] >= 0.8 for r in out["rows"][:2])
    assert list(tmp_path.iterdir()) == []


def test_the_command_prints_json(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "stagecache.runtime", "bench", "l3", "--backend", "file",
                           "--pages", "2", "--page-mib", "0.0625", "--rounds", "1", "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["results"][0]["backend"] == "file" and "meets_targets" in result
