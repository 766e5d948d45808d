"""Host (HiCache) mirror of a stage's device pools: the host-cached kinds, same buffer counts, own pages.

Built *from* the device ``StagePools`` (the same stage plan and buffer lists), so it can never
be sized by a different layer count than the device side: the PP+HiCache bug was exactly a host
stack that disagreed with the device pools.  Only the kinds the pool-kind table marks
host-cached are mirrored (the C128 compress state stays on the device, as in sglang).  Layouts
(``layer_first``, ``page_first``) are sglang's; pages are pinned where CUDA is present, with the
fallback rule of docs/pools.md when pinning is refused, and checked against the host's RAM
(``host_tier``) before any tensor is allocated.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..plan.sizing import host_pages_for
from .allocator import PageAllocator
from .host_tier import fit_advice, fmt_bytes, ram_budget, read_meminfo
from .pools import StageBuffers, StagePools

LAYOUTS = ("layer_first", "page_first")


class HostPools(StageBuffers):
    """Host mirror of one stage's device pools."""

    def __init__(
        self,
        device_pools: StagePools,
        layout: str = "layer_first",
        pin_memory: bool | None = None,
        pin_fallback: bool | None = None,
    ):
        dp = device_pools
        self.where = f"stage {dp.stage_map.stage} host pools"
        if layout not in LAYOUTS:
            raise ConfigError(f"{self.where}: unknown layout {layout!r}; layouts are {', '.join(LAYOUTS)}")
        self.device_pools = dp
        self.plan = dp.plan
        self.layout = layout
        #: Per mirrored kind, the present flag of each buffer (the device side's: a None device
        #: buffer has no host mirror); kinds the host tier does not hold map to () -- as do the
        #: kinds a fault leaves out of the host set (no host pages in the plan).
        # (stagecache's own host tier is page-addressed: per-request state stays on the device)
        cached = {p.pool for p in self.plan.pools if p.kind.host_cached and p.host_pages and p.kind.paged}
        self.mirrored = {p: tuple(b is not None for b in dp.buffers[p]) if p in cached else ()
                         for p in dp.buffers}
        self.kind_pages = {p.pool: p.host_pages for p in self.plan.pools if p.pool in cached}
        #: The host page-id space: pages of the full-token budget.
        self.num_pages = self.plan.host_pages
        self._check_fits()
        fallback = pin_memory is None if pin_fallback is None else bool(pin_fallback)
        self.pinned = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        if self.pinned and not fallback and not torch.cuda.is_available():
            raise ConfigError(f"{self.where}: pin_memory=True needs CUDA, and none is available")
        #: Why pinned memory was refused (None: it was not, or was not asked for).
        self.pin_error: str | None = None
        self.buffers: dict[str, list[torch.Tensor | None]] = {}
        #: page_first: the one tensor of each pool kind, (num_pages, buffers, page_bytes).
        self.pool_tensors: dict[str, torch.Tensor] = {}
        self._alloc_all(fallback)
        self.allocator = PageAllocator(self.num_pages, f"stage {self.stage_map.stage} host")

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds mirrored here: the device side's host-cached kinds."""
        return tuple(p for p, present in self.mirrored.items() if present)

    def _check_fits(self) -> None:
        """The RAM rule of ``host_tier`` for this tier alone, before any tensor exists."""
        need = sum(self.pool_bytes().values())
        mem = read_meminfo()
        if mem is None or need <= ram_budget(mem):
            return
        per_page = self.token_page_bytes()
        sizing = self.plan.sizing
        if sizing.host_pages is not None:  # sized by a page count, not by a ratio
            fit = ram_budget(mem) // max(1, per_page)
            hint = f"lower the host page count to {fit}" if fit else "free memory or use a larger host"
        else:
            hint = fit_advice(lambda pages, r: host_pages_for(pages, r) * per_page, ram_budget(mem),
                              self.device_pools.num_pages, sizing.hicache_ratio, pages_flag="--device-pages")
        raise ConfigError(
            f"{self.where}: {self.num_pages} host pages x {per_page} B = {fmt_bytes(need)} needed, only "
            f"{fmt_bytes(ram_budget(mem))} of host RAM available ({fmt_bytes(mem.available)} less the "
            f"reserve); {hint}"
        )

    def _alloc_all(self, fallback: bool) -> None:
        """Every buffer, pinned if asked; a refused pin falls back to pageable or refuses."""
        try:
            for pool in self.mirrored:
                self.buffers[pool] = self._alloc(pool)
            return
        except RuntimeError as exc:
            if not self.pinned:
                raise ConfigError(f"{self.where}: allocating {fmt_bytes(sum(self.pool_bytes().values()))} "
                                  f"of host memory failed: {_first_line(exc)}") from None
            error = _first_line(exc)
        self.buffers.clear()
        self.pool_tensors.clear()
        if not fallback:
            raise ConfigError(f"{self.where}: pinned host memory refused ({error}); pin_memory=True needs "
                              "CUDA and enough pinnable RAM: lower --hicache-ratio") from None
        self.pin_error, self.pinned = error, False
        self._alloc_all(fallback)

    def _alloc(self, pool: str) -> list[torch.Tensor | None]:
        present = self.mirrored[pool]
        if not present:
            return []
        shape = (self.kind_pages[pool], self.page_bytes(pool))
        if self.layout == "layer_first":
            return [torch.zeros(shape, dtype=torch.uint8, pin_memory=self.pinned) if ok else None for ok in present]
        whole = torch.zeros((shape[0], len(present), shape[1]), dtype=torch.uint8, pin_memory=self.pinned)
        self.pool_tensors[pool] = whole
        return [whole[:, i, :] if ok else None for i, ok in enumerate(present)]

    # -- sizes -------------------------------------------------------------------------------
    def page_stride(self, pool: str) -> int:
        """Bytes from page p to page p+1 inside one buffer of ``pool`` (layout dependent)."""
        pb = self.page_bytes(pool)
        return pb * len(self.mirrored[pool]) if self.layout == "page_first" else pb

    def token_page_bytes(self) -> int:
        return sum(sum(present) * self.page_bytes(p) for p, present in self.mirrored.items() if present)

    def pool_bytes(self) -> dict[str, int]:
        """Bytes each pool's present buffers hold (page_first: the same total, one tensor)."""
        return {pool: sum(present) * self.kind_pages.get(pool, 0) * self.page_bytes(pool)
                for pool, present in self.mirrored.items()}

    def __repr__(self) -> str:
        return (f"HostPools(stage={self.stage_map.stage}, pages={self.num_pages}, layout={self.layout}, "
                f"pinned={self.pinned})")


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
