"""A PP stage's device KV pools, allocated exactly as the stage's plan says, as raw byte tensors.

Each buffer is a ``torch.uint8`` tensor ``(units, page_bytes)``: raw bytes keep
copies bit-exact whatever the element types inside (FP8, BF16, FP32 scales),
and a page is one contiguous row, which is what the transfer kernels gather.
Units are pages of the kind's token budget, or request slots for a per-request kind
(DeepSeek V4's ``c128_state``); both, and every buffer count, come from the ``StagePlan``.

The runtime keeps one page-id space per stage: page ``p`` of every paged pool
is token page ``p``, so a single ``PageAllocator`` serves all pools and one page
id moves a token page of every layer between device and host.

A faulted plan is allocated as it is (a global-sized SWA list, a None C4-state
buffer): ``serve --fault`` builds genuinely wrong pools, and validation
(``inventory()`` against the layer map) runs on those real tensors.  The pools
never validate themselves: memory allocates plans, validation checks them.

Every lookup goes through the one global -> stage-local translation (``get_raw_buffer``,
as sglang's ``get_swa_raw_buffer`` is for its DeepSeek V4 pool): serve, the transfer selection
and the KV writer address buffers by global layer id only.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from ..errors import ConfigError, LayerNotOwnedError
from ..model.layer_map import StageLayerMap
from ..plan.inventory import PoolInventory
from ..plan.plan import StagePlan, select_kinds
from ..plan.sizing import TokenBudget
from .allocator import PageAllocator
from .host_tier import fitting_pages, fmt_bytes, ram_budget, read_meminfo


def available_memory_bytes(device: torch.device) -> int | None:
    """Bytes the pools may take where they would live: CUDA free memory, or on the host
    ``MemAvailable`` less the RAM reserve (``host_tier.RAM_RESERVE_FRACTION``)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        mem = read_meminfo()
        return None if mem is None else ram_budget(mem)
    return None  # meta and other devices: no limit we can know


class StageBuffers:
    """What device pools and their host mirror share: the plan, the buffer lists, and the
    global -> local lookups."""

    where: str
    plan: StagePlan
    buffers: dict[str, list[torch.Tensor | None]]

    @property
    def stage_map(self) -> StageLayerMap:
        return self.plan.layer_map

    @property
    def page_size(self) -> int:
        return self.plan.budget.page_size

    @property
    def kinds(self) -> tuple[str, ...]:
        """Pool kinds this object holds buffers of."""
        return tuple(p.pool for p in self.plan.pools if p.buffers)

    def page_bytes(self, pool: str) -> int:
        """Bytes of one page (one request slot for a per-request kind) of one buffer of ``pool``."""
        return self.plan.pool(pool).page_bytes

    def inventory(self) -> PoolInventory:
        return PoolInventory.from_buffers(self.stage_map.stage, self.buffers)

    def get_raw_buffer(self, pool: str, global_layer_id: int) -> torch.Tensor:
        """The buffer of ``pool`` for a global layer id: the one translation point.

        A layer outside the stage, of another ratio, or whose buffer is missing or None is a
        ``LayerNotOwnedError`` (a ``ValueError``, as sglang's mapping errors) naming the stage.
        """
        index = self.stage_map.pool_index(pool, global_layer_id)
        bufs = self.buffers.get(pool, [])
        buf = bufs[index] if 0 <= index < len(bufs) else None
        if buf is None:
            m = self.stage_map
            held = "is None" if index < len(bufs) else f"is missing (the pool holds {len(bufs)})"
            raise LayerNotOwnedError(
                f"{self.where} (global layers [{m.start}, {m.end})): global layer {global_layer_id} "
                f"maps to {m.kind(pool).label} buffer {index}, which {held}"
            )
        return buf

    def pool_page_bytes(self) -> dict[str, int]:
        """Per pool kind, one page (slot) over its real tensors: what ``serve`` reports, measured."""
        return {pool: sum(t.shape[1] * t.element_size() for t in bufs if t is not None)
                for pool, bufs in self.buffers.items()}


class StagePools(StageBuffers):
    """Device pools of one PP stage: ``buffers[pool][i]`` is buffer ``i`` of that pool.

    ``kinds`` keeps only some pool kinds (benchmarks, single-kind tools).
    """

    def __init__(self, plan: StagePlan, device: str | torch.device = "cpu",
                 kinds: Collection[str] | None = None):
        self.where = f"stage {plan.stage} device pools"
        self.plan = select_kinds(plan, kinds) if kinds is not None else plan
        self.device = torch.device(device)
        _check_runtime(self.plan, self.where)
        #: Pages (or request slots) per kind: full pages, SWA pages, request slots.
        self.units = {p.pool: p.units for p in self.plan.pools}
        self.num_pages = self.plan.budget.full_pages
        self._check_fits()
        self.buffers = {
            p.pool: [torch.zeros((p.units, p.page_bytes), dtype=torch.uint8, device=self.device)
                     if present else None for present in p.buffers]
            for p in self.plan.pools
        }
        self.allocator = PageAllocator(self.num_pages, f"stage {plan.stage} device")
        #: Request slots of the per-request kinds: one per request in flight.
        self.slot_allocator = PageAllocator(self.plan.budget.request_slots, f"stage {plan.stage} request slots")

    @property
    def budget(self) -> TokenBudget:
        return self.plan.budget

    def token_page_bytes(self) -> int:
        return self.plan.token_page_bytes

    def pool_bytes(self) -> dict[str, int]:
        """Bytes each pool really holds, summed over its tensors (None buffers count 0)."""
        return {pool: sum(t.numel() * t.element_size() for t in bufs if t is not None)
                for pool, bufs in self.buffers.items()}

    def _check_fits(self) -> None:
        need = self.plan.device_bytes
        free = available_memory_bytes(self.device)
        if free is None or need <= free:
            return
        per_page = self.plan.token_page_bytes
        fixed = need - self.num_pages * per_page  # the per-request kinds

        def need_for(pages: int, _ratio: float) -> int:
            return fixed + pages * per_page

        fit = fitting_pages(need_for, free, self.num_pages, 1.0)
        hint = (f"lower --device-pages to {fit} (--max-total-tokens to {fit * self.page_size})"
                if fit else "no page count fits: free memory or use a larger device")
        raise ConfigError(
            f"{self.where}: {self.num_pages} pages x {per_page} B per token page "
            f"= {fmt_bytes(need)} needed, only {fmt_bytes(free)} free on {self.device}; {hint}"
        )

    def __repr__(self) -> str:
        counts = {p: len(b) for p, b in self.buffers.items()}
        return (f"StagePools(stage={self.stage_map.stage}, pages={self.num_pages}x{self.page_size}, "
                f"device={self.device}, buffers={counts})")


def _check_runtime(plan: StagePlan, where: str) -> None:
    """Pools allocate page-addressable rows: a plan sized the runtime way (sglang's sizing adds
    reserved rows and ring rows that only ``stagecache pools`` reports)."""
    odd = [p.pool for p in plan.pools if p.buffers and (p.tensor_rows, p.tensor_row_bytes) != (p.units, p.page_bytes)]
    if odd:
        raise ConfigError(f"{where}: the plan is sized the sglang way ({', '.join(odd)} have reserved or "
                          "ring rows); pools are allocated from a runtime plan (Sizing.runtime)")
