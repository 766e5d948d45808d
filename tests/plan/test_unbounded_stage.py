"""``--fault unbounded-stage``: a Mamba-hybrid stage without an attention layer sized by its own
token figure (0 bytes per token: sglang's ``int64`` max) instead of the MIN over the PP ranks.

One plan, three readers, as for every fault (tests/plan/test_faults_everywhere.py): ``check`` names
the stage, the pool and its layers in one line, ``pools`` shows the faulted budget and ledger, and
``serve`` (real stage processes) refuses it at startup with the same line; a layout the fault
cannot hit is refused in one line (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from stagecache.runtime.cli.main import main
from stagecache.runtime.model.families import load_spec
from stagecache.runtime.model.family import UNBOUNDED_TOKENS
from stagecache.runtime.plan.faults import parse_faults
from stagecache.runtime.plan.plan import Sizing, build_plan
from stagecache.runtime.validation.deployment import deployment_report
from stagecache.runtime.validation.record import stage_record

PAGE = 256
UNBOUNDED = UNBOUNDED_TOKENS // PAGE * PAGE
#: layouts with stages that hold no attention layer -> those stages
LAYOUTS = {
    ("nemotron-h-8b", "--pp-size", "8"): {0: (0, 6), 2: (12, 18), 5: (31, 38), 7: (45, 52)},
    ("qwen3.5-0.8b", "--pp-size", "4", "--pp-partition", "3,7,7,7"): {0: (0, 3)},
}


def _json(capsys, *argv: str) -> tuple[int, dict]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def _errors(report: dict) -> list[dict]:
    return [e for s in report["stages"] for e in s["errors"]] + list(report["errors"])


@pytest.mark.parametrize("layout", sorted(LAYOUTS), ids=lambda x: x[0])
def test_check_names_each_bare_stage_once_with_pool_and_layers(capsys, layout):
    model, *flags = layout
    healthy_code, healthy = _json(capsys, "check", "--model", model, *flags)
    code, faulted = _json(capsys, "check", "--model", model, *flags, "--fault", "unbounded-stage")
    assert healthy_code == 1 and code == 1  # sglang's own HiCache failure on those stages stays named
    before = {(e["stage"], e["message"]) for e in _errors(healthy)}
    new = [e for e in _errors(faulted) if (e["stage"], e["message"]) not in before]
    bare = LAYOUTS[layout]
    assert sorted(e["stage"] for e in new) == sorted(bare)  # one line per bare stage, nothing else
    for e in new:
        start, end = bare[e["stage"]]
        assert e["pool"] == "attention" and e["got"] == UNBOUNDED and "\n" not in e["message"]
        assert f"stage {e['stage']}: attention KV pool sized for {UNBOUNDED:,} tokens" in e["message"]
        assert f"no attention layer in [{start}, {end}): 0 B per token" in e["message"]
        assert "the MIN over the PP ranks (16,384 tokens here)" in e["message"]
    assert faulted["faults"] == ["unbounded-stage"]


def test_a_layout_the_fault_cannot_hit_is_one_line_exit_2(capsys):
    for argv, words in ((["--model", "nemotron-h-8b", "--pp-size", "4"], "every stage of this partition holds an "
                         "attention layer"),
                        (["--model", "nemotron-h-8b", "--pp-size", "8", "--fault", "unbounded-stage@1"],
                         "stage 1 [6, 12) holds an attention layer"),
                        (["--model", "gpt-oss-20b", "--pp-size", "2"], "not a fault of SWA hybrid models")):
        fault = [] if "--fault" in argv else ["--fault", "unbounded-stage"]
        assert main(["check", *argv, *fault]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err, err


def test_aimed_at_one_stage_only_that_stage_is_sized_alone(capsys):
    _, report = _json(capsys, "check", "--model", "nemotron-h-8b", "--pp-size", "8", "--fault", "unbounded-stage@5")
    hit = {e["stage"] for e in _errors(report) if e["pool"] == "attention"}
    assert hit == {5}


def test_the_plan_sizes_only_the_bare_stages_alone_and_pools_agrees_with_check(capsys):
    flags = ["--model", "qwen3.5-0.8b", "--pp-size", "4", "--pp-partition", "3,7,7,7"]
    _, healthy = _json(capsys, "pools", *flags, "--mem-budget-gb", "6")
    code, pooled = _json(capsys, "pools", *flags, "--mem-budget-gb", "6", "--fault", "unbounded-stage")
    assert code == 0
    tokens = [s["full_tokens"] for s in pooled["stages"]]
    assert tokens[0] == UNBOUNDED and tokens[1:] == [s["full_tokens"] for s in healthy["stages"]][1:]
    assert pooled["stages"][0]["capacity"]["tokens"] == UNBOUNDED
    assert pooled["deployment"]["tokens"] == healthy["deployment"]["tokens"]  # the MIN of the others
    attention = next(p for p in pooled["stages"][0]["pools"] if p["pool"] == "attention")
    assert attention["buffers"] == 0 and attention["device_bytes"] == attention["host_bytes"] == 0
    assert attention["device_pages"] == UNBOUNDED // PAGE
    # the same buffers and bytes per page in check (the plan validated) and pools (the plan sized)
    _, checked = _json(capsys, "check", *flags, "--fault", "unbounded-stage")
    _, runtime = _json(capsys, "pools", *flags, "--fault", "unbounded-stage")
    assert [{p: (s["buffers"][p], s["pool_page_bytes"][p]) for p in s["buffers"]} for s in checked["stages"]] == \
        [{r["pool"]: (r["buffers"], r["present"] * r["page_bytes"]) for r in s["pools"]} for s in runtime["stages"]]
    code = main(["pools", *flags, "--mem-budget-gb", "6", "--fault", "unbounded-stage"])
    text = capsys.readouterr().out
    ledger = [line for line in text.splitlines() if line.strip("│ ").startswith("0 ")][-1]  # the ledger's row
    assert code == 0 and ledger.count("unbounded") == 2  # tokens alone and the tokens it was sized for
    assert f"the deployment holds {healthy['deployment']['tokens']:,} tokens" in text


def test_a_live_deployment_with_capacities_gets_one_line_for_the_stage():
    """Records that carry capacities (a live sglang deployment): the unbounded stage is one error,
    not also the two capacity disagreements."""
    spec = load_spec("nemotron-h-8b")
    plan = build_plan(spec, 8, page_size=PAGE, sizing=Sizing.sglang(mem_budget_bytes=40 << 30),
                      faults=parse_faults(["unbounded-stage@2"], 8, spec.family))
    records = [stage_record(s, capacity=(s.capacity.tokens_alone, s.capacity.tokens)) for s in plan.stages]
    report = deployment_report(records, tp_size=1, page_size=PAGE, faults=["unbounded-stage@2"])
    assert [(e.stage, e.pool) for e in report.all_errors] == [(2, "attention")]
    one = deployment_report(records[2:3], tp_size=1, page_size=PAGE, pp_size=8)  # one rank's own view
    assert [e.expected for e in one.all_errors] == ["a bounded count"]


def test_serve_refuses_it_at_startup_before_allocating(tmp_path, capsys):
    """Two real stage processes; the bare stage never builds its page-id space (it could not),
    reports its plan, and rank 0 refuses the run with the line ``check`` prints."""
    flags = ["--model", "qwen3.5-0.8b", "--pp-size", "2", "--pp-partition", "3,21", "--fault", "unbounded-stage"]
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "stagecache.runtime", "serve", *flags, "--no-dashboard", "--exit-on-error",
         "--requests", "8", "--rate", "0", "--run-dir", str(run_dir)],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "startup validation FAILED: 1 mapping error(s)" in proc.stdout
    lines = [line for line in proc.stdout.splitlines() if line.strip().startswith("[stage")]
    assert len(lines) == 1 and lines[0].strip().startswith("[stage 0] pool=attention"), lines
    served = json.loads((run_dir / "startup.json").read_text())
    _, checked = _json(capsys, "check", *flags)
    unbounded = [e["message"] for e in _errors(checked) if e["pool"] == "attention"]
    assert [e["message"] for e in _errors(served)] == unbounded
