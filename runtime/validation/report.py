"""The startup report: every stage's map, buffers and errors, plus cross-stage errors.

Built by ``check`` from planned inventories and by ``serve``'s rank 0 from the
inventories the stage processes gathered; the dashboard and exporters read the
same object (or its ``to_dict``), so the JSON shape is defined here, once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import MappingError
from ..model.layer_map import ModelLayout, StageLayerMap
from .checks import PoolInventory, validate_stage, validate_tiling
from .faults import Fault, apply_layout_faults, planned_inventory


@dataclass(frozen=True)
class StageReport:
    stage_map: StageLayerMap
    buffers: Mapping[str, int]
    expected: Mapping[str, int]
    errors: tuple[MappingError, ...]

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_dict(self) -> dict[str, Any]:
        d = self.stage_map.to_dict()
        d["buffers"] = dict(self.buffers)
        d["expected_buffers"] = dict(self.expected)
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
) -> StartupReport:
    """Validate every stage against its inventory, then the tiling across stages."""
    by_stage = {inv.stage: inv for inv in inventories}
    stages = []
    for s in layout.stages:
        inv = by_stage.get(s.stage, PoolInventory(s.stage, {}))
        stages.append(StageReport(s, inv.counts(), s.expected_buffers(), tuple(validate_stage(s, inv))))
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


def preflight(layout: ModelLayout, page_size: int, faults: Sequence[Fault] = ()) -> StartupReport:
    """``check``: plan every stage's pools (as a constructor would, faults included) and validate."""
    faulty = apply_layout_faults(layout, faults)
    ratios = layout.spec.compress_ratios
    inventories = [planned_inventory(s, ratios, faults, layout.pp_size) for s in faulty.stages]
    names = [f.name if f.stage is None else f"{f.name}@{f.stage}" for f in faults]
    return build_report(faulty, inventories, page_size, names)
