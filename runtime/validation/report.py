"""The startup report: every stage's map, buffers, bytes and errors, plus cross-stage errors.

Built by ``check`` from a plan (its planned inventories), by ``serve``'s rank 0 from the
plan and the inventories and bytes the stage processes measured on their real pools, and
by the sglang integration from the stage plans of live pools; the dashboard and exporters
read the same object (or its ``to_dict``), so the JSON shape is defined here, once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import MappingError
from ..model.layer_map import ModelLayout, StageLayerMap
from ..plan.inventory import PoolInventory
from ..plan.plan import RunPlan
from .checks import validate_stage, validate_tiling


@dataclass(frozen=True)
class StageReport:
    stage_map: StageLayerMap
    buffers: Mapping[str, int]
    expected: Mapping[str, int]
    errors: tuple[MappingError, ...]
    #: per pool kind, one page (a request slot) over every present buffer, in bytes: planned by
    #: ``check``, measured on the real tensors by ``serve`` -- the two must agree
    pool_page_bytes: Mapping[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_dict(self) -> dict[str, Any]:
        d = self.stage_map.to_dict()
        d["buffers"] = dict(self.buffers)
        d["expected_buffers"] = dict(self.expected)
        d["pool_page_bytes"] = dict(self.pool_page_bytes)
        d["ok"] = self.ok
        d["errors"] = [e.to_dict() for e in self.errors]
        return d


@dataclass(frozen=True)
class StartupReport:
    model: str
    num_layers: int
    pp_size: int
    tp_size: int
    page_size: int
    stages: tuple[StageReport, ...]
    cross_errors: tuple[MappingError, ...]
    faults: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.cross_errors and all(s.ok for s in self.stages)

    @property
    def all_errors(self) -> list[MappingError]:
        return [e for s in self.stages for e in s.errors] + list(self.cross_errors)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "model": self.model,
            "num_layers": self.num_layers,
            "pp_size": self.pp_size,
            "tp_size": self.tp_size,
            "page_size": self.page_size,
            "faults": list(self.faults),
            "stages": [s.to_dict() for s in self.stages],
            "errors": [e.to_dict() for e in self.cross_errors],
        }


def build_report(
    layout: ModelLayout,
    inventories: Sequence[PoolInventory],
    page_size: int,
    faults: Sequence[str] = (),
    pool_page_bytes: Sequence[Mapping[str, int]] | None = None,
) -> StartupReport:
    """Validate every stage against its inventory, then the tiling across stages."""
    by_stage = {inv.stage: inv for inv in inventories}
    stages = []
    for i, s in enumerate(layout.stages):
        inv = by_stage.get(s.stage, PoolInventory(s.stage, {}))
        nbytes = pool_page_bytes[i] if pool_page_bytes is not None else {}
        stages.append(StageReport(s, inv.counts(), s.expected_buffers(), tuple(validate_stage(s, inv)), nbytes))
    cross = validate_tiling(layout.slices, layout.spec.num_layers)
    return StartupReport(
        model=layout.spec.name,
        num_layers=layout.spec.num_layers,
        pp_size=layout.pp_size,
        tp_size=layout.tp_size,
        page_size=page_size,
        stages=tuple(stages),
        cross_errors=tuple(cross),
        faults=tuple(faults),
    )


def preflight(plan: RunPlan) -> StartupReport:
    """``check``: validate every stage of a plan against its planned pools (faults included)."""
    return build_report(plan.layout, [s.inventory() for s in plan.stages], plan.page_size,
                        plan.fault_names, [s.pool_page_bytes() for s in plan.stages])
