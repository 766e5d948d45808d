"""The link probes of ``bench transfer --probes``: refused with one line where they cannot run,
their chunk table, the report's probe fields and the summary of what any technique reached;
byte-exact copies on a GPU."""

from __future__ import annotations

import json

import pytest
import torch
from stagecache.runtime.bench import transfer_probes, transfer_report
from stagecache.runtime.cli.main import main


def test_probes_on_cpu_exit_2_with_the_reason(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device exists here")
    assert main(["bench", "transfer", "--device", "cpu", "--probes", "--mix-pages", "1", "--kind-mib"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--probes on cpu" in err and "CUDA device" in err


def test_chunk_table_cuts_every_moved_page_of_every_buffer_into_chunks():
    page = transfer_probes.CHUNK * 2 + 48  # two full chunks and a 48-byte tail
    dev = [torch.zeros((5, page), dtype=torch.uint8) for _ in range(2)]
    host = [torch.zeros((7, page), dtype=torch.uint8) for _ in range(2)]
    table = transfer_probes.chunk_table(list(zip(dev, host, strict=True)), [4, 0], [1, 6])
    assert table is not None
    dev_addr, host_addr, sizes = table
    assert sizes == [transfer_probes.CHUNK, transfer_probes.CHUNK, 48] * 4
    expected_dev = [d.data_ptr() + a * page + off for d in dev for a in (4, 0) for off in (0, 8192, 16384)]
    expected_host = [h.data_ptr() + b * page + off for h in host for b in (1, 6) for off in (0, 8192, 16384)]
    assert dev_addr == expected_dev and host_addr == expected_host


def test_chunk_table_refuses_pages_the_kernels_cannot_move():
    dev, host = torch.zeros((3, 40), dtype=torch.uint8), torch.zeros((3, 40), dtype=torch.uint8)
    assert transfer_probes.chunk_table([(dev, host)], [0], [1]) is None  # 40 bytes: not 16-byte words
    wide = torch.zeros((3, 64), dtype=torch.uint8)
    assert transfer_probes.chunk_table([(wide[:, 8:40], torch.zeros((3, 32), dtype=torch.uint8))], [0], [1]) is None


def test_copy_engine_batch_attributes_have_the_runtime_layout():
    import ctypes

    # cudaMemcpyAttributes: access order (int), two cudaMemLocation (int type, int id), flags (uint)
    attrs = transfer_probes._CopyAttributes
    assert ctypes.sizeof(attrs) == 24
    assert [getattr(attrs, f).offset for f in ("src_access_order", "src_hint", "dst_hint", "flags")] == [0, 4, 12, 20]
    assert transfer_probes.CE_BATCH in transfer_probes.KEYS and set(transfer_probes.PROBES) < set(transfer_probes.KEYS)


def _row(case: str, size: int, vs: dict[str, float], probes: dict[str, float] | None) -> dict:
    row = {"case": case, "direction": "h2d", "bytes": size, "issue_us": 10.0,
           "ms": {"ceiling": 1.0, "stagecache": 1.0 / vs["stagecache"], "page_loop": 2.0, "warp_kernel": None},
           "gbps": {"stagecache": 1.0}, "vs_ceiling": vs, "best_peer": "page_loop",
           "stagecache_vs_best_peer": 2.0 * vs["stagecache"], "bit_exact": {"stagecache": True}}
    if probes is not None:
        row["probes"] = {k: {"ms": 1.0 / v, "vs_ceiling": v} for k, v in probes.items()}
    return row


def test_summary_says_what_any_technique_reached_and_the_render_shows_the_best_probe():
    mib = transfer_report.MIB
    rows = [_row("stage-mix:1", 10, {"stagecache": 0.5}, None),  # under 64 MiB: not counted
            _row("swa:64MiB", 64 * mib, {"stagecache": 0.93, "page_loop": 0.5},
                 {"probe_cuda_vector": 0.90, "probe_tma_bulk": 0.91}),
            _row("c128:256MiB", 256 * mib, {"stagecache": 0.89, "page_loop": 0.01},
                 {"probe_cuda_vector": 0.88, "probe_tma_bulk": 0.905})]
    report = {"gpu": "X", "driver": "1", "torch": "t", "triton": "3", "date": "d", "model": "m",
              "page_size": 256, "layout": "layer_first", "rows": rows}
    s = transfer_report.summary(report)
    assert s["ceiling_fraction_from_64MiB"] == {"holds": False, "worst": 0.89, "where": "c128:256MiB h2d"}
    # the best of stagecache, peers and probes at the worst row: a probe there
    assert s["any_technique_vs_ceiling_from_64MiB"] == {"holds": False, "worst": 0.905, "where": "c128:256MiB h2d"}
    report["summary"] = s
    text = transfer_report.render(report, "r.json")
    assert "best probe vs ceiling |" in text and "link probes" in text
    assert "| c128:256MiB | h2d |" in text and text.split("| c128:256MiB | h2d |")[1].split("\n")[0].endswith(" 0.91 |")
    assert "| stage-mix:1 | h2d |" in text and text.split("| stage-mix:1 | h2d |")[1].split("\n")[0].endswith(" - |")
    del report["rows"][1]["probes"], report["rows"][2]["probes"]
    assert "probe" not in transfer_report.render(report, "r.json")  # no probes run: no column
    json.dumps(report)


@pytest.mark.gpu
def test_probes_copy_byte_exact_on_the_gpu():
    from stagecache.runtime.bench.transfer import Settings, grid, run_case
    from stagecache.runtime.model.families import load_spec

    if transfer_probes.unavailable(torch.device("cuda")):
        pytest.skip(transfer_probes.unavailable(torch.device("cuda")))
    s = Settings(device="cuda", page_size=256, layout="layer_first", seed=0, min_reps=1, max_reps=2,
                 budget_s=0.01, probes=True)
    cases = grid(load_spec("deepseek-v4-flash"), 4, 1, 256, 3, [3], [0.5], ["c128"])
    expected = set(transfer_probes.PROBES) | ({transfer_probes.CE_BATCH} if transfer_probes._batch_call() else set())
    for case in cases:
        rows, notes = run_case(case, s)
        assert expected <= set(notes)
        for r in rows:
            assert set(r["probes"]) == expected
            assert all(r["bit_exact"][k] is True for k in expected)
            # a ratio, not a bound: at small sizes the contiguous ceiling's own launch cost can make a
            # probe 3x "faster" than it (see docs/bench/transfer-h100.json), with 1-2 reps more so
            assert all(0 < p["vs_ceiling"] < float("inf") for p in r["probes"].values())
            assert "probe_tma_bulk" not in r["ms"]  # probes are not peers
