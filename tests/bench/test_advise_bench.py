"""`stagecache bench advise` on a small trace: the JSON it prints, its exactness check and the
one-core pinning undone afterwards (speed itself is the benchmark's output, not a test's)."""

from __future__ import annotations

import json
import os

from mooncake_sample import write_sample
from stagecache.runtime.cli.main import main


def test_generated_trace_json(tmp_path, capsys):
    before = os.sched_getaffinity(0)
    saved = tmp_path / "gen.jsonl"
    out = tmp_path / "bench.json"
    assert main(["bench", "advise", "--requests", "400", "--sizes", "4", "--save-trace", str(saved),
                 "--out", str(out)]) == 0
    res = json.loads(capsys.readouterr().out)
    assert os.sched_getaffinity(0) == before and res["cpu_core"] in before
    assert json.loads(out.read_text()) == res
    assert res["trace"]["source"] == "generated" and res["trace"]["requests"] == 400
    assert sum(1 for _ in saved.open()) == 400
    assert res["replays"]["sizes"] == len(res["replays"]["per_size"]) == 4
    assert res["max_abs_diff_pp"] == {"device": 0.0, "total": 0.0}
    for r in res["replays"]["per_size"]:
        assert r["device_hit_tokens"] == r["curve_device_hit_tokens"]
        assert r["device_hit_tokens"] + r["host_hit_tokens"] == r["curve_hit_tokens"]
        assert r["host_pages"] == 2 * r["device_pages"] or r["device_pages"] == res["trace"][
            "longest_request_pages"]
    hosts = [r["host_pages"] for r in res["replays"]["per_size"]]
    assert hosts == sorted(hosts) and hosts[0] == 2 * res["trace"]["longest_request_pages"]
    c = res["curve"]
    assert 0 < c["pass_seconds"] <= c["seconds"] and c["peak_rss_mib"] > 0
    ratio = res["replays"]["seconds"] / c["seconds"]  # both rounded in the JSON
    assert abs(res["ratio_replays_vs_curve"] - ratio) < 0.05 * ratio


def test_a_mooncake_file(tmp_path, capsys):
    path = tmp_path / "mc.jsonl"
    write_sample(path, 200, seed=6)
    assert main(["bench", "advise", "--trace", str(path), "--sizes", "3"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["trace"]["format"] == "mooncake" and res["trace"]["page_size"] == 512
    assert res["max_abs_diff_pp"] == {"device": 0.0, "total": 0.0}


def test_unwritable_save_trace_is_exit_2(tmp_path, capsys):
    missing = tmp_path / "no-such-dir" / "x.jsonl"
    assert main(["bench", "advise", "--requests", "10", "--save-trace", str(missing)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--save-trace {missing}: cannot write it" in err
