"""Liveness without processes: the verdict, the heartbeat writer, the cached run-dir reader, the probes.

The verdict (``serve.liveness.assess``) is one pure function that ``/readyz``,
``stagecache_stage_up`` and the supervisor all use; these tests pin what each
input does to it, then check that the probe and the gauges really say the same.
"""

from __future__ import annotations

import threading
import time

import httpx
from plans import report
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from stagecache.dashboard.server import dashboard_in_thread
from stagecache.exporters.metrics import make_registry
from stagecache.runtime.live import run_dir as rd
from stagecache.runtime.live.liveness import assess
from stagecache.runtime.live.numbers import RunInfo, StageLive
from stagecache.runtime.serve.heartbeat import Heartbeat, StageFile

NOW = 1_800_000_000.0
REPORT = report("tiny-v4", 2)


def live(stage: int, beat_age: float | None, phase: str = "serving", error: str | None = None) -> StageLive:
    beat = None if beat_age is None else NOW - beat_age
    return StageLive(stage=stage, pid=100 + stage, phase=phase, error=error, heartbeat_at=beat)


def run(phase: str = "serving", **kw) -> RunInfo:
    return RunInfo(phase=phase, pp_size=2, pids={0: 100, 1: 101}, exit_codes={0: None, 1: None},
                   heartbeat_timeout_s=5.0, **kw)


def test_fresh_heartbeats_valid_maps_and_a_serving_run_are_ready():
    v = assess(run(), REPORT, {0: live(0, 0.5), 1: live(1, 4.9)}, NOW)
    assert v.ready and v.reasons == [] and [h.up for h in v.stages] == [True, True]


def test_a_stale_heartbeat_is_down_with_its_age_and_the_limit():
    v = assess(run(), REPORT, {0: live(0, 0.5), 1: live(1, 7.25)}, NOW)
    assert not v.ready
    assert [h.up for h in v.stages] == [True, False]
    assert v.reasons == ["stage 1: no heartbeat for 7.2 s (limit 5 s)"]


def test_an_exited_stage_is_down_even_with_a_fresh_heartbeat():
    info = run(phase="failed", failure="stage 0 (pid 100) exited with code -9", failed_stage=0,
               failed_at=NOW - 1)
    info.exit_codes[0] = -9
    v = assess(info, REPORT, {0: live(0, 0.1), 1: live(1, 0.1)}, NOW)
    assert not v.ready and v.failed_stage == 0 and v.failed_at == NOW - 1
    assert v.stages[0].reason == "process exited with code -9" and v.stages[1].up
    assert v.reasons[0] == "run is failed: stage 0 (pid 100) exited with code -9"


def test_startup_not_reported_or_failed_is_not_ready():
    stages = {0: live(0, 0.1), 1: live(1, 0.1)}
    assert "has not been reported" in assess(run(), None, stages, NOW).reasons[0]
    bad = report("tiny-v4", 2, ["global-swa"])
    assert "startup validation failed" in assess(run(), bad, stages, NOW).reasons[0]


def test_a_stage_still_starting_is_not_ready_though_the_run_serves():
    """Rank 0 wrote the report (the run serves) before stage 1 took the verdict."""
    v = assess(run(), REPORT, {0: live(0, 0.1), 1: live(1, 0.1, phase="starting")}, NOW)
    assert not v.ready and v.reasons == ["stage 1: still starting"]
    assert [h.up for h in v.stages] == [True, False]


def test_a_stage_that_failed_or_never_reported_is_down():
    v = assess(run(), REPORT, {0: live(0, 0.1, phase="failed", error="ValueError: x")}, NOW)
    assert v.stages[0].reason == "failed: ValueError: x" and v.stages[0].error == "ValueError: x"
    assert v.stages[1].reason == "has not reported yet"  # pp_size 2 names stage 1 though it is absent


def test_without_a_serving_parent_the_report_time_counts_as_a_beat():
    """Sources with no heartbeat thread (sglang) still show up while they report."""
    stages = {0: StageLive(stage=0, time=NOW - 1), 1: StageLive(stage=1, time=NOW - 60)}
    v = assess(None, REPORT, stages, NOW)
    assert v.phase == "unknown" and [h.up for h in v.stages] == [True, False]


def test_heartbeat_thread_beats_while_the_main_thread_waits(tmp_path):
    sf = StageFile(rd.stage_file(tmp_path, 0))
    sf.publish(StageLive(stage=0, steps=3))
    first = rd.RunDirSource(tmp_path).stages()[0].heartbeat_at
    hb = Heartbeat(sf, interval=0.05).start()
    try:
        threading.Event().wait(0.4)  # the main thread blocks, like a stage in recv
    finally:
        hb.stop()
    later = rd.RunDirSource(tmp_path).stages()[0]
    assert later.heartbeat_at > first + 0.2
    assert later.steps == 3  # the beat re-stamps the last numbers, never older ones


def test_run_dir_source_parses_a_file_again_only_when_it_changed(tmp_path):
    src = rd.RunDirSource(tmp_path)
    rd.write_text_atomic(rd.stage_file(tmp_path, 1), StageLive(stage=1, steps=1).model_dump_json())
    a, b = src.stages()[1], src.stages()[1]
    assert a is b and a.steps == 1
    rd.write_text_atomic(rd.stage_file(tmp_path, 1), StageLive(stage=1, steps=2).model_dump_json())
    assert src.stages()[1].steps == 2
    assert src.run() is None
    rd.write_text_atomic(tmp_path / rd.RUN_FILE, run().model_dump_json())
    assert src.run().pids == {0: 100, 1: 101}


def _fresh_run_dir(tmp_path, stale_stage: int | None) -> rd.RunDirSource:
    now = time.time()
    rd.write_json_atomic(tmp_path / rd.STARTUP_FILE, REPORT.to_dict())
    rd.write_text_atomic(tmp_path / rd.RUN_FILE, run().model_dump_json())
    for k in range(2):
        beat = now - (30 if k == stale_stage else 0.2)
        rd.write_text_atomic(rd.stage_file(tmp_path, k),
                             StageLive(stage=k, pid=100 + k, phase="serving",
                                       heartbeat_at=beat).model_dump_json())
    return rd.RunDirSource(tmp_path)


def _gauges(source) -> dict[tuple[str, str], float]:
    text = generate_latest(make_registry(source)).decode()
    return {(s.name, s.labels.get("pp_rank", "")): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_readyz_and_the_stage_up_gauge_give_the_same_verdict(tmp_path, free_port):
    with dashboard_in_thread(_fresh_run_dir(tmp_path, stale_stage=None), port=free_port) as url:
        ok = httpx.get(f"{url}/readyz", timeout=10)
    assert ok.status_code == 200 and ok.json()["ready"] is True
    stale_dir = tmp_path / "stale"
    stale_dir.mkdir()
    source = _fresh_run_dir(stale_dir, stale_stage=1)
    with dashboard_in_thread(source, port=free_port) as url:
        bad = httpx.get(f"{url}/readyz", timeout=10)
        assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200  # the process is fine
    assert bad.status_code == 503
    [reason] = bad.json()["reasons"]
    assert reason.startswith("stage 1: no heartbeat for 3") and reason.endswith(" s (limit 5 s)")
    g = _gauges(source)
    assert g[("stagecache_stage_up", "0")] == 1 and g[("stagecache_stage_up", "1")] == 0
    beat = g[("stagecache_stage_last_heartbeat_timestamp_seconds", "1")]
    assert abs(beat - (time.time() - 30)) < 5
