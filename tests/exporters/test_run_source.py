"""RunDirSource: the parent's view of the stage processes' snapshot files."""

from __future__ import annotations

import json
import multiprocessing as mp

from live_helpers import blank_live
from plans import report
from stagecache.runtime.live import run_dir as rd
from stagecache.runtime.live.run_dir import RunDirSource
from stagecache.runtime.live.source import SnapshotSource


def test_empty_run_dir_is_starting(tmp_path):
    src = RunDirSource(tmp_path)
    assert isinstance(src, SnapshotSource)
    assert src.startup() is None and src.stages() == {} and src.run() is None


def test_reads_startup_and_stage_files(tmp_path):
    rd.write_json_atomic(tmp_path / rd.STARTUP_FILE, report("tiny-v4", 2).to_dict())
    d = blank_live(1, ("swa",))
    d["requests"] = 7
    rd.write_json_atomic(rd.stage_file(tmp_path, 1), d)
    rd.write_json_atomic(rd.stage_file(tmp_path, 0), blank_live(0))
    src = RunDirSource(tmp_path)
    assert src.startup() == report("tiny-v4", 2)
    stages = src.stages()
    assert list(stages) == [0, 1] and stages[1].requests == 7
    snap = src.snapshot()
    assert set(snap) == {"run", "startup", "stages"} and set(snap["stages"]) == {"0", "1"}
    json.dumps(snap)  # the snapshot document is plain JSON


def test_partial_stage_file_gets_every_key(tmp_path):
    # a stage that failed before building its cache writes only what it knows
    rd.write_json_atomic(rd.stage_file(tmp_path, 3), {"stage": 3, "phase": "failed", "error": "boom",
                                                      "cache_tokens": {"miss": 5}})
    s = RunDirSource(tmp_path).stages()[3]
    assert set(blank_live(3)) == set(s.model_dump())
    assert s.cache_tokens.model_dump() == {"device": 0, "host": 0, "storage": 0, "miss": 5}
    assert s.error == "boom" and s.phase == "failed" and s.requests == 0


def test_a_stage_file_of_another_shape_is_not_shown(tmp_path):
    # a typo'd or foreign field is refused at the boundary, not silently dropped
    rd.write_json_atomic(rd.stage_file(tmp_path, 1), {"stage": 1, "cache_tokenz": {"miss": 5}})
    rd.write_json_atomic(rd.stage_file(tmp_path, 2), {"stage": 2, "requests": 4})
    assert list(RunDirSource(tmp_path).stages()) == [2]


def test_torn_or_foreign_files_are_ignored(tmp_path):
    (tmp_path / "stage-2.json").write_text('{"stage": 2, "req')  # what a non-atomic writer leaves
    (tmp_path / "stage-x.json").write_text("{}")
    (tmp_path / rd.STARTUP_FILE).write_text("[1, 2")
    src = RunDirSource(tmp_path)
    assert src.stages() == {} and src.startup() is None


def _writer(path: str, n: int) -> None:
    for i in range(n):
        rd.write_json_atomic(path, {"i": i, "pad": "x" * 20000})


def test_atomic_writes_are_never_seen_half_written(tmp_path):
    path = str(tmp_path / "stage-0.json")
    rd.write_json_atomic(path, {"i": -1, "pad": ""})
    proc = mp.get_context("spawn").Process(target=_writer, args=(path, 300))
    proc.start()
    seen = 0
    while proc.is_alive() or seen == 0:
        data = rd.read_json(path)
        assert data is not None and "i" in data  # never torn, never missing
        seen += 1
    proc.join()
    assert proc.exitcode == 0
    assert rd.read_json(path)["i"] == 299
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
