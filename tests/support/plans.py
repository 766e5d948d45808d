"""Plans and pools for tests: the runtime's own builders with the few arguments tests vary."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from stagecache.runtime.memory.host_pools import HostPools
from stagecache.runtime.memory.pools import StagePools
from stagecache.runtime.model.families import load_spec
from stagecache.runtime.model.layer_map import StageLayerMap
from stagecache.runtime.model.spec import ModelSpec
from stagecache.runtime.plan.faults import parse_faults
from stagecache.runtime.plan.plan import RunPlan, Sizing, StagePlan, build_plan, plan_stage
from stagecache.runtime.validation.deployment import preflight
from stagecache.runtime.validation.report import StartupReport


def run_plan(spec: ModelSpec | str, pp: int = 4, faults: Sequence[str] = (), *, page_size: int = 256,
             pages: int = 64, tp: int = 1, partition: Sequence[int] | None = None, **sizing: object) -> RunPlan:
    """A run plan of ``spec`` (a spec or a preset name), runtime-sized to ``pages`` device pages."""
    spec = load_spec(spec) if isinstance(spec, str) else spec
    return build_plan(spec, pp, tp_size=tp, partition=partition, page_size=page_size,
                      sizing=Sizing.runtime(pages, **sizing), faults=parse_faults(list(faults), pp, spec.family))


def report(spec: ModelSpec | str, pp: int = 4, faults: Sequence[str] = (), **kw: object) -> StartupReport:
    """``stagecache check``'s report of that plan (``.to_dict()``: its ``--json``)."""
    return preflight(run_plan(spec, pp, faults, **kw))


def stage_plan(spec: ModelSpec, stage: StageLayerMap, page_size: int, pages: int, **sizing: object) -> StagePlan:
    """One stage's plan from its layer map, runtime-sized (``host_pages``, ``hicache_ratio``,
    ``request_slots``, ``swa_ratio`` as ``Sizing.runtime`` takes them)."""
    return plan_stage(spec, stage, page_size=page_size, sizing=Sizing.runtime(pages, **sizing))


def pools(spec: ModelSpec, stage: StageLayerMap, page_size: int, pages: int, *, device: str = "cpu",
          kinds: Collection[str] | None = None, **sizing: object) -> StagePools:
    """Device pools of one stage, allocated from its plan."""
    return StagePools(stage_plan(spec, stage, page_size, pages, **sizing), device, kinds)


def pools_and_host(spec: ModelSpec, stage: StageLayerMap, page_size: int, pages: int, *,
                   device: str = "cpu", layout: str = "layer_first", pin_memory: bool | None = None,
                   **sizing: object) -> tuple[StagePools, HostPools]:
    """Device pools and their host mirror (``host_pages=N`` or ``hicache_ratio=R`` size the host)."""
    dp = pools(spec, stage, page_size, pages, device=device, **sizing)
    return dp, HostPools(dp, layout=layout, pin_memory=pin_memory)
