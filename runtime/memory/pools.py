"""A PP stage's device KV pools, sized by the stage's *local* layers, as raw byte tensors.

One page-id space per stage: page ``p`` of every pool holds token page ``p``'s
rows, so a single ``PageAllocator`` serves all pools and one page id moves a
token page of every layer between device and host.  Each buffer is a
``torch.uint8`` tensor ``(num_pages, page_bytes)``: raw bytes keep copies
bit-exact whatever the element types inside (FP8, BF16, FP32 scales), and a page
is one contiguous row, which is what the transfer kernels gather.

How many buffers each pool gets comes from ``faults.buffer_plan``; with a fault
the constructor really builds the buggy pools (a global-sized SWA list, a None
C4-state slot), and validation runs on those real tensors.  That is why
``allow_invalid`` exists: ``serve`` builds faulty pools on purpose to show the
errors, everything else refuses them.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from ..errors import ConfigError, LayerNotOwnedError, MappingError, StageMappingInvalid
from ..model.layer_map import POOL_LABELS, POOLS, StageLayerMap
from ..model.spec import ModelSpec
from ..validation.checks import PoolInventory, validate_stage
from ..validation.faults import Fault, buffer_plan
from .allocator import PageAllocator
from .sizing import PoolGeometry, check_layout_page_size, pool_geometry


def available_memory_bytes(device: Any) -> int | None:
    """Free bytes where the pools would live: CUDA free memory, or the host's MemAvailable."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free)
    if dev.type == "cpu":
        return host_available_bytes()
    return None  # meta and other devices: no limit we can know


def host_available_bytes() -> int | None:
    """``MemAvailable`` from /proc/meminfo (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _check_num_pages(num_pages: object, what: str) -> int:
    if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages <= 0:
        raise ConfigError(f"{what}: number of pages must be a positive integer, got {num_pages!r}")
    return num_pages


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"


class StagePools:
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
        self.page_size = check_layout_page_size(spec, page_size)
        self.num_pages = _check_num_pages(num_pages, where)
        self.device = torch.device(device)
        self.faults = tuple(faults)
        self.pp_size = pp_size
        plan = buffer_plan(stage_map, spec.compress_ratios, self.faults, pp_size)
        self.plan = {p: (slots if p in self.kinds else ()) for p, slots in plan.items()}
        self.geometry: dict[str, PoolGeometry] = {
            pool: pool_geometry(spec, pool, self.page_size) for pool in POOLS if self.plan[pool]
        }
        need = self.planned_bytes()
        free = available_memory_bytes(self.device)
        if free is not None and need > free:
            raise ConfigError(
                f"{where}: {num_pages} pages x {self.token_page_bytes()} B per token page "
                f"= {_fmt_bytes(need)} needed, only {_fmt_bytes(free)} free on {self.device}; "
                "lower --max-total-tokens or --mem-budget-gb"
            )
        self.buffers: dict[str, list[torch.Tensor | None]] = {}
        for pool in POOLS:
            slots = self.plan[pool]
            if not slots:
                self.buffers[pool] = []
                continue
            pb = self.geometry[pool].page_bytes
            self.buffers[pool] = [
                torch.zeros((self.num_pages, pb), dtype=torch.uint8, device=self.device) if present else None
                for present in slots
            ]
        self.allocator = PageAllocator(self.num_pages, f"stage {stage_map.stage} device")
        problems = self.errors()
        if problems and not allow_invalid:
            raise StageMappingInvalid(problems)

    # -- sizes -------------------------------------------------------------------------------
    def page_bytes(self, pool: str) -> int:
        """Bytes of one page of one buffer of ``pool``."""
        if pool not in POOLS:
            raise ConfigError(f"unknown pool {pool!r}; pools are {', '.join(POOLS)}")
        if pool not in self.geometry:
            return pool_geometry(self.spec, pool, self.page_size).page_bytes
        return self.geometry[pool].page_bytes

    def token_page_bytes(self) -> int:
        """Bytes of one token page over every allocated buffer of every pool."""
        return sum(sum(slots) * self.geometry[p].page_bytes for p, slots in self.plan.items() if slots)

    def planned_bytes(self) -> int:
        return self.token_page_bytes() * self.num_pages

    def pool_bytes(self) -> dict[str, int]:
        """Bytes each pool really holds, summed over its tensors (None slots count 0)."""
        return {pool: sum(t.numel() * t.element_size() for t in bufs if t is not None)
                for pool, bufs in self.buffers.items()}

    # -- lookup through the one translation point ---------------------------------------------
    def get_raw_buffer(self, pool: str, global_layer_id: int):
        """The ``(num_pages, page_bytes)`` buffer of ``pool`` for a global layer id."""
        index = self.stage_map.pool_index(pool, global_layer_id)  # LayerNotOwnedError names the range
        bufs = self.buffers.get(pool, [])
        m = self.stage_map
        if not 0 <= index < len(bufs):
            raise LayerNotOwnedError(
                f"stage {m.stage} (global layers [{m.start}, {m.end})): global layer "
                f"{global_layer_id} maps to {POOL_LABELS[pool]} buffer {index}, but the pool holds "
                f"{len(bufs)} buffers"
            )
        buf = bufs[index]
        if buf is None:
            raise LayerNotOwnedError(
                f"stage {m.stage} (global layers [{m.start}, {m.end})): {POOL_LABELS[pool]} buffer "
                f"{index} for global layer {global_layer_id} is None"
            )
        return buf

    def get_swa_raw_buffer(self, global_layer_id: int):
        """SWA buffer of a global layer: the call the PP+HiCache bug got wrong."""
        return self.get_raw_buffer("swa", global_layer_id)

    # -- validation on the real tensors -------------------------------------------------------
    def inventory(self) -> PoolInventory:
        return PoolInventory.from_buffers(self.stage_map.stage, self.buffers)

    def errors(self) -> list[MappingError]:
        """Mapping errors of the real buffers (for a partial build: of the kinds it holds)."""
        return [e for e in validate_stage(self.stage_map, self.inventory())
                if e.pool in self.kinds or e.pool not in POOLS]

    def __repr__(self) -> str:
        counts = {p: len(b) for p, b in self.buffers.items()}
        return (f"StagePools(stage={self.stage_map.stage}, pages={self.num_pages}x{self.page_size}, "
                f"device={self.device}, buffers={counts})")
