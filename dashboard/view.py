"""Pure functions from a startup report to what the dashboard shows.

The report says *which* pools failed validation; the layer map also needs to
know *which cells* are wrong.  Cell verdicts are derived from the report's own
data (the stage's buffer counts and the ids in its layer entries), never by
parsing error messages, so they stay right when messages are reworded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError
from stagecache.runtime.live.liveness import utc_text
from stagecache.runtime.model.pool_kinds import KINDS, POOLS

from .models import (
    LayerEntryModel,
    LayerMapCell,
    PoolStatus,
    RunState,
    StageLive,
    StageReportModel,
    StageRow,
    StagesResponse,
    StartupReportModel,
)


class ReportShapeError(ValueError):
    """The source's report does not have the ``StartupReport.to_dict()`` shape."""


def parse_report(report: Mapping[str, Any]) -> StartupReportModel:
    """Validate a report dict; one readable line per wrong field instead of a traceback."""
    try:
        return StartupReportModel.model_validate(report)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(top level)'}: {err['msg']}"
            for err in exc.errors()[:5]
        )
        more = f" (+{exc.error_count() - 5} more)" if exc.error_count() > 5 else ""
        raise ReportShapeError(f"not a startup report: {problems}{more}") from None


def stage_pools(stage: StageReportModel) -> list[str]:
    """The stage's pool kinds as its report names them: known kinds in display order, then others."""
    names = set(stage.buffers) | set(stage.expected_buffers)
    return [p for p in POOLS if p in names] + sorted(names - set(POOLS))


def pool_statuses(stage: StageReportModel) -> list[PoolStatus]:
    """Every pool of the stage, flagged when any validation error names it."""
    out = []
    for pool in stage_pools(stage):
        msgs = [e.message for e in stage.errors if e.pool == pool]
        out.append(PoolStatus(
            pool=pool,
            label=KINDS[pool].label,
            buffers=stage.buffers.get(pool, 0),
            expected=stage.expected_buffers.get(pool, 0),
            ok=not msgs,
            errors=msgs,
        ))
    return out


def _shared(source: BaseModel, target: type[BaseModel]) -> dict:
    """The fields ``target`` takes over from ``source`` unchanged (same name, same meaning)."""
    return {k: getattr(source, k) for k in target.model_fields if k in type(source).model_fields}


def stage_row(stage: StageReportModel) -> StageRow:
    """A report stage as a table row; its pools flagged and its errors joined for the status."""
    return StageRow(**_shared(stage, StageRow) | {
        "pools": pool_statuses(stage),
        "status": "OK" if stage.ok else "; ".join(e.message for e in stage.errors),
    })


def stages_response(report: StartupReportModel) -> StagesResponse:
    return StagesResponse(**_shared(report, StagesResponse) | {
        "stages": [stage_row(s) for s in report.stages],
        "cross_stage_errors": report.errors,
    })


def cell_index(pool: str, entry: LayerEntryModel) -> tuple[bool, int | None]:
    """(does this layer need a buffer in ``pool``, which index it uses there)."""
    k = KINDS[pool]
    if not k.owns(entry.compress_ratio):
        return False, None
    return True, k.index_of(entry)


def layer_map_cells(stage: StageReportModel) -> list[LayerMapCell]:
    """One cell per (pool, layer that needs that pool), with a reason when the cell is wrong."""
    cells: list[LayerMapCell] = []
    for pool in stage_pools(stage):
        size = stage.buffers.get(pool, 0)
        owner: dict[int, int] = {}  # index -> first global layer using it
        for entry in stage.layers:
            needed, index = cell_index(pool, entry)
            if not needed:
                continue
            error = None
            if index is None:
                error = f"no {KINDS[pool].label} index"
            elif not 0 <= index < size:
                error = f"index {index} out of range for {size} buffers"
            elif index in owner:
                error = f"index {index} shared with global layer {owner[index]}"
            if index is not None:
                owner.setdefault(index, entry.global_id)
            cells.append(LayerMapCell(
                pool=pool,
                global_id=entry.global_id,
                local=entry.local,
                index=index,
                compress_ratio=entry.compress_ratio,
                error=error,
            ))
    return cells


def find_stage(report: StartupReportModel, stage: int) -> StageReportModel | None:
    return next((s for s in report.stages if s.stage == stage), None)


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


def run_state(report: StartupReportModel | None, stages: Sequence[StageLive],
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
