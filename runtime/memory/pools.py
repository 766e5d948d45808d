"""A PP stage's device KV pools, sized by the stage's *local* layers, as raw byte tensors.

Each buffer is a ``torch.uint8`` tensor ``(units, page_bytes)``: raw bytes keep
copies bit-exact whatever the element types inside (FP8, BF16, FP32 scales),
and a page is one contiguous row, which is what the transfer kernels gather.
Page bytes come from the pool-kind table; units are pages of the kind's token
budget, or request slots for the per-request ``c128_state``.

The runtime keeps one page-id space per stage: page ``p`` of every paged pool
is token page ``p``, so a single ``PageAllocator`` serves all pools and one page
id moves a token page of every layer between device and host.  That needs SWA
pages == full pages, which is why the runtime passes ``swa_ratio=1.0`` (sglang
itself gives SWA kinds a tenth of the full pages; ``stagecache pools`` shows that).

Buffer counts are the layer map's; faults (``validation.faults``) are an explicit
override: with one, the constructor really builds the buggy pools (a global-sized
SWA list, a None C4-state slot) and validation runs on those real tensors.  That
is why ``allow_invalid`` exists: ``serve`` builds faulty pools on purpose to show
the errors, everything else refuses them.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from ..errors import ConfigError, LayerNotOwnedError, MappingError, StageMappingInvalid
from ..model.layer_map import StageLayerMap
from ..model.pool_kinds import KINDS, POOLS, kind_table
from ..model.spec import ModelSpec
from ..validation.checks import PoolInventory, validate_stage
from ..validation.faults import Fault, buffer_plan
from .allocator import PageAllocator
from .host_tier import fitting_pages, fmt_bytes, ram_budget, read_meminfo
from .sizing import TokenBudget, budget_bytes, runtime_budget


def available_memory_bytes(device: Any) -> int | None:
    """Bytes the pools may take where they would live: CUDA free memory, or on the host
    ``MemAvailable`` less the RAM reserve (``host_tier.RAM_RESERVE_FRACTION``)."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free)
    if dev.type == "cpu":
        mem = read_meminfo()
        return None if mem is None else ram_budget(mem)
    return None  # meta and other devices: no limit we can know


def _check_num_pages(num_pages: object, what: str) -> int:
    if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages <= 0:
        raise ConfigError(f"{what}: number of pages must be a positive integer, got {num_pages!r}")
    return num_pages


def stage_plan(stage_map: StageLayerMap, ratios: Sequence[int], faults: Sequence[Fault] = (),
               pp_size: int = 1) -> dict[str, tuple[bool, ...]]:
    """Buffer slots per pool: one per owning local layer, or a fault's plan when faults are given."""
    if faults:
        return buffer_plan(stage_map, ratios, faults, pp_size)
    return {pool: (True,) * n for pool, n in stage_map.expected_buffers().items()}


class _StageBuffers:
    """What device pools and their host mirror share: lookups and validation of ``buffers``."""

    stage_map: StageLayerMap
    buffers: dict[str, list[Any]]
    kinds: tuple[str, ...]

    def get_swa_raw_buffer(self, global_layer_id: int):
        """SWA buffer of a global layer: the call the PP+HiCache bug got wrong."""
        return self.get_raw_buffer("swa", global_layer_id)

    def get_raw_buffer(self, pool: str, global_layer_id: int):  # pragma: no cover - overridden
        raise NotImplementedError

    def inventory(self) -> PoolInventory:
        return PoolInventory.from_buffers(self.stage_map.stage, self.buffers)

    def errors(self) -> list[MappingError]:
        """Mapping errors of the real buffers (for a partial build: of the kinds it holds)."""
        return [e for e in validate_stage(self.stage_map, self.inventory())
                if e.pool in self.kinds or e.pool not in POOLS]


class StagePools(_StageBuffers):
    """Device pools of one PP stage: ``buffers[pool][i]`` is buffer ``i`` of that pool."""

    def __init__(
        self,
        spec: ModelSpec,
        stage_map: StageLayerMap,
        page_size: int,
        num_pages: int,
        device: Any = "cpu",
        faults: Sequence[Fault] = (),
        pp_size: int = 1,
        allow_invalid: bool = False,
        kinds: Collection[str] | None = None,
        swa_ratio: float = 1.0,
        request_slots: int = 4,
    ):
        import torch

        where = f"stage {stage_map.stage} device pools"
        if kinds is not None:
            unknown = sorted(set(kinds) - set(POOLS))
            if unknown or not kinds:
                raise ConfigError(f"{where}: unknown pool kind(s) {unknown or list(kinds)}; pools are {', '.join(POOLS)}")
        #: Pool kinds this object holds: all of them, or a subset (benchmarks, single-kind tools).
        self.kinds: tuple[str, ...] = tuple(p for p in POOLS if kinds is None or p in kinds)
        self.spec = spec
        self.stage_map = stage_map
        self.table = kind_table(spec, page_size)  # checks the page size
        self.page_size = self.table.page_size
        self.num_pages = _check_num_pages(num_pages, where)
        #: Pages (or request slots) per kind: full pages, SWA pages by ``swa_ratio``, slots.
        self.budget: TokenBudget = runtime_budget(self.page_size, num_pages, swa_ratio, request_slots)
        self.units = {p: self.budget.units(KINDS[p]) for p in POOLS}
        self.device = torch.device(device)
        self.faults = tuple(faults)
        self.pp_size = pp_size
        plan = stage_plan(stage_map, spec.compress_ratios, self.faults, pp_size)
        self.plan = {p: (slots if p in self.kinds else ()) for p, slots in plan.items()}
        self._check_fits(where)
        self.buffers: dict[str, list[torch.Tensor | None]] = {
            pool: [torch.zeros((self.units[pool], self.page_bytes(pool)), dtype=torch.uint8, device=self.device)
                   if present else None for present in self.plan[pool]]
            for pool in POOLS
        }
        self.allocator = PageAllocator(self.num_pages, f"stage {stage_map.stage} device")
        #: Request slots of the per-request kinds (``c128_state``): one per request in flight.
        self.slot_allocator = PageAllocator(self.budget.request_slots,
                                            f"stage {stage_map.stage} request slots")
        problems = self.errors()
        if problems and not allow_invalid:
            raise StageMappingInvalid(problems)

    def _check_fits(self, where: str) -> None:
        need = self.planned_bytes()
        free = available_memory_bytes(self.device)
        if free is not None and need > free:
            counts = {p: sum(slots) for p, slots in self.plan.items()}
            request_slots = self.budget.request_slots

            def need_for(pages: int, _ratio: float) -> int:
                budget = runtime_budget(self.page_size, pages, 1.0, request_slots)
                return budget_bytes(self.table, counts, budget)

            fit = fitting_pages(need_for, free, self.num_pages, 1.0)
            hint = (f"lower --device-pages to {fit} (--max-total-tokens to {fit * self.page_size})"
                    if fit else "no page count fits: free memory or use a larger device")
            raise ConfigError(
                f"{where}: {self.num_pages} pages x {self.token_page_bytes()} B per token page "
                f"= {fmt_bytes(need)} needed, only {fmt_bytes(free)} free on {self.device}; {hint}"
            )

    # -- sizes -------------------------------------------------------------------------------
    def page_bytes(self, pool: str) -> int:
        """Bytes of one page (one request slot for ``c128_state``) of one buffer of ``pool``."""
        return self.table.page_bytes(pool)

    def token_page_bytes(self) -> int:
        """Bytes of one token page over every allocated buffer of every paged pool."""
        return sum(sum(slots) * self.page_bytes(p) for p, slots in self.plan.items()
                   if slots and KINDS[p].paged)

    def planned_bytes(self) -> int:
        return budget_bytes(self.table, {p: sum(slots) for p, slots in self.plan.items()}, self.budget)

    def pool_bytes(self) -> dict[str, int]:
        """Bytes each pool really holds, summed over its tensors (None slots count 0)."""
        return {pool: sum(t.numel() * t.element_size() for t in bufs if t is not None)
                for pool, bufs in self.buffers.items()}

    # -- lookup through the one translation point ---------------------------------------------
    def get_raw_buffer(self, pool: str, global_layer_id: int):
        """The ``(units, page_bytes)`` buffer of ``pool`` for a global layer id."""
        index = self.stage_map.pool_index(pool, global_layer_id)  # LayerNotOwnedError names the range
        bufs = self.buffers.get(pool, [])
        m = self.stage_map
        label = KINDS[pool].label
        if not 0 <= index < len(bufs):
            raise LayerNotOwnedError(
                f"stage {m.stage} (global layers [{m.start}, {m.end})): global layer "
                f"{global_layer_id} maps to {label} buffer {index}, but the pool holds "
                f"{len(bufs)} buffers"
            )
        buf = bufs[index]
        if buf is None:
            raise LayerNotOwnedError(
                f"stage {m.stage} (global layers [{m.start}, {m.end})): {label} buffer "
                f"{index} for global layer {global_layer_id} is None"
            )
        return buf

    def __repr__(self) -> str:
        counts = {p: len(b) for p, b in self.buffers.items()}
        return (f"StagePools(stage={self.stage_map.stage}, pages={self.num_pages}x{self.page_size}, "
                f"device={self.device}, buffers={counts})")
