"""The run's plan: built once at the boundary, then read by every consumer.

Like vLLM's ``KVCacheConfig``: the model spec, the PP layout (sglang's partition or an
explicit one), the page size, the token and host budgets and the planted faults go in once;
out comes a frozen, picklable ``RunPlan`` holding, per stage, the layer map, every pool
kind's buffers and bytes, the host pages and the token capacity.  ``check`` validates it,
``pools`` prints it, ``serve`` ships each stage process its ``StagePlan`` (the pools allocate
exactly what it says), the benchmarks size their pools from it and the sglang integration
builds one from a live pool to compare ranks.  Nothing else computes buffer counts, bytes per
page or budgets.

Two sizings (``Sizing``):

* ``runtime`` -- stagecache's own pools: ``device_pages`` pages of every paged kind (one
  page-id space: SWA pages == full pages), ``request_slots`` slots of the per-request kind,
  host pages by ``--hicache-ratio`` (or a page count); tensors hold exactly their budget;
* ``sglang`` -- what sglang 0.5.23 allocates: ``--max-total-tokens`` or the full tokens a
  per-stage memory budget fits (the minimum over stages: sglang all-reduces the capacity with
  MIN), a fraction of them for the SWA kinds (a tenth for DeepSeek V4), 257 request slots, and
  the few reserved rows sglang's tensors carry.  With a memory budget each stage also gets its
  ``Capacity``: what it could hold alone and the bytes the minimum strands on it.

Faults are plan -> plan functions (``apply_faults``): a faulted plan has the faulty layer
maps and buffer lists, and every byte count follows from them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

from .. import defaults
from ..errors import ConfigError
from ..model.family import Family, StageBudget, is_unbounded
from ..model.layer_map import ModelLayout, StageLayerMap, build_layout
from ..model.pool_kinds import KindTable, PoolKind
from ..model.spec import ModelSpec
from .faults import Fault, apply_layout_faults, fault_names, faulty_buffers
from .fingerprint import Fingerprint, config_hash
from .inventory import PoolInventory
from .sizing import (
    TokenBudget,
    check_positive,
    host_pages_for,
    runtime_budget,
    sglang_budget,
    sglang_full_tokens_for_bytes,
)

Mode = Literal["runtime", "sglang"]


@dataclass(frozen=True)
class Sizing:
    """What sizes a plan's pools (see the module docstring); build it with ``runtime``/``sglang``."""

    mode: Mode
    hicache_ratio: float = defaults.HICACHE_RATIO
    # runtime
    device_pages: int | None = None
    request_slots: int = defaults.MICRO_BATCH
    host_pages: int | None = None  # a host page count instead of the ratio (benchmarks)
    hicache_size_bytes: int | None = None  # a host size instead of the ratio (where allowed)
    # sglang
    max_total_tokens: int | None = None
    mem_budget_bytes: tuple[int, ...] | None = None  # per stage, or one entry for every stage
    swa_ratio: float | None = None  # None: the model family's default (``build_plan`` fills it in)
    max_running_requests: int = defaults.MAX_RUNNING_REQUESTS
    # per-request state (Mamba): sglang's --max-mamba-cache-size and --mamba-full-memory-ratio;
    # the ratio stays None for a family without state pools (``for_table`` fills it in)
    max_mamba_cache_size: int | None = None
    mamba_full_memory_ratio: float | None = None
    #: every stage's ``[start, end)``, filled in by the plan for ``Family.stage_budget`` (sglang
    #: charges each stage by the stage with the most state layers)
    stage_ranges: tuple[tuple[int, int], ...] | None = field(default=None, compare=False)

    @classmethod
    def runtime(cls, device_pages: int = defaults.DEVICE_PAGES, *, request_slots: int = defaults.MICRO_BATCH,
                hicache_ratio: float | None = None, host_pages: int | None = None,
                swa_ratio: float = 1.0) -> Sizing:
        """stagecache's own pools; ``swa_ratio`` below 1 gives the SWA-budget kinds fewer pages of
        the one page-id space (the runtime keeps 1.0: a token page of every kind moves together)."""
        if host_pages is not None:
            check_positive(host_pages, "number of host pages")
        return cls("runtime", defaults.HICACHE_RATIO if hicache_ratio is None else hicache_ratio,
                   device_pages=device_pages, request_slots=request_slots, host_pages=host_pages,
                   swa_ratio=swa_ratio)

    @classmethod
    def sglang(cls, *, max_total_tokens: int | None = None,
               mem_budget_bytes: int | Sequence[int] | None = None, swa_ratio: float | None = None,
               max_running_requests: int = defaults.MAX_RUNNING_REQUESTS,
               hicache_ratio: float | None = None, hicache_size_bytes: int | None = None,
               max_mamba_cache_size: int | None = None,
               mamba_full_memory_ratio: float | None = None) -> Sizing:
        """sglang's flags (a family whose sglang refuses a host size in bytes refuses it at
        ``build_plan``)."""
        if max_mamba_cache_size is not None:
            check_positive(max_mamba_cache_size, "--max-mamba-cache-size")
        if mamba_full_memory_ratio is not None and (isinstance(mamba_full_memory_ratio, bool) or not isinstance(
                mamba_full_memory_ratio, int | float) or not mamba_full_memory_ratio > 0):
            raise ConfigError(f"--mamba-full-memory-ratio must be > 0, got {mamba_full_memory_ratio!r}")
        if max_total_tokens is not None and mem_budget_bytes is not None:
            raise ConfigError("give --max-total-tokens or a memory budget, not both")
        budgets = None
        if mem_budget_bytes is not None:
            budgets = ((mem_budget_bytes,) if isinstance(mem_budget_bytes, int)
                       else tuple(int(b) for b in mem_budget_bytes))
        return cls("sglang", defaults.HICACHE_RATIO if hicache_ratio is None else hicache_ratio,
                   hicache_size_bytes=hicache_size_bytes, max_total_tokens=max_total_tokens, mem_budget_bytes=budgets,
                   swa_ratio=swa_ratio,
                   max_running_requests=max_running_requests, max_mamba_cache_size=max_mamba_cache_size,
                   mamba_full_memory_ratio=mamba_full_memory_ratio)

    def for_family(self, family: Family) -> Sizing:
        """This sizing with the family's defaults where it leaves them open (the SWA share)."""
        if self.swa_ratio is not None:
            return self
        return dataclasses.replace(self, swa_ratio=family.swa_full_tokens_ratio)

    def for_table(self, table: KindTable) -> Sizing:
        """This sizing with sglang's Mamba share filled in where the model has per-request state."""
        if self.mamba_full_memory_ratio is not None or not any(
                table[p].kind.budget == "state" for p in table.pools):
            return self
        return dataclasses.replace(self, mamba_full_memory_ratio=defaults.MAMBA_FULL_MEMORY_RATIO)

    def state_slots(self) -> int:
        """Mamba state slots without a memory budget: ``--max-mamba-cache-size``, or
        ``defaults.MAMBA_SLOTS_PER_REQUEST`` per running request (stagecache's default)."""
        if self.max_mamba_cache_size is not None:
            return self.max_mamba_cache_size
        return defaults.MAMBA_SLOTS_PER_REQUEST * self.max_running_requests

    def stage_budget_bytes(self, stage: int, pp_size: int) -> int | None:
        """The memory budget of ``stage`` (None without one)."""
        if self.mem_budget_bytes is None:
            return None
        if len(self.mem_budget_bytes) == 1:
            return self.mem_budget_bytes[0]
        if len(self.mem_budget_bytes) != pp_size:
            raise ConfigError(f"--mem-budget-gb has {len(self.mem_budget_bytes)} values; expected one "
                              f"for every stage or one per stage ({pp_size})")
        return self.mem_budget_bytes[stage]

    def to_dict(self) -> dict[str, Any]:
        if self.mode == "runtime":
            return {"mode": "runtime", "device_pages": self.device_pages, "request_slots": self.request_slots,
                    "swa_ratio": self.swa_ratio, "hicache_ratio": self.hicache_ratio,
                    "host_pages": self.host_pages}
        budget = ({"mem_budget_bytes": list(self.mem_budget_bytes)} if self.mem_budget_bytes is not None
                  else {"max_total_tokens": self.max_total_tokens or defaults.MAX_TOTAL_TOKENS})
        out = {"mode": "sglang", **budget, "swa_full_tokens_ratio": self.swa_ratio,
               "max_running_requests": self.max_running_requests, "hicache_ratio": self.hicache_ratio}
        if self.mamba_full_memory_ratio is not None:
            out["max_mamba_cache_size"] = self.max_mamba_cache_size
            out["mamba_full_memory_ratio"] = self.mamba_full_memory_ratio
        return out


@dataclass(frozen=True)
class PoolPlan:
    """One pool kind of one stage: its buffers and what each one costs, device and host."""

    kind: PoolKind
    buffers: tuple[bool, ...]  # one per buffer a constructor makes; False = left None (a fault)
    row_bytes: int
    rows_per_page: int
    page_bytes: int  # one page (a request slot for a per-request kind) of one buffer, padded
    units: int  # pages of the kind's budget, or request slots
    tensor_rows: int  # first dimension of each device tensor (sglang's reserved rows included)
    tensor_row_bytes: int
    host_pages: int  # per buffer; 0 for a kind the host tier does not mirror

    @property
    def pool(self) -> str:
        return self.kind.name

    @property
    def present(self) -> int:
        """Buffers that hold a tensor (``len(buffers)`` counts the None ones too: what validation
        compares with the layer map)."""
        return sum(self.buffers)

    @property
    def device_bytes(self) -> int:
        return self.present * self.tensor_rows * self.tensor_row_bytes

    @property
    def host_bytes(self) -> int:
        return self.present * self.host_pages * self.page_bytes

    @property
    def token_page_bytes(self) -> int:
        """One token page over every buffer (0 for a per-request kind)."""
        return self.present * self.page_bytes if self.kind.paged else 0

    def to_dict(self, stage: int) -> dict[str, Any]:
        k = self.kind
        return {"stage": stage, "pool": self.pool, "buffers": len(self.buffers), "present": self.present,
                "budget": k.budget, "host_cached": k.host_cached, "rows_per_page": self.rows_per_page,
                "row_bytes": self.row_bytes, "page_bytes": self.page_bytes, "device_pages": self.units,
                "tensor_rows": self.tensor_rows, "tensor_row_bytes": self.tensor_row_bytes,
                "host_pages": self.host_pages, "device_bytes": self.device_bytes,
                "host_bytes": self.host_bytes}


@dataclass(frozen=True)
class Capacity:
    """A stage's token capacity under a memory budget, against the deployment's (the minimum)."""

    budget_bytes: int
    tokens_alone: int  # full tokens this stage's budget fits on its own
    tokens: int  # the deployment's: the minimum over stages
    used_bytes: int  # the stage's device bytes at the deployment's capacity
    #: per-request state (Mamba): what sglang charges the stage's budget for it (the state of the
    #: stage with the most Mamba layers) and what the stage allocates; None without such state
    state_charged_bytes: int | None = None
    state_bytes: int | None = None

    @property
    def stranded_bytes(self) -> int:
        """Budget the minimum leaves unused on this stage."""
        return max(0, self.budget_bytes - self.used_bytes)

    @property
    def state_stranded_bytes(self) -> int | None:
        """State bytes charged to this stage's budget that it never allocates."""
        if self.state_charged_bytes is None or self.state_bytes is None:
            return None
        return max(0, self.state_charged_bytes - self.state_bytes)

    def to_dict(self) -> dict[str, int]:
        out = {"budget_bytes": self.budget_bytes, "tokens_alone": self.tokens_alone,
               "tokens": self.tokens, "used_bytes": self.used_bytes,
               "stranded_bytes": self.stranded_bytes}
        if self.state_charged_bytes is not None:
            out.update(state_charged_bytes=self.state_charged_bytes, state_bytes=self.state_bytes or 0,
                       state_stranded_bytes=self.state_stranded_bytes or 0)
        return out


@dataclass(frozen=True)
class StagePlan:
    """One PP stage of a plan: what its process allocates and validates."""

    layer_map: StageLayerMap
    pools: tuple[PoolPlan, ...]  # every kind of the family, in its display order
    budget: TokenBudget
    host_pages: int  # the host tier's page-id space (full-budget pages)
    host_swa_pages: int
    sizing: Sizing
    spec: ModelSpec = field(compare=False)
    capacity: Capacity | None = None
    fingerprint: Fingerprint | None = field(default=None, compare=False)

    @property
    def stage(self) -> int:
        return self.layer_map.stage

    def pool(self, name: str) -> PoolPlan:
        """The plan of pool kind ``name`` (a ConfigError listing the kinds otherwise)."""
        return self.pools[self.layer_map.pools.index(self.layer_map.kind(name).name)]

    @property
    def buffers(self) -> dict[str, tuple[bool, ...]]:
        return {p.pool: p.buffers for p in self.pools}

    def expected_buffers(self) -> dict[str, int]:
        """What the layer map says each pool must hold (validation compares the two)."""
        return self.layer_map.expected_buffers()

    def inventory(self) -> PoolInventory:
        """The planned inventory (what a constructor following this plan builds)."""
        return PoolInventory(self.stage, self.buffers)

    def pool_page_bytes(self) -> dict[str, int]:
        """Per pool kind, one page (a request slot) over its present buffers."""
        return {p.pool: p.present * p.page_bytes for p in self.pools}

    @property
    def token_page_bytes(self) -> int:
        """One token page of every buffer of every paged kind: the stage's cost per page."""
        return sum(p.token_page_bytes for p in self.pools)

    @property
    def device_bytes(self) -> int:
        return sum(p.device_bytes for p in self.pools)

    @property
    def host_bytes(self) -> int:
        return sum(p.host_bytes for p in self.pools)

    @property
    def device_pages(self) -> int:
        """The device page-id space: pages of the full-token budget."""
        return self.budget.full_pages

    @property
    def sized_without_bound(self) -> bool:
        """Its token-sized pools are built for a count no memory bounds (``--fault unbounded-stage``):
        nothing can allocate them, and validation refuses the stage."""
        return is_unbounded(self.budget.full_tokens)

    def to_dict(self) -> dict[str, Any]:
        m = self.layer_map
        return {
            "stage": m.stage, "start_layer": m.start, "end_layer": m.end, "local_layers": m.local_layers,
            **self.budget.to_dict(), "device_pages": self.budget.full_pages,
            "swa_device_pages": self.budget.swa_pages, "host_pages": self.host_pages,
            "swa_host_pages": self.host_swa_pages, "token_page_bytes": self.token_page_bytes,
            "device_bytes": self.device_bytes, "host_bytes": self.host_bytes,
            "capacity": self.capacity.to_dict() if self.capacity is not None else None,
            "pools": [p.to_dict(m.stage) for p in self.pools],
        }


@dataclass(frozen=True)
class RunPlan:
    """The whole run: every stage's plan, and what they were built from."""

    spec: ModelSpec
    tp_size: int
    page_size: int
    partition: tuple[int, ...] | None  # an explicit partition, as given (None: sglang's even split)
    sizing: Sizing
    faults: tuple[Fault, ...]
    stages: tuple[StagePlan, ...]

    @property
    def pp_size(self) -> int:
        return len(self.stages)

    def stage(self, rank: int) -> StagePlan:
        return self.stages[rank]

    @cached_property
    def kinds(self) -> KindTable:
        return self.spec.family.kind_table(self.spec, self.page_size)

    @property
    def layout(self) -> ModelLayout:
        """The (possibly faulted) layer maps as a layout: what validation checks the tiling of."""
        return ModelLayout(self.spec, self.tp_size, tuple(s.layer_map for s in self.stages))

    @property
    def fingerprint(self) -> Fingerprint:
        return fingerprint_of(self.spec, self.page_size, self.tp_size,
                              tuple(s.layer_map.local_layers for s in self.stages))

    @property
    def fault_names(self) -> list[str]:
        return fault_names(self.faults)

    def stage_faults(self, rank: int) -> frozenset[str]:
        """Names of the faults that hit stage ``rank`` (what a serving stage acts on)."""
        return frozenset(f.name for f in self.faults if f.hits(rank, self.pp_size))

    @property
    def host_bytes(self) -> int:
        """The host tiers of every stage (they may share one host's RAM)."""
        return sum(s.host_bytes for s in self.stages)

    def resized(self, sizing: Sizing) -> RunPlan:
        """The same layer maps and buffers under another sizing (what-fits searches)."""
        return _assemble(self.spec, self.tp_size, self.page_size, self.partition,
                         sizing.for_family(self.spec.family).for_table(self.kinds), self.faults,
                         [s.layer_map for s in self.stages], [s.buffers for s in self.stages])

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.spec.name, "num_layers": self.spec.num_layers, "pp_size": self.pp_size,
            "tp_size": self.tp_size, "page_size": self.page_size,
            "partition": list(self.partition) if self.partition is not None else None,
            "faults": self.fault_names, "sizing": self.sizing.to_dict(),
            "fingerprint": self.fingerprint.to_dict(), "kinds": self.kinds.to_dict()["kinds"],
            "stages": [s.to_dict() for s in self.stages],
            "totals": {"device_bytes": sum(s.device_bytes for s in self.stages), "host_bytes": self.host_bytes},
        }


def select_kinds(plan: StagePlan, kinds: Collection[str]) -> StagePlan:
    """``plan`` with only ``kinds`` kept (the other kinds get no buffer): single-kind pools."""
    pools = plan.layer_map.pools
    unknown = sorted(set(kinds) - set(pools))
    if unknown or not kinds:
        raise ConfigError(f"stage {plan.stage}: unknown pool kind(s) {unknown or list(kinds)}; "
                          f"pools are {', '.join(pools)}")
    pools = tuple(p if p.pool in kinds else dataclasses.replace(p, buffers=()) for p in plan.pools)
    return dataclasses.replace(plan, pools=pools)


def fingerprint_of(spec: ModelSpec, page_size: int, tp_size: int, partition: tuple[int, ...]) -> Fingerprint:
    return Fingerprint(spec.name, config_hash(spec), spec.family.kv_dtype, page_size, len(partition), tp_size,
                       partition)


# -- building ----------------------------------------------------------------------------------------
def build_plan(spec: ModelSpec, pp_size: int = defaults.PP_SIZE, *, tp_size: int = defaults.TP_SIZE,
               partition: Sequence[int] | None = None, page_size: int = defaults.PAGE_SIZE,
               sizing: Sizing | None = None, faults: Sequence[Fault] = ()) -> RunPlan:
    """The plan of ``spec`` under PP (sglang's partition rules), then ``faults`` applied.

    Every bad input is a ``ConfigError`` naming the flag: the page size, the partition, sizes.
    """
    refused = spec.family.refuses_pp(spec)
    if pp_size > 1 and refused:
        raise ConfigError(f"--pp-size {pp_size}: {spec.name}: {refused}")
    if tp_size > 1 and (why := spec.tp_refused(tp_size)):
        raise ConfigError(f"--tp-size {tp_size}: {spec.name}: {why}")
    table = spec.family.kind_table(spec, page_size)  # checks the page size
    explicit = tuple(partition) if partition is not None else None
    layout = build_layout(spec, pp_size, tp_size, explicit)
    sizing = (sizing if sizing is not None else Sizing.runtime()).for_family(spec.family).for_table(table)
    if sizing.hicache_size_bytes is not None:
        raise ConfigError(spec.family.host_size_refusal())
    healthy = _assemble(spec, tp_size, table.page_size, explicit, sizing, (), list(layout.stages),
                        [faulty_buffers(m, spec) for m in layout.stages])
    return apply_faults(healthy, faults)


def plan_stage(spec: ModelSpec, layer_map: StageLayerMap, *, page_size: int = defaults.PAGE_SIZE,
               sizing: Sizing | None = None,
               buffers: dict[str, tuple[bool, ...]] | None = None) -> StagePlan:
    """The plan of one stage alone, from its layer map (and its real buffers, when read from a
    live pool): what a rank knows before it has heard from the others.  Its fingerprint is left
    empty: the partition is the deployment's, not one stage's."""
    table = spec.family.kind_table(spec, page_size)
    plan = _assemble(spec, defaults.TP_SIZE, table.page_size, None,
                     (sizing if sizing is not None else Sizing.runtime()).for_family(spec.family).for_table(table),
                     (), [layer_map],
                     [buffers if buffers is not None else faulty_buffers(layer_map, spec)])
    return dataclasses.replace(plan.stage(0), fingerprint=None)


def apply_faults(plan: RunPlan, faults: Sequence[Fault]) -> RunPlan:
    """``plan`` as the faulty code would have built it: its layer maps, then its buffers."""
    if not faults:
        return plan
    faults = tuple(faults)
    layout = apply_layout_faults(plan.layout, faults)
    buffers = [faulty_buffers(m, plan.spec, faults, plan.pp_size) for m in layout.stages]
    return _assemble(plan.spec, plan.tp_size, plan.page_size, plan.partition, plan.sizing,
                     plan.faults + faults, list(layout.stages), buffers)


def _assemble(spec: ModelSpec, tp_size: int, page_size: int, partition: tuple[int, ...] | None,
              sizing: Sizing, faults: tuple[Fault, ...], maps: list[StageLayerMap],
              buffers: list[dict[str, tuple[bool, ...]]]) -> RunPlan:
    table = spec.family.kind_table(spec, page_size)
    counts = [{p: sum(b) for p, b in bufs.items()} for bufs in buffers]
    ranges = tuple((m.start, m.end) for m in maps)
    budget, alone, per_stage = _budget(spec, table, dataclasses.replace(sizing, stage_ranges=ranges), counts)
    fp = fingerprint_of(spec, page_size, tp_size, tuple(m.local_layers for m in maps))
    host_full, host_swa = _host_space(sizing, budget)
    stages = []
    for i, (m, bufs) in enumerate(zip(maps, buffers, strict=True)):
        left_out = frozenset().union(*(f.kind.host_left_out for f in faults if f.hits(i, len(maps))))
        own = (spec.family.stage_units(counts[i], budget.full_tokens, page_size)
               if sizing.mode == "sglang" else None)
        stage_budget = budget
        if per_stage is not None and "state" in per_stage[i].units:  # per-request state: the stage's own slots
            stage_budget = dataclasses.replace(budget, state_slots=per_stage[i].units["state"])
        stage_budget = _faulty_tokens(spec, m, stage_budget, faults, i, len(maps))
        stage_host = (host_full if stage_budget.full_tokens == budget.full_tokens
                      else _host_space(sizing, stage_budget)[0])
        pools = tuple(_pool_plan(table, sizing, stage_budget, p, bufs.get(p, ()), p in left_out, own)
                      for p in table.pools)
        cap = None
        if alone is not None:
            charged = per_stage[i].charged_bytes.get("state") if per_stage is not None else None
            state = (sum(p.device_bytes for p in pools if p.kind.budget == "state")
                     if charged is not None else None)
            cap = Capacity(sizing.stage_budget_bytes(i, len(maps)) or 0, alone[i], stage_budget.full_tokens,
                           sum(p.device_bytes for p in pools), charged, state)
        stages.append(StagePlan(m, pools, stage_budget, stage_host, host_swa, sizing, spec, cap, fp))
    return RunPlan(spec, tp_size, page_size, partition, sizing, faults, tuple(stages))


def _faulty_tokens(spec: ModelSpec, layer_map: StageLayerMap, budget: TokenBudget, faults: tuple[Fault, ...],
                   stage: int, pp_size: int) -> TokenBudget:
    """The budget of a stage a fault sizes by its own token figure (``FaultKind.tokens``)."""
    tokens = budget.full_tokens
    for f in faults:
        if f.kind.tokens is not None and f.hits(stage, pp_size):
            tokens = f.kind.tokens(spec, layer_map, tokens, budget.page_size)
    return budget if tokens == budget.full_tokens else dataclasses.replace(budget, full_tokens=tokens)


def _budget(spec: ModelSpec, table: KindTable, sizing: Sizing, counts: list[dict[str, int]]
            ) -> tuple[TokenBudget, list[int] | None, list[StageBudget] | None]:
    """The token budget every stage is sized by, each stage's capacity alone (memory budgets), and
    each stage's own units where its family sizes them (``Family.stage_budget``)."""
    page = table.page_size
    has_state = any(table[p].kind.budget == "state" for p in table.pools)
    if sizing.mode == "runtime":
        pages = defaults.DEVICE_PAGES if sizing.device_pages is None else sizing.device_pages
        budget = runtime_budget(page, pages, sizing.swa_ratio, sizing.request_slots)
        if has_state:
            budget = dataclasses.replace(budget, state_slots=sizing.request_slots)
        return budget, None, None
    alone = per_stage = None
    if sizing.mem_budget_bytes is not None:
        alone = [_tokens_alone(spec, table, sizing, c, sizing.stage_budget_bytes(i, len(counts)) or 0, i)
                 for i, c in enumerate(counts)]
        own_budgets = [spec.family.stage_budget(table, c, sizing.stage_budget_bytes(i, len(counts)) or 0, sizing)
                       for i, c in enumerate(counts)]
        if all(b is not None and "state" in b.units for b in own_budgets):
            per_stage = [b for b in own_budgets if b is not None]
        full = min(alone)  # sglang all-reduces the token capacity with MIN over the PP ranks
    else:
        full = sizing.max_total_tokens or defaults.MAX_TOTAL_TOKENS
    budget = sglang_budget(page, full, spec.family.swa_floor_tokens(spec), sizing.swa_ratio,
                           sizing.max_running_requests)
    if has_state:
        budget = dataclasses.replace(budget, state_slots=sizing.state_slots())
    return budget, alone, per_stage


def _tokens_alone(spec: ModelSpec, table: KindTable, sizing: Sizing, counts: dict[str, int],
                  budget_bytes: int, stage: int) -> int:
    """The tokens one stage's memory budget fits alone (what the PP ranks MIN-reduce): its
    family's rule (``Family.stage_budget``), else DeepSeek V4's."""
    try:
        own = spec.family.stage_budget(table, counts, budget_bytes, sizing)
    except ConfigError as exc:
        raise ConfigError(f"stage {stage}: {exc}") from None
    if own is not None:
        return own.units["full"] * table.page_size
    return sglang_full_tokens_for_bytes(table, counts, budget_bytes, sizing.swa_ratio,
                                        sizing.max_running_requests, f"stage {stage}")


def _host_space(sizing: Sizing, budget: TokenBudget) -> tuple[int, int]:
    """Host pages of the full budget and of the SWA budget."""
    if sizing.host_pages is not None:
        return sizing.host_pages, sizing.host_pages
    return (host_pages_for(budget.full_pages, sizing.hicache_ratio),
            host_pages_for(budget.swa_pages, sizing.hicache_ratio))


def _pool_plan(table: KindTable, sizing: Sizing, budget: TokenBudget, pool: str,
               buffers: tuple[bool, ...], host_left_out: bool = False,
               own_units: Mapping[str, int] | None = None) -> PoolPlan:
    """One kind's plan; ``host_left_out``: a fault leaves the kind out of the HiCache host set;
    ``own_units``: the stage's units per budget where its family sizes it unlike the others."""
    spec = table[pool]
    units = budget.units(spec.kind) if own_units is None else own_units.get(spec.kind.budget, budget.units(spec.kind))
    host = 0
    if spec.kind.host_cached and not host_left_out:
        host = sizing.host_pages if sizing.host_pages is not None else spec.host_units(units, sizing.hicache_ratio)
    if sizing.mode == "sglang":
        rows, row_bytes = spec.tensor_rows(units), spec.tensor_row_bytes
    else:
        rows, row_bytes = units, spec.page_bytes
    return PoolPlan(spec.kind, buffers, spec.row_bytes, spec.rows_per_page, spec.page_bytes, units, rows,
                    row_bytes, host)
