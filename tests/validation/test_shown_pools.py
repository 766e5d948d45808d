"""The pool kinds a startup report shows: every kind some stage holds or needs, and no other.

A family declares every kind it may build (the SWA family: ``swa``, ``full`` and a plain-MHA ``kv``
for the models sglang serves without hybrid memory); a model that uses only some of them must not
show the others as 0/0 rows in ``check``, the dashboard or the metrics.  Checked for every preset at
every pp size sglang splits it into, on the report ``check --json`` prints, the dashboard's rows and
the exporter's samples."""

from __future__ import annotations

import json

import pytest
from stagecache.dashboard.view import layer_map_cells, stage_pools, stages_response
from stagecache.exporters.families import STARTUP_FAMILIES
from stagecache.runtime.cli.main import main
from stagecache.runtime.model.config_file import PRESETS
from stagecache.runtime.model.families import load_spec
from stagecache.runtime.validation.report import StartupReport

LAYOUTS = [(name, pp) for name in sorted(PRESETS) for pp in (1, 2, 4, 8)]


def _check(capsys, *argv: str) -> tuple[int, dict]:
    code = main(["check", *argv, "--json"])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if code in (0, 1) else {})


@pytest.mark.parametrize(("model", "pp"), LAYOUTS, ids=[f"{m}-pp{pp}" for m, pp in LAYOUTS])
def test_every_shown_kind_is_held_or_needed_and_every_used_kind_is_shown(capsys, model, pp):
    code, raw = _check(capsys, "--model", model, "--pp-size", str(pp))
    spec = load_spec(model)
    if code == 2:  # sglang does not split this model that far (or at all): nothing to show
        assert pp > 1
        return
    report = StartupReport.parse(raw, "check --json")
    used = {k.name for k in spec.family.pool_kinds if any(k.owns(kind) for kind in spec.layer_kinds)}
    for s in raw["stages"]:
        for field in ("buffers", "expected_buffers", "pool_page_bytes", "device_bytes", "host_buffers", "host_bytes"):
            assert set(s[field]) == used, (s["stage"], field)
    for pool in used:  # no row with 0 expected buffers on every stage unless some stage really holds it
        assert any(s["buffers"][pool] or s["expected_buffers"][pool] for s in raw["stages"]), pool
    # the dashboard's table header and rows, its layer maps, the exporter's per-pool samples
    rows = stages_response(report).stages
    assert all({p.pool for p in row.pools} == used for row in rows)
    assert set(stage_pools(report.stages[0])) == used
    assert all({c.pool for c in layer_map_cells(s)} <= used for s in report.stages)
    for family in STARTUP_FAMILIES:
        if family.labels == ("pool",):
            assert all({labels[0] for labels, _ in family.samples(s)} == used for s in report.stages)


def test_gpt_oss_has_no_kv_row_and_a_stage_without_attention_keeps_its_empty_one(capsys):
    _, oss = _check(capsys, "--model", "gpt-oss-20b", "--pp-size", "2")
    assert all(set(s["buffers"]) == {"swa", "full"} for s in oss["stages"])
    assert main(["check", "--model", "gpt-oss-20b", "--pp-size", "2"]) == 0
    header = next(line for line in capsys.readouterr().out.splitlines() if "stage" in line and "status" in line)
    assert "swa" in header and "full" in header and " kv " not in header
    # Nemotron-H at pp 8: stage 0 holds no attention layer; the kind is really present elsewhere,
    # so stage 0 shows it empty (0/0) rather than hiding it
    _, nemo = _check(capsys, "--model", "nemotron-h-8b", "--pp-size", "8")
    assert nemo["stages"][0]["buffers"] == {"attention": 0, "mamba": 3}
    assert nemo["stages"][0]["expected_buffers"] == {"attention": 0, "mamba": 3}


def test_a_saved_report_with_an_unused_kind_is_read_without_it(capsys):
    """A report saved before (``kv: 0`` on every stage) reads back with the kinds it shows now."""
    _, raw = _check(capsys, "--model", "gpt-oss-20b", "--pp-size", "2")
    for s in raw["stages"]:
        for field in ("buffers", "expected_buffers", "pool_page_bytes", "device_bytes", "host_buffers", "host_bytes"):
            s[field]["kv"] = 0
    report = StartupReport.parse(raw, "a saved report")
    assert all(set(s.buffers) == set(s.expected) == {"swa", "full"} for s in report.stages)
    assert all({p.pool for p in row.pools} == {"swa", "full"} for row in stages_response(report).stages)
    # a kind an error names stays shown, even with no buffer anywhere
    raw["stages"][1]["errors"] = [{"stage": 1, "pool": "kv", "expected": 0, "got": 1, "message": "odd"}]
    raw["stages"][1]["ok"] = False
    named = StartupReport.parse(raw, "a saved report")
    assert all("kv" in s.buffers for s in named.stages)


@pytest.mark.parametrize("raw", [{"stages": "xx", "model": "m"}, {"stages": [1, "a", {"errors": "zz", "buffers": 5}]},
                                 {"stages": [{"errors": [1, None], "buffers": {"kv": "x"}}]}])
def test_a_malformed_report_is_one_error_line_not_a_traceback(raw):
    from stagecache.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match="not a startup report"):
        StartupReport.parse(raw, "saved.json")
