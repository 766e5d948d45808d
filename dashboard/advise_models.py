"""Pydantic model of an advise report (``stagecache advise --json``; ``sizing/advice.py``).

A saved report is user input to the dashboard (``stagecache dashboard --advise FILE``), so it
is checked here, field by field and with size limits, before a figure is drawn from it; the
same model is ``/api/advise``'s response.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

Rate = Annotated[float, Field(ge=0.0, le=1.0)]
#: Points of a sampled curve a report may carry (``advise`` writes about 400).
MAX_CURVE_POINTS = 20_000
MAX_STAGES = 4096


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class CurvePoint(_Model):
    pages: int = Field(ge=0)
    hit_rate: Rate
    share_of_ceiling: Rate


class HostTarget(CurvePoint):
    hicache_ratio: float | None = Field(gt=0.0, description="None: the device tier alone reaches it")


class DeviceTarget(CurvePoint):
    max_total_tokens: int = Field(ge=0)


class Target(_Model):
    share: float = Field(gt=0.0, le=1.0, description="share of the infinite-cache hit rate")
    host: HostTarget
    device: DeviceTarget


class Knee(_Model):
    host: CurvePoint
    device: CurvePoint


class Configured(_Model):
    device_pages: int = Field(ge=0)
    host_pages: int = Field(ge=0)
    max_total_tokens: int = Field(ge=0)
    hicache_ratio: float = Field(gt=0.0)
    device_hit_rate: Rate
    hit_rate: Rate


class BeladyPoint(_Model):
    pages: int = Field(ge=0)
    hit_rate: Rate
    lru_hit_rate: Rate


class Curve(_Model):
    pages: list[int] = Field(min_length=1, max_length=MAX_CURVE_POINTS)
    hit_rate: list[Rate] = Field(min_length=1, max_length=MAX_CURVE_POINTS)
    device_hit_rate: list[Rate] = Field(min_length=1, max_length=MAX_CURVE_POINTS)

    @model_validator(mode="after")
    def _aligned(self) -> Curve:
        if not len(self.pages) == len(self.hit_rate) == len(self.device_hit_rate):
            raise ValueError("curve: pages, hit_rate and device_hit_rate must have equal lengths")
        if any(b < a for a, b in zip(self.pages, self.pages[1:], strict=False)):
            raise ValueError("curve: pages must be sorted")
        return self


class StageTarget(_Model):
    share: float
    host_bytes: int = Field(ge=0)
    device_bytes: int = Field(ge=0)


class StageBytes(_Model):
    host_bytes: int = Field(ge=0)
    device_bytes: int = Field(ge=0)


class StageAdvice(_Model):
    stage: int = Field(ge=0)
    start_layer: int
    end_layer: int
    token_page_bytes: int = Field(gt=0)
    targets: list[StageTarget] = Field(max_length=64)
    knee: StageBytes
    configured: StageBytes
    capacity: dict[str, int] | None = None


class TraceSummary(_Model):
    source: str = Field(max_length=4096)
    format: str = Field(max_length=32)
    requests: int = Field(ge=0)
    input_tokens: int = Field(ge=0)
    lookup_pages: int = Field(ge=0)
    distinct_pages: int = Field(ge=0)
    page_size: int = Field(gt=0)
    repeated_requests: int = Field(ge=0)
    lines_read: int = Field(default=0, ge=0)
    bad_lines: int = Field(default=0, ge=0)
    skipped_lines: list[Annotated[str, Field(max_length=4096)]] = Field(default=[], max_length=100)


class PlanSummary(_Model):
    model: str = Field(max_length=4096)
    pp_size: int = Field(ge=1)
    tp_size: int = Field(ge=1)
    page_size: int = Field(gt=0)
    partition: list[int] | None = None
    sizing: dict[str, Any]


Label = Annotated[str, Field(max_length=512)]
MAX_POLICIES = 16


class PolicyInfo(_Model):
    name: str = Field(max_length=32)
    label: Label
    config: dict[str, int] = Field(default={}, max_length=8)
    flags: str = Field(max_length=1024)


class PolicySize(_Model):
    mark: str = Field(max_length=32)
    pages: int = Field(ge=0)
    lru_curve_hit_rate: Rate
    belady_hit_rate: Rate | None = None
    hit_rate: dict[Label, Rate] = Field(max_length=MAX_POLICIES)
    best: Label


class PolicyTarget(_Model):
    share: float = Field(gt=0.0, le=1.0)
    pages: dict[Label, int | None] = Field(max_length=MAX_POLICIES)
    best: Label | None = None
    best_pages: int | None = Field(default=None, ge=0)
    lru_pages: int | None = Field(default=None, ge=0)
    pages_saved_vs_lru: int | None = None
    flags: str | None = Field(default=None, max_length=2048)


class PolicyTier(_Model):
    tier: str = Field(pattern="^(device|host)$")
    ceiling_hit_rate: Rate
    sizes: list[PolicySize] = Field(max_length=64)
    targets: list[PolicyTarget] = Field(max_length=16)


class PolicyStageTarget(_Model):
    tier: str = Field(pattern="^(device|host)$")
    share: float = Field(gt=0.0, le=1.0)
    best: Label | None = None
    bytes: int | None = Field(default=None, ge=0)
    lru_bytes: int | None = Field(default=None, ge=0)
    saved_bytes: int | None = None


class PolicyStage(_Model):
    stage: int = Field(ge=0)
    device_page_bytes: int = Field(ge=0)
    host_page_bytes: int = Field(ge=0)
    targets: list[PolicyStageTarget] = Field(max_length=64)


class PoliciesReport(_Model):
    """``advise --policies``: sglang's eviction policies at the marked sizes, per tier and stage."""

    source: str = Field(max_length=128)
    policies: list[PolicyInfo] = Field(min_length=1, max_length=MAX_POLICIES)
    tiers: list[PolicyTier] = Field(min_length=1, max_length=2)
    stages: list[PolicyStage] = Field(min_length=1, max_length=MAX_STAGES)
    unreduced_pools: list[Annotated[str, Field(max_length=128)]] = Field(default=[], max_length=256)
    notes: list[Annotated[str, Field(max_length=4096)]] = Field(default=[], max_length=64)


class AdviseReport(_Model):
    """What ``stagecache advise --json`` prints (the fields the dashboard reads, checked)."""

    trace: TraceSummary
    plan: PlanSummary
    ceiling_hit_rate: Rate
    targets: list[Target] = Field(max_length=64)
    knee: Knee
    configured: Configured
    belady: list[BeladyPoint] = Field(max_length=256)
    curve: Curve
    stages: list[StageAdvice] = Field(min_length=1, max_length=MAX_STAGES)
    deployment: dict[str, int] | None = None
    notes: list[Annotated[str, Field(max_length=4096)]] = Field(default=[], max_length=64)
    full_pages: dict[str, int] | None = None
    seconds: dict[str, float] | None = None
    policies: PoliciesReport | None = None


class AdviseResponse(BaseModel):
    """``/api/advise``: the report and the Plotly figure the page draws from it."""

    report: AdviseReport
    figure: dict[str, Any] = Field(description="Plotly figure JSON (hit rate vs host GiB per stage)")
    policy_figure: dict[str, Any] | None = Field(
        default=None, description="Plotly figure JSON of the eviction policies per tier (a report "
                                  "made with --policies), else null")
