"""Pydantic models of the dashboard's JSON API.

The startup report mirrors ``StartupReport.to_dict()`` (runtime/validation/report.py),
so a source that drifts from it is caught at the API boundary with a message
naming the field, instead of surfacing as a broken chart in the browser.  Live
numbers are the runtime's own ``StageLive`` model, used here unchanged.
The rest are the dashboard's own views (stage rows, layer-map cells, probes).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from stagecache.runtime.live.liveness import Liveness
from stagecache.runtime.live.numbers import StageLive

from .rates import StageRates

# -- the startup report (runtime/report.py) ---------------------------------------------


class MappingErrorModel(BaseModel):
    """One validation finding: which stage (None = cross-stage), which pool, expected vs got."""

    stage: int | None
    pool: str
    expected: Any = Field(description="what validation wanted (any JSON value)")
    got: Any = Field(description="what the stage really had (any JSON value)")
    message: str


class LayerEntryModel(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    local: int
    global_id: int = Field(alias="global")
    compress_ratio: int
    compress_layer_id: int | None
    c4_state_id: int | None


class StageReportModel(BaseModel):
    stage: int
    start_layer: int
    end_layer: int
    local_layers: int
    layers: list[LayerEntryModel]
    buffers: dict[str, int]
    expected_buffers: dict[str, int]
    ok: bool
    errors: list[MappingErrorModel]


class StartupReportModel(BaseModel):
    ok: bool
    model: str
    num_layers: int
    pp_size: int
    tp_size: int
    page_size: int
    faults: list[str] = []
    stages: list[StageReportModel]
    errors: list[MappingErrorModel] = Field(description="cross-stage errors (partition tiling)")


# -- dashboard views ----------------------------------------------------------------------


class PoolStatus(BaseModel):
    """One pool of one stage: buffers held vs buffers its local layers need."""

    pool: str
    label: str
    buffers: int
    expected: int
    ok: bool = Field(description="no validation error names this pool on this stage")
    errors: list[str] = Field(description="exact messages of this pool's errors")


class StageRow(BaseModel):
    """A row of the stage table."""

    stage: int
    start_layer: int
    end_layer: int
    local_layers: int
    pools: list[PoolStatus]
    ok: bool
    status: str = Field(description="'OK', or every error message of the stage joined by '; '")
    errors: list[MappingErrorModel]


class StagesResponse(BaseModel):
    model: str
    num_layers: int
    pp_size: int
    tp_size: int
    page_size: int
    faults: list[str]
    ok: bool
    stages: list[StageRow]
    cross_stage_errors: list[MappingErrorModel]


class LayerMapCell(BaseModel):
    """One (pool, global layer) cell of a layer map; absent layers have no cell."""

    model_config = ConfigDict(populate_by_name=True)

    pool: str
    global_id: int = Field(alias="global")
    local: int
    index: int | None = Field(description="buffer index in the pool (local id for SWA, compress id otherwise)")
    compress_ratio: int
    error: str | None = Field(description="why this cell is wrong (id out of range, duplicate, missing)")


class LayerMapResponse(BaseModel):
    stage: int
    start_layer: int
    end_layer: int
    ok: bool
    pools: list[PoolStatus]
    cells: list[LayerMapCell]
    figure: dict[str, Any] = Field(description="Plotly figure JSON (data + layout)")


# -- live numbers: the runtime's own type (one model from stage process to this API) -----------


RunPhase = Literal["preflight", "starting", "validating", "running", "done", "failed"]


class RunState(BaseModel):
    """Where the run is: what the phase badge and the progress bar show."""

    phase: RunPhase = Field(description="preflight (no run: a check report), starting (no stage "
                            "has reported), validating (stages up, no startup report yet), running, "
                            "done, failed (a stage failed or startup validation refused the run)")
    live: bool = Field(description="true only while a run is going (starting, validating, running)")
    detail: str = Field(description="one line for the badge: the failure, the progress, ...")
    requests_done: int = Field(description="requests every stage has finished")
    requests_planned: int = Field(description="requests in the trace (0 until known)")
    progress: float | None = Field(description="requests_done / requests_planned, when known")
    finished_at: float | None = Field(None, description="unix time the run finished (phase done)")


class MetricsSummary(BaseModel):
    status: Literal["starting", "ok", "failed"] = Field(description="startup validation state")
    has_live_numbers: bool = Field(description="false in a preflight view: no stage reports numbers")
    time: float = Field(description="server time of this summary (unix s)")
    run: RunState
    window_s: float = Field(description="the rate window asked for (seconds)")
    rates: list[StageRates] = Field(description="each stage's counters as rates over the window")
    stages: list[StageLive]
    liveness: Liveness | None = Field(
        None, description="readiness verdict: stages up/down, the run's failure and its time")


# -- probes and errors ------------------------------------------------------------------------


class Health(BaseModel):
    status: Literal["ok"]


class StageOk(BaseModel):
    stage: int
    ok: bool


class StartupzOk(BaseModel):
    status: Literal["ok"]
    stages: list[StageOk]


class StartupzFailed(BaseModel):
    status: Literal["failed"]
    stages: list[StageOk]
    errors: list[MappingErrorModel]


class Starting(BaseModel):
    status: Literal["starting"]
    detail: str


class ErrorMessage(BaseModel):
    detail: str
