"""``stagecache bench transfer``: the JSON schema (same on CPU and GPU), byte-exact checks, the docs render."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from stagecache.runtime.bench import transfer_report
from stagecache.runtime.cli.main import main
from stagecache.runtime.model.families import load_spec
from stagecache.runtime.plan.plan import build_plan

ROOT = Path(__file__).resolve().parents[2]


def test_bench_transfer_cpu_json(capsys, tmp_path):
    out = tmp_path / "bench.json"
    rc = main(["bench", "transfer", "--model", "deepseek-v4-flash", "--device", "cpu", "--mix-pages", "1", "3", "--kind-mib", "0.25",
               "--kind", "c128", "--kind", "swa", "--layers", "2", "--min-reps", "1", "--max-reps", "2",
               "--out", str(out), "--json"])
    assert rc == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert json.loads(out.read_text()) == report
    assert "[bench transfer] 1/4 stage-mix:1" in captured.err  # progress on stderr
    assert {"gpu", "driver", "torch", "triton", "date", "rows"} <= set(report)
    assert report["bench"] == "transfer" and report["device"] == "cpu" and report["gpu"] is None
    rows = report["rows"]
    assert [(r["case"], r["direction"]) for r in rows] == [
        (c, d) for c in ("stage-mix:1", "stage-mix:3", "swa:0.25MiB", "c128:0.25MiB") for d in ("d2h", "h2d")]
    flash = load_spec("deepseek-v4-flash")
    stage = build_plan(flash, 4).stage(1)
    token_page = sum(p.present * p.page_bytes for p in stage.pools if p.host_pages)
    for r in rows:
        assert set(r["ms"]) == {"ceiling", "stagecache", "page_loop", "warp_kernel"}
        assert any("loop" in k for k in r["ms"])
        assert r["ms"]["warp_kernel"] is None  # a GPU-only peer
        assert all(r["ms"][k] > 0 for k in ("ceiling", "stagecache", "page_loop"))
        assert r["bit_exact"] == {"ceiling": True, "stagecache": True, "page_loop": True}
        assert r["path"] == "cpu" and r["best_peer"] == "page_loop"
        assert r["stagecache_vs_best_peer"] == round(r["ms"]["page_loop"] / r["ms"]["stagecache"], 3)
        if r["case"].startswith("stage-mix:"):
            assert r["bytes"] == r["pages"] * token_page  # every host-cached pool of the stage
        else:
            assert r["bytes"] >= 0.25 * 2**20 and r["buffers"] == 2
    assert report["summary"]["bit_exact"] is True
    assert report["summary"]["ceiling_fraction_from_64MiB"]["holds"] is None  # no such row here


def test_bench_transfer_render_into_a_document(tmp_path, capsys):
    report = {"gpu": "X", "driver": "1", "torch": "t", "triton": None, "date": "d", "model": "m",
              "page_size": 256, "layout": "layer_first",
              "rows": [{"case": "stage-mix:1", "direction": "d2h", "bytes": 10, "issue_us": 20.0,
                        "ms": {"ceiling": 0.1, "stagecache": 0.12, "page_loop": 0.2, "warp_kernel": None},
                        "gbps": {"stagecache": 0.1}, "vs_ceiling": {"stagecache": 0.83}, "best_peer": "page_loop",
                        "stagecache_vs_best_peer": 1.667, "bit_exact": {"stagecache": True}}]}
    report["summary"] = transfer_report.summary(report)
    assert report["summary"]["one_page_mix_vs_ceiling_time"] == {"holds": True, "worst": 1.2,
                                                                 "where": "stage-mix:1 d2h"}
    src = tmp_path / "r.json"
    src.write_text(json.dumps(report))
    doc = tmp_path / "doc.md"
    doc.write_text("# title\n\n" + transfer_report.BEGIN.format(src="old") + "\nold table\n"
                   + transfer_report.END + "\n\nafter\n")
    assert main(["bench", "transfer", "--render", str(src), "--into", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# title\n\n") and text.endswith("\n\nafter\n") and "old table" not in text
    assert transfer_report.generated_section(text) == transfer_report.render(report, str(src))
    assert "| stage-mix:1 | d2h | 10 | 0.100 | 0.120 | 0.200 | - |" in text
    assert main(["bench", "transfer", "--render", str(doc)]) == 2  # not a report: one-line error
    assert "not a bench transfer report" in capsys.readouterr().err


def test_docs_table_is_the_render_of_the_committed_h200_report():
    src = "docs/bench/transfer-h200.json"
    report = json.loads((ROOT / src).read_text())
    doc = (ROOT / "docs" / "bench-transfer.md").read_text()
    assert transfer_report.generated_section(doc) == transfer_report.render(report, src)
    assert report["gpu"] and report["driver"] and report["torch"] and report["triton"] and report["date"]
    assert {r["direction"] for r in report["rows"]} == {"d2h", "h2d"}
    for r in report["rows"]:
        assert {"ceiling", "stagecache"} <= set(r["ms"]) and any("loop" in k for k in r["ms"])


@pytest.mark.parametrize("argv", [["--stage", "4"], ["--device", "cuda:7"]])
def test_bench_transfer_bad_flags_exit_2(argv, capsys):
    import torch

    if argv[0] == "--device" and torch.cuda.is_available():
        pytest.skip("a CUDA device exists here")
    assert main(["bench", "transfer", "--mix-pages", "1", "--kind-mib", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ("--stage 4" in err or "--device" in err)
