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


def _without_mooncake(tmp_path) -> dict[str, str]:
    """The environment of a child where ``import mooncake`` fails, extra installed or not."""
    import os

    hide = tmp_path / "hide"
    (hide / "mooncake").mkdir(parents=True)
    (hide / "mooncake" / "__init__.py").write_text("raise ImportError('No module named mooncake (hidden)')\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(hide), os.environ.get("PYTHONPATH")]))}


def test_plain_bench_l3_without_mooncake_times_the_file_store_and_says_in_one_line_how_to_add_it(tmp_path):
    """``stagecache bench l3`` with no flags, as the README shows it, on an install without the
    Mooncake extra: the file backend is timed, exit 0, one stderr line names the skip and the fix."""
    work = tmp_path / "dir"
    work.mkdir()
    proc = subprocess.run([sys.executable, "-m", "stagecache.runtime", "bench", "l3", "--pages", "2",
                           "--page-mib", "0.0625", "--rounds", "1", "--dir", str(work)],
                          capture_output=True, text=True, timeout=120, env=_without_mooncake(tmp_path))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert [r["backend"] for r in result["results"]] == ["file"]
    assert [s["backend"] for s in result["skipped"]] == ["mooncake"]
    assert "pip install '.[l3]'" in result["skipped"][0]["reason"]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "mooncake" in lines[0] and "skipped" in lines[0] and "pip install '.[l3]'" in lines[0]
    assert "--backend mooncake" in lines[0]


def test_asking_for_mooncake_without_the_extra_is_one_line_and_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "stagecache.runtime", "bench", "l3", "--backend", "mooncake"],
                          capture_output=True, text=True, timeout=120, env=_without_mooncake(tmp_path))
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install '.[l3]'" in lines[0] and "Traceback" not in proc.stderr, proc.stderr
