"""``stagecache check --sglang-storage``: does an sglang backend's L3 key keep PP stages apart?

In this environment (no sglang) the answers come from the documented table; in ``.venv-sglang``
they are computed by calling sglang 0.5.23's own key builders, and must equal the table
(tests/integrations/test_sglang_storage_keys.py, one of the pinned release's comparisons).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from stagecache.runtime.integrations.storage_keys import TABLE, facts, verdict

ROOT = Path(__file__).resolve().parents[2]


def _check(*args: str):
    return subprocess.run([sys.executable, "-W", "ignore", "-m", "stagecache.runtime.cli.main", "check", *args],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)


def test_backends_without_the_pp_rank_are_an_error_under_pp_in_strict_mode():
    proc = _check("--pp-size", "4", "--sglang-storage", "nixl", "--sglang-storage", "file",
                  "--strict", "--json")
    assert proc.returncode == 1, proc.stderr
    found = {f["backend"]: f for f in json.loads(proc.stdout)["sglang_storage"]}
    assert found["nixl"]["level"] == "error" and "do not carry the PP rank" in found["nixl"]["message"]
    assert found["file"]["level"] == "warning" and found["file"]["missing"] == ["dtype", "layout"]
    assert found["nixl"]["table_because"]  # no sglang here: the table, and why


def test_without_strict_a_collision_is_a_warning_and_one_stage_has_none():
    proc = _check("--pp-size", "4", "--sglang-storage", "all", "--json")
    assert proc.returncode == 0, proc.stderr
    levels = {f["backend"]: f["level"] for f in json.loads(proc.stdout)["sglang_storage"]}
    assert levels["hf3fs"] == levels["eic"] == "warning" and levels["tensorcast"] == "ok"
    assert verdict(TABLE["nixl"], pp_size=1)[0] == "warning"  # one stage: nothing to collide with


def test_the_table_names_the_backends_the_issue_lists():
    no_pp = sorted(b for b, f in TABLE.items() if not f.pp_rank)
    assert no_pp == ["eic", "hf3fs", "nixl"]
    assert [b for b, f in TABLE.items() if f.dtype] == ["tensorcast"]
    assert facts("nixl")[0] is TABLE["nixl"]
