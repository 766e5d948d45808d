"""Pydantic models of the dashboard's own views: stage rows, layer-map cells, run state, probes.

The startup report (``validation.report.StartupReport``) and the live numbers
(``live.numbers.StageLive``) are the runtime's own models, served here unchanged.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from stagecache.runtime.errors import MappingError
from stagecache.runtime.live.liveness import Liveness
from stagecache.runtime.live.numbers import StageLive

from .outages import Outage
from .rates import StageRates

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
    errors: list[MappingError]


class StagesResponse(BaseModel):
    model: str
    num_layers: int
    pp_size: int
    tp_size: int
    page_size: int
    faults: list[str]
    ok: bool
    stages: list[StageRow]
    cross_stage_errors: list[MappingError]


class LayerMapCell(BaseModel):
    """One (pool, global layer) cell of a layer map; absent layers have no cell."""

    model_config = ConfigDict(populate_by_name=True)

    pool: str
    global_id: int = Field(alias="global")
    local: int
    index: int | None = Field(description="buffer index in the pool (the layer's id in the pool kind's "
                              "numbering: local id for DeepSeek V4's SWA, compress id otherwise)")
    kind: str = Field(description="the layer's cache kind (its family's legend)")
    compress_ratio: int | None = Field(description="DeepSeek V4: the layer's compress ratio (null for "
                                       "other families)")
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
    outages: list[Outage] = Field(default_factory=list, description="each stage's gaps (unreachable, "
                                  "stale, crashed), start and end on this server's clock")


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
    errors: list[MappingError]


class Starting(BaseModel):
    status: Literal["starting"]
    detail: str


class ErrorMessage(BaseModel):
    detail: str
