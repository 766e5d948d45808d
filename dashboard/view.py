"""Pure functions from a startup report to what the dashboard shows.

The report says *which* pools failed validation; the layer map also needs to
know *which cells* are wrong.  Cell verdicts are derived from the report's own
data (the stage's buffer counts and the ids in its layer entries, read through
its pool kinds), never by parsing error messages, so they stay right when
messages are reworded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from stagecache.runtime.live.liveness import utc_text
from stagecache.runtime.model.families.deepseek_v4 import DeepSeekV4Layer
from stagecache.runtime.model.layer_map import LayerEntry
from stagecache.runtime.validation.report import StageReport, StartupReport

from .models import LayerMapCell, PoolStatus, RunState, StageLive, StageRow, StagesResponse


def stage_pools(stage: StageReport) -> list[str]:
    """The stage's pool kinds as its report names them: its family's kinds in display order,
    then any other kind its buffers name."""
    names = set(stage.buffers) | set(stage.expected)
    return [p for p in stage.pools if p in names] + sorted(names - set(stage.pools))


def pool_label(stage: StageReport, pool: str) -> str:
    return next((k.label for k in stage.kinds if k.name == pool), pool)


def pool_statuses(stage: StageReport) -> list[PoolStatus]:
    """Every pool of the stage, flagged when any validation error names it."""
    out = []
    for pool in stage_pools(stage):
        msgs = [e.message for e in stage.errors if e.pool == pool]
        out.append(PoolStatus(
            pool=pool,
            label=pool_label(stage, pool),
            buffers=stage.buffers.get(pool, 0),
            expected=stage.expected.get(pool, 0),
            ok=not msgs,
            errors=msgs,
        ))
    return out


def stage_row(stage: StageReport) -> StageRow:
    """A report stage as a table row; its pools flagged and its errors joined for the status."""
    return StageRow(stage=stage.stage, start_layer=stage.start, end_layer=stage.end,
                    local_layers=stage.local_layers, pools=pool_statuses(stage), ok=stage.ok,
                    status="OK" if stage.ok else "; ".join(e.message for e in stage.errors),
                    errors=list(stage.errors))


def stages_response(report: StartupReport) -> StagesResponse:
    return StagesResponse(
        model=report.model, num_layers=report.num_layers, pp_size=report.pp_size,
        tp_size=report.tp_size, page_size=report.page_size, faults=list(report.faults), ok=report.ok,
        stages=[stage_row(s) for s in report.stages], cross_stage_errors=list(report.cross_errors))


def cell_index(stage: StageReport, pool: str, entry: LayerEntry) -> tuple[bool, int | None]:
    """(does this layer need a buffer in ``pool``, which index it uses there)."""
    k = next((k for k in stage.kinds if k.name == pool), None)
    if k is None or not k.owns(entry.kind):
        return False, None
    return True, k.index_of(entry)


def layer_map_cells(stage: StageReport) -> list[LayerMapCell]:
    """One cell per (pool, layer that needs that pool), with a reason when the cell is wrong."""
    cells: list[LayerMapCell] = []
    for pool in stage_pools(stage):
        size = stage.buffers.get(pool, 0)
        owner: dict[int, int] = {}  # index -> first global layer using it
        for entry in stage.layers:
            needed, index = cell_index(stage, pool, entry)
            if not needed:
                continue
            error = None
            if index is None:
                error = f"no {pool_label(stage, pool)} index"
            elif not 0 <= index < size:
                error = f"index {index} out of range for {size} buffers"
            elif index in owner:
                error = f"index {index} shared with global layer {owner[index]}"
            if index is not None:
                owner.setdefault(index, entry.global_id)
            cells.append(LayerMapCell(
                pool=pool, global_id=entry.global_id, local=entry.local, index=index, kind=entry.kind,
                compress_ratio=entry.compress_ratio if isinstance(entry, DeepSeekV4Layer) else None,
                error=error,
            ))
    return cells


def _progress(stages: Sequence[StageLive]) -> tuple[int, int, float | None]:
    """Requests through the whole pipeline (the slowest stage) of the trace length."""
    done = min((s.requests for s in stages), default=0)
    planned = max((s.total_requests for s in stages), default=0)
    return done, planned, (min(1.0, done / planned) if planned else None)


def _failure(stages: Sequence[StageLive], run: Mapping[str, Any]) -> str | None:
    """Why the run failed, or None: the parent's verdict first, then a stage's own error."""
    if run.get("phase") == "failed":
        return str(run.get("failure") or "the run failed")
    for s in stages:
        if s.phase == "failed":
            return f"stage {s.stage} failed" + (f": {s.error}" if s.error else "")
    return None


def run_state(report: StartupReport | None, stages: Sequence[StageLive],
              run: Mapping[str, Any] | None) -> RunState:
    """The run's phase for the badge and progress bar, from what the source knows.

    ``run`` is the serving parent's own record (``RunDirSource.run()``), absent
    for other sources.  No stages and no run is a preflight view (a check
    report), never "live".
    """
    run = run or {}
    done, planned, progress = _progress(stages)

    def state(phase: str, detail: str, finished_at: float | None = None) -> RunState:
        return RunState(phase=phase, live=phase in ("starting", "validating", "running"),
                        detail=detail, requests_done=done, requests_planned=planned,
                        progress=1.0 if phase == "done" and planned else progress,
                        finished_at=finished_at)

    failure = _failure(stages, run)
    if failure:
        return state("failed", failure)
    refused = run.get("phase") == "refused" or any(s.phase == "refused" for s in stages)
    if refused or (stages and report is not None and not report.ok):
        return state("failed", "startup validation refused the run (see the stage table)")
    if not stages and not run:
        if report is not None:
            return state("preflight", "preflight view: a check report, no run")
        return state("starting", "waiting for the stages to report")
    if run.get("phase") == "done" or (stages and all(s.phase == "done" for s in stages)):
        at = run.get("finished_at") or max((s.time for s in stages if s.time), default=None)
        when = f" at {utc_text(at)}" if at else ""
        return state("done", f"run finished{when}: {done} requests served", finished_at=at)
    if report is None:
        if stages:
            return state("validating", "stages are building and validating their pools")
        return state("starting", "starting the stage processes")
    return state("running", f"{done}/{planned} requests" if planned else "serving")
