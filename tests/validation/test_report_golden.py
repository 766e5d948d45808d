"""The stage report is one typed model now; what users read of it stays as it was.

``tests/data/report-golden.json.gz`` holds what ``check --json``, ``pools --json``, the
dashboard's JSON API and ``/metrics`` printed for 83 layouts (every ``--fault``, one at a time
and aimed at stages) before the report became one type.  Every value that existed then must be
there now, unchanged; the only new keys are the ones listed here, each with its reason.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from report_golden import capture_case, cases, load

#: Keys a document may have gained, and why.
ADDED = {
    "family": "the report names its model family (reports of other families parse back by it)",
    "device_bytes": "a stage's report carries every pool's bytes, device ...",
    "host_buffers": "... the buffers its host (HiCache) mirror holds ...",
    "host_bytes": "... and the host mirror's bytes",
    "pool_page_bytes": "/api/startup is check --json: it had left this field out",
    "kind": "a layer-map cell names the layer's kind (its family's legend)",
}

GOLDEN = load()

#: Faults added after the golden outputs were recorded, and where their outputs are held instead.
LATER = {
    "backup-without-indexer": "live only: its plan is the healthy plan (tests/plan/test_mirror.py), what it "
                              "does is serve's (tests/serve/test_serve_transfer_check.py)",
}


def normal(doc: dict[str, Any]) -> dict[str, Any]:
    """``pools --json`` parsed, less what this host's free RAM moves (``this_host``)."""
    code, text = doc["pools"]
    pools = json.loads(text)
    pools.pop("this_host", None)
    return {**doc, "pools": [code, pools]}


def same(before: Any, after: Any, where: str) -> list[str]:
    """Where ``after`` lost or changed anything of ``before`` (additions only from ``ADDED``)."""
    if isinstance(before, dict) and isinstance(after, dict):
        out = [f"{where}.{k}: missing" for k in before if k not in after]
        out += [f"{where}.{k}: not a known addition" for k in after if k not in before and k not in ADDED]
        for k in before.keys() & after.keys():
            out += same(before[k], after[k], f"{where}.{k}")
        return out
    if isinstance(before, list) and isinstance(after, list):
        if len(before) != len(after):
            return [f"{where}: {len(before)} items before, {len(after)} now"]
        return [p for i, (b, a) in enumerate(zip(before, after, strict=True)) for p in same(b, a, f"{where}[{i}]")]
    return [] if before == after else [f"{where}: {before!r:.200} before, {after!r:.200} now"]


@pytest.mark.parametrize("name", [name for name, _ in cases()])
def test_every_output_is_what_it_was(name):
    argv = dict(cases())[name]
    after = capture_case(argv, budget="--mem-budget-gb" in argv)
    before, after = normal(GOLDEN[name]), normal(after)
    assert sorted(after) == sorted(before)
    problems = same(before, after, name)
    assert problems == [], "\n".join(problems[:20])
    if "api" in before:  # /metrics: every line exactly as it was, nothing added
        assert after["api"]["/metrics"] == before["api"]["/metrics"]


def test_every_fault_is_covered():
    from stagecache.runtime.model.families.deepseek_v4 import FAMILY as V4
    from stagecache.runtime.plan.faults import GENERIC_FAULTS

    # DeepSeek V4's faults and every family's; each other family tests its own with its presets
    faults = {k.name for k in (*V4.faults, *GENERIC_FAULTS)} - set(LATER)
    covered = {arg.split("@")[0] for _, argv in cases() for arg in argv if arg in faults or "@" in arg}
    assert covered == faults


def test_a_changed_value_a_lost_key_and_an_unknown_key_are_caught():
    before = {"stages": [{"errors": [{"message": "a"}], "buffers": {"swa": 3}}]}
    after = {"stages": [{"errors": [{"message": "b"}], "family": "x", "extra": 1}]}
    assert same(before, after, "r") == [
        "r.stages[0].buffers: missing", "r.stages[0].extra: not a known addition",
        "r.stages[0].errors[0].message: 'a' before, 'b' now"]
