"""Pure view functions and figures: cell verdicts come from the report's data, not its messages."""

from __future__ import annotations

import copy

import pytest
from live_helpers import blank_live
from plans import report as plan_report
from stagecache.dashboard import figures, live_figures
from stagecache.dashboard.models import StageLive
from stagecache.dashboard.rates import StageRates
from stagecache.dashboard.view import (
    layer_map_cells,
    pool_statuses,
    run_state,
    stages_response,
)
from stagecache.runtime.errors import ConfigError
from stagecache.runtime.model.families.deepseek_v4 import FAMILY, POOLS
from stagecache.runtime.validation.report import StartupReport


def report(model: str, pp: int, faults: list[str] = ()) -> dict:
    """``check --json`` of the layout, as a saved report is read back."""
    return plan_report(model, pp, list(faults)).to_dict()


def parse_report(raw: dict) -> StartupReport:
    return StartupReport.parse(raw, "the report")


def test_duplicate_compress_id_marks_the_second_layer_only():
    rep = parse_report(report("deepseek-v4-flash", 4, ["duplicate-compress-id"]))
    stage = rep.stages[1]
    c128 = [c for c in layer_map_cells(stage) if c.pool == "c128"]
    bad = [c for c in c128 if c.error]
    assert len(bad) == 1
    first = c128[0]
    assert bad[0].index == first.index
    assert bad[0].error == f"index {first.index} shared with global layer {first.global_id}"
    assert next(p for p in pool_statuses(stage) if p.pool == "c128").ok is False


def test_missing_id_and_missing_c4_state_buffer():
    raw = report("tiny-v4", 4, ["missing-c4-state"])
    rep = parse_report(raw)
    statuses = {p.pool: p for p in pool_statuses(rep.stages[2])}
    assert not statuses["c4_state"].ok
    assert statuses["c4_state"].errors[0].endswith("must not contain None: buffer(s) [1] are None")
    # a layer entry without its compress id: the cell says so
    broken = copy.deepcopy(raw)
    entry = next(e for e in broken["stages"][0]["layers"] if e["compress_ratio"] == 4)
    entry["compress_layer_id"] = None
    cells = layer_map_cells(parse_report(broken).stages[0])
    flagged = [c for c in cells if c.global_id == entry["global"] and c.pool in ("c4", "indexer")]
    assert [c.error for c in flagged] == ["no C4 KV index", "no C4 indexer index"]


def test_every_needed_cell_and_nothing_else():
    rep = parse_report(report("deepseek-v4-flash", 2))
    for stage in rep.stages:
        cells = layer_map_cells(stage)
        assert {p: sum(c.pool == p for c in cells) for p in POOLS} == stage.expected
        for c in cells:
            assert stage.start <= c.global_id < stage.end


def test_parse_report_names_the_wrong_fields():
    raw = report("tiny-v4", 2)
    del raw["stages"][1]["buffers"]
    raw["pp_size"] = "two"
    with pytest.raises(ConfigError) as exc:
        parse_report(raw)
    assert "pp_size: Input should be a valid integer" in str(exc.value)
    assert "stages.1.buffers: Field required" in str(exc.value)


def test_stage_table_status_joins_exact_messages():
    raw = report("tiny-v4", 4, ["global-swa", "global-c4"])
    rows = stages_response(parse_report(raw)).stages
    for row, s in zip(rows, raw["stages"], strict=True):
        assert row.status == "; ".join(e["message"] for e in s["errors"])
        c4_wrong = s["buffers"]["c4"] != s["expected_buffers"]["c4"]
        want = {"swa"} | ({"c4", "c4_state", "indexer", "c4_indexer_state"} if c4_wrong else set())
        assert {p.pool for p in row.pools if not p.ok} == want


def test_layer_map_figure_colours_by_layer_kind_and_handles_an_empty_stage():
    rep = parse_report(report("tiny-v4", 1))
    s = rep.stages[0]
    fig = figures.to_json_dict(figures.layer_map_figure(s, pool_statuses(s), layer_map_cells(s), FAMILY))
    z = fig["data"][0]["z"]
    swa_row = z[POOLS.index("swa")]
    ratios = [e.compress_ratio for e in s.layers]
    assert swa_row == [{0: 0, 4: 1, 128: 2}[r] for r in ratios]  # the legend: ratio 0, 4, 128
    assert fig["data"][0]["colorbar"]["ticktext"] == ["ratio 0", "ratio 4", "ratio 128"]
    assert fig["data"][0]["text"][0] == [str(i) for i in range(len(ratios))]
    empty = s.model_copy(update={"start": 5, "end": 5, "layers": (), "local_layers": 0})
    fig = figures.to_json_dict(figures.layer_map_figure(empty, pool_statuses(empty), [], FAMILY))
    assert fig["layout"]["annotations"][0]["text"] == "this stage owns no layers"


def _live(stage: int, **kw) -> StageLive:
    d = blank_live(stage, POOLS)
    d.update(kw)
    return StageLive.model_validate(d)


def test_live_figures_empty_state_and_one_distinct_trace_per_stage():
    figs = live_figures.live_figures([0, 1, 2], [], [], {}, 10)
    fig = figures.to_json_dict(figs["hit-rate"])
    assert [t["meta"] for t in fig["data"]] == [{"stage": s, "key": "host_hit_rate"} for s in range(3)]
    assert fig["layout"]["annotations"][0]["text"] == live_figures.NO_LIVE_TEXT
    looks = {(t["line"]["color"], t["line"]["dash"], t["marker"]["symbol"]) for t in fig["data"]}
    assert len(looks) == 3 and len({c for c, _, _ in looks}) == 3  # colour, dash and marker differ
    # each stage keeps its colour in every chart
    transfer = figures.to_json_dict(figs["transfer"])
    assert {t["meta"]["stage"]: t["line"]["color"] for t in transfer["data"]} == {
        t["meta"]["stage"]: t["line"]["color"] for t in fig["data"]}


def test_live_figures_plot_each_stage_its_own_history():
    history = {s: [StageRates(stage=s, time=100.0 + i, window_s=10, host_hit_rate=0.1 * s + 0.01 * i)
                   for i in range(3)] for s in range(2)}
    stages = [_live(s) for s in range(2)]
    fig = figures.to_json_dict(live_figures.live_figures([0, 1], stages, [], history, 10)["hit-rate"])
    assert "annotations" not in fig["layout"]
    assert fig["data"][0]["x"] == [100_000.0, 101_000.0, 102_000.0]
    assert fig["data"][0]["y"] == pytest.approx([0.0, 0.01, 0.02])
    assert fig["data"][1]["y"] == pytest.approx([0.1, 0.11, 0.12])


def test_timeline_has_one_trace_per_span_kind_and_a_row_per_stage():
    ev = [{"kind": "compute", "start": 10.0, "seconds": 0.5, "micro_batch": 3},
          {"kind": "recv_wait", "start": 10.5, "seconds": 0.25, "micro_batch": 4}]
    stages = [_live(0, timeline=ev[:1]), _live(1, timeline=ev)]
    fig = figures.to_json_dict(live_figures.timeline_figure([0, 1], stages, True))
    by_kind = {t["meta"]["kind"]: t for t in fig["data"]}
    assert set(by_kind) == set(live_figures.TIMELINE_KINDS)
    assert by_kind["compute"]["base"] == [10_000.0, 10_000.0] and by_kind["compute"]["x"] == [500.0, 500.0]
    assert by_kind["compute"]["y"] == ["stage 0", "stage 1"]
    assert by_kind["recv_wait"]["y"] == ["stage 1"] and by_kind["recv_wait"]["customdata"] == [4]
    assert fig["layout"]["yaxis"]["categoryarray"] == ["stage 0", "stage 1"]


# -- the run's phase ------------------------------------------------------------------------------


def test_run_state_phases():
    ok = parse_report(report("tiny-v4", 2))
    bad = parse_report(report("tiny-v4", 2, ["global-swa"]))
    serving = [_live(s, phase="serving", requests=3 + s, total_requests=8) for s in range(2)]
    assert run_state(None, [], None).phase == "starting"
    assert run_state(ok, [], None).phase == "preflight" and not run_state(ok, [], None).live
    assert run_state(bad, [], None).phase == "preflight"  # a faulty check report: nothing ran
    assert run_state(None, [], {"phase": "starting"}).phase == "starting"
    v = run_state(None, [_live(0), _live(1)], {"phase": "starting"})
    assert (v.phase, v.live) == ("validating", True)
    r = run_state(ok, serving, {"phase": "serving"})
    assert (r.phase, r.live, r.requests_done, r.requests_planned, r.progress) == ("running", True, 3, 8, 3 / 8)
    d = run_state(ok, [_live(s, phase="done", requests=8, total_requests=8) for s in range(2)],
                  {"phase": "done"})
    assert (d.phase, d.live, d.progress) == ("done", False, 1.0)


def test_run_state_failures_are_never_live():
    ok = parse_report(report("tiny-v4", 2))
    bad = parse_report(report("tiny-v4", 2, ["global-swa"]))
    f = run_state(ok, [_live(0, phase="serving"), _live(1, phase="failed", error="boom")], None)
    assert (f.phase, f.live) == ("failed", False) and f.detail == "stage 1 failed: boom"
    f = run_state(ok, [_live(0, phase="serving")], {"phase": "failed", "failure": "stage 1 was killed"})
    assert f.phase == "failed" and f.detail == "stage 1 was killed"
    refused = run_state(bad, [_live(s, phase="refused") for s in range(2)], {"phase": "refused"})
    assert (refused.phase, refused.live) == ("failed", False) and "refused" in refused.detail
    assert run_state(bad, [_live(0)], None).phase == "failed"  # a run whose startup report failed
