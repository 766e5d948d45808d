"""The DSA, MLA and MHA families' faults: ``check`` exits 1 naming the stage, the pool and the layer,
``serve`` refuses at startup (real stage processes), and every healthy preset layout is valid.

sglang 0.5.23 itself builds every legal partition of these families (tests/integrations: every
GLM-5.2 split tried builds, the #28525 fix is in), so their ``stage_problems`` stay empty.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from stagecache.runtime.cli.main import main
from stagecache.runtime.model.families import dsa, mha, mla

PRESETS = {"glm-5.2": dsa, "deepseek-v3.2": dsa, "deepseek-v3": mla, "llama-3.1-8b": mha}


def check_json(capsys, *argv: str) -> tuple[int, dict]:
    code = main(["check", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def errors(report: dict) -> list[dict]:
    return [e for s in report["stages"] for e in s["errors"]] + list(report["errors"])


@pytest.mark.parametrize("model", sorted(PRESETS))
@pytest.mark.parametrize("pp", [1, 2, 4, 8])
def test_every_preset_layout_is_valid(capsys, model, pp):
    code, report = check_json(capsys, "--model", model, "--pp-size", str(pp))
    assert (code, errors(report), report["family"]) == (0, [], PRESETS[model].FAMILY.name)


@pytest.mark.parametrize(("model", "fault", "pool"), [("glm-5.2", "global-dsa", "kv"),
                                                       ("deepseek-v3", "global-mla", "kv"),
                                                       ("llama-3.1-8b", "global-mha", "kv")])
def test_a_pool_sized_by_the_global_count_is_caught(capsys, model, fault, pool):
    code, report = check_json(capsys, "--model", model, "--pp-size", "4", "--fault", f"{fault}@2")
    assert code == 1
    (err, *rest) = [e for e in errors(report) if e["pool"] == pool]
    assert err["stage"] == 2 and err["got"] > err["expected"] and "PP-stage-local" in err["message"]
    assert [s["stage"] for s in report["stages"] if s["errors"]] == [2]


def test_global_dsa_sizes_the_indexer_by_the_models_computing_layers(capsys):
    code, report = check_json(capsys, "--model", "glm-5.2", "--pp-size", "2", "--fault", "global-dsa@1")
    (err,) = [e for e in errors(report) if e["pool"] == "indexer"]
    assert (code, err["stage"], err["expected"], err["got"]) == (1, 1, 9, 21)


def test_indexer_ids_counted_globally_name_each_layer(capsys):
    code, report = check_json(capsys, "--model", "glm-5.2", "--pp-size", "2", "--fault", "global-indexer-ids")
    errs = errors(report)
    assert code == 1 and {e["stage"] for e in errs} == {1} and {e["pool"] for e in errs} == {"indexer"}
    assert [e["got"] for e in errs] == list(range(12, 21))  # stage 0 numbers 12 computing layers
    assert "global layer 42: indexer_id 12 is out of range for the stage's 9 DSA indexer buffers" in errs[0]["message"]


def test_a_stage_starting_on_a_shared_topk_layer_without_the_topk_is_caught(capsys):
    """#28525: GLM-5.2 at pp 2 starts stage 1 on layer 39, which reuses layer 38's top-k."""
    code, healthy = check_json(capsys, "--model", "glm-5.2", "--pp-size", "2")
    first = healthy["stages"][1]["layers"][0]
    assert (code, first["global"], first["topk"], first["topk_from"]) == (0, 39, "shared", 38)
    code, report = check_json(capsys, "--model", "glm-5.2", "--pp-size", "2", "--fault", "shared-topk-start")
    (err,) = errors(report)
    assert (code, err["stage"], err["pool"], err["got"]) == (1, 1, "indexer", 39)
    assert "global layer 39" in err["message"] and "layer 38" in err["message"] and "#28525" in err["message"]
    # a stage starting on a layer that computes its own top-k is not hit
    code, report = check_json(capsys, "--model", "glm-5.2", "--pp-size", "2", "--pp-partition", "38,40",
                              "--fault", "shared-topk-start")
    assert (code, errors(report)) == (0, [])


def test_indexer_left_out_of_the_host_set_is_caught(capsys):
    """#38031: HiCache backs up the MLA KV but not the index keys."""
    code, report = check_json(capsys, "--model", "glm-5.2", "--pp-size", "4", "--pp-partition", "3,3,33,39",
                              "--fault", "indexer-not-host-cached")
    errs = errors(report)
    # stage 1 ([3, 6)) has no computing layer: nothing to leave out there
    assert code == 1 and [(e["stage"], e["pool"], e["expected"], e["got"]) for e in errs] == [
        (0, "indexer", 3, 0), (2, "indexer", 9, 0), (3, "indexer", 9, 0)]
    assert "layers 0, 1, 2" in errs[0]["message"] and "HiCache host set" in errs[0]["message"]
    assert report["stages"][0]["host_buffers"] == {"kv": 3, "indexer": 0}


def test_a_family_refuses_another_familys_fault(capsys):
    assert main(["check", "--model", "llama-3.1-8b", "--fault", "shared-topk-start"]) == 2
    assert "not a fault of MHA models" in capsys.readouterr().err


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", ["shared-topk-start", "indexer-not-host-cached@1"])
def test_serve_refuses_at_startup(tmp_path, fault):
    proc = subprocess.run(
        [sys.executable, "-m", "stagecache.runtime", "serve", "--model", "glm-5.2", "--pp-size", "2",
         "--page-size", "64", "--device-pages", "128", "--requests", "8", "--no-dashboard", "--exit-after-run",
         "--run-dir", str(tmp_path / "run"), "--fault", fault],
        capture_output=True, text=True, timeout=280)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "startup validation FAILED" in proc.stdout and "[stage 1] pool=indexer" in proc.stdout
    assert "not serving traffic" in proc.stdout


@pytest.mark.parametrize("model", sorted(PRESETS))
def test_check_at_pp_8_is_fast(model):
    """``check`` of the preset at pp 8: the median of 20 runs well under 50 ms (bench check measures it)."""
    import statistics
    import time

    from stagecache.runtime.plan.inputs import resolve_plan
    from stagecache.runtime.validation.deployment import preflight

    def once() -> float:
        t0 = time.perf_counter()
        assert preflight(resolve_plan(model, 8)).ok
        return time.perf_counter() - t0

    assert statistics.median(once() for _ in range(20)) < 0.050
