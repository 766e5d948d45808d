"""``stagecache bench transfer`` on CPU: the JSON has every baseline, ratio and a bit-exact check."""

from __future__ import annotations

import json

from stagecache.runtime.cli.main import main


def test_bench_transfer_cpu_json(capsys, tmp_path):
    out = tmp_path / "bench.json"
    rc = main(["bench", "transfer", "--device", "cpu", "--mib", "0.25", "--layers", "2", "--repeat", "1",
               "--pool", "c128", "--pool", "swa", "--layout", "page_first", "--loop-copies", "8",
               "--out", str(out), "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == report
    assert report["bench"] == "transfer" and report["device"] == "cpu"
    rows = report["results"]
    assert {(r["pool"], r["host_pattern"]) for r in rows} == {
        ("c128", "run"), ("c128", "scattered"), ("swa", "run"), ("swa", "scattered")}
    for r in rows:
        assert r["bit_exact"] is True
        assert r["page_bytes"] == {"swa": 149_760, "c128": 1728}[r["pool"]]  # sglang's padded pages
        assert r["bytes"] == r["pages"] * r["layers"] * r["page_bytes"] >= 0.25 * 2**20
        assert r["stagecache"]["auto"]["d2h"]["path"] == "cpu-index"
        for d in ("d2h", "h2d"):
            assert r["ceiling_gbps"][d] > 0 and r["loop_gbps"][d] > 0
            assert f"{d}_auto_vs_ceiling" in r["ratios"] and f"{d}_auto_vs_loop" in r["ratios"]
        assert r["stats_overhead"]["record_us"] > 0
    assert set(report["summary"]) >= {"d2h", "h2d", "max_stats_record_pct"}
