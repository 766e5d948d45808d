"""Pure view functions and figures: cell verdicts come from the report's data, not its messages."""

from __future__ import annotations

import copy

import pytest
from stagecache.dashboard import figures
from stagecache.dashboard.models import StageLive
from stagecache.dashboard.view import (
    ReportShapeError,
    layer_map_cells,
    parse_report,
    pool_statuses,
    stages_response,
)
from stagecache.exporters.snapshot import empty_stage_numbers
from stagecache.runtime.model.layer_map import build_layout
from stagecache.runtime.model.pool_kinds import POOLS
from stagecache.runtime.model.spec import load_spec
from stagecache.runtime.validation.faults import parse_faults
from stagecache.runtime.validation.report import preflight


def report(model: str, pp: int, faults: list[str] = ()) -> dict:
    return preflight(build_layout(load_spec(model), pp), 256, parse_faults(list(faults), pp)).to_dict()


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
        assert {p: sum(c.pool == p for c in cells) for p in POOLS} == stage.expected_buffers
        for c in cells:
            assert stage.start_layer <= c.global_id < stage.end_layer


def test_parse_report_names_the_wrong_fields():
    raw = report("tiny-v4", 2)
    del raw["stages"][1]["buffers"]
    raw["pp_size"] = "two"
    with pytest.raises(ReportShapeError) as exc:
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


def test_layer_map_figure_colours_by_ratio_and_handles_an_empty_stage():
    rep = parse_report(report("tiny-v4", 1))
    s = rep.stages[0]
    fig = figures.to_json_dict(figures.layer_map_figure(s, pool_statuses(s), layer_map_cells(s)))
    z = fig["data"][0]["z"]
    swa_row = z[POOLS.index("swa")]
    ratios = [e.compress_ratio for e in s.layers]
    assert swa_row == [figures.RATIO_CLASS[r] for r in ratios]
    assert fig["data"][0]["text"][0] == [str(i) for i in range(len(ratios))]
    empty = s.model_copy(update={"start_layer": 5, "end_layer": 5, "layers": [], "local_layers": 0})
    fig = figures.to_json_dict(figures.layer_map_figure(empty, pool_statuses(empty), []))
    assert fig["layout"]["annotations"][0]["text"] == "this stage owns no layers"


def test_live_figures_empty_state_and_one_trace_per_stage():
    fig = figures.to_json_dict(figures.hit_ratio_figure([0, 1, 2], 0.0, []))
    assert [t["meta"]["stage"] for t in fig["data"]] == [0, 1, 2]
    assert fig["layout"]["annotations"][0]["text"] == figures.NO_LIVE_TEXT
    live = [StageLive.model_validate(empty_stage_numbers(s, POOLS)) for s in range(2)]
    fig = figures.to_json_dict(figures.bandwidth_figure([0, 1], 1000.0, live))
    assert len(fig["data"]) == 4 and "annotations" not in fig["layout"]
    assert fig["data"][0]["x"] == [1000.0]
