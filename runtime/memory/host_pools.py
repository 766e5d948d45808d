"""Host (HiCache) mirror of a stage's device pools: the host-cached kinds, same buffer counts, own pages.

The host mirror is built *from* the device ``StagePools`` so it can never be
sized by a different layer count than the device side -- the PP+HiCache bug
was exactly a host stack that disagreed with the device pools.  A device side
with mapping errors is refused here (the original crash, but with the stage,
pool and counts in the message) unless ``allow_invalid`` is set.

Only the kinds the pool-kind table marks host-cached are mirrored: the
per-request C128 compress state stays on the device, as in sglang's HiCache.
Host pages are ``int(device pages x --hicache-ratio)`` of each kind's budget
(sglang refuses a host size in bytes for DeepSeek-V4).

Two layouts, as in sglang's HiCache:

* ``layer_first`` -- one ``(num_pages, page_bytes)`` tensor per buffer, like the
  device side; a layer's pages are contiguous (good for layer-by-layer loads).
* ``page_first``  -- one ``(num_pages, buffers, page_bytes)`` tensor per pool
  kind; a token page of every layer is one contiguous block (good for storage
  back-ends and large DMAs).  ``buffers[pool][i]`` is then a strided view.

Host pages are pinned (page-locked) when CUDA is present, so DMA and the
zero-copy kernels can reach them.  Pinning can be refused (``cudaHostAlloc``
fails: a locked-memory limit, a host short of RAM).  The rule: when pinning is
only the default (``pin_memory=None``) the tier falls back to pageable memory
and records why (``pin_error``; the transfer controller then takes its torch
path, and the stage's host-tier status says ``pin_refused``); when pinning was
asked for (``pin_memory=True``, e.g. a benchmark of pinned copies) it refuses
with a one-line error.  ``pin_fallback`` overrides the rule either way.

Before any tensor is allocated the tier is checked against the host's RAM
(``host_tier``: ``MemAvailable`` less a reserve), with a value of
``--hicache-ratio`` that fits in the error.
"""

from __future__ import annotations

from ..errors import ConfigError, LayerNotOwnedError, StageMappingInvalid
from ..model.pool_kinds import HOST_CACHED, KINDS, POOLS
from .allocator import PageAllocator
from .host_tier import fit_advice, fmt_bytes, ram_budget, read_meminfo
from .pools import StagePools, _StageBuffers
from .sizing import host_pages_for

LAYOUTS = ("layer_first", "page_first")


class HostPools(_StageBuffers):
    """Host mirror of one stage's device pools."""

    def __init__(
        self,
        device_pools: StagePools,
        num_pages: int | None = None,
        hicache_ratio: float | None = None,
        hicache_size_bytes: int | None = None,
        layout: str = "layer_first",
        pin_memory: bool | None = None,
        allow_invalid: bool = False,
        pin_fallback: bool | None = None,
    ):
        import torch

        dp = device_pools
        where = f"stage {dp.stage_map.stage} host pools"
        if layout not in LAYOUTS:
            raise ConfigError(f"{where}: unknown layout {layout!r}; layouts are {', '.join(LAYOUTS)}")
        problems = dp.errors()
        if problems and not allow_invalid:
            raise StageMappingInvalid(problems)
        self.device_pools = dp
        self.spec = dp.spec
        self.stage_map = dp.stage_map
        self.page_size = dp.page_size
        self.layout = layout
        #: The kinds mirrored here: the device side's host-cached kinds.
        self.kinds: tuple[str, ...] = tuple(p for p in dp.kinds if p in HOST_CACHED)
        self.plan = {pool: tuple(b is not None for b in dp.buffers[pool]) if pool in self.kinds else ()
                     for pool in POOLS}
        self.kind_pages = self._kind_pages(where, num_pages, hicache_ratio, hicache_size_bytes)
        #: The host page-id space: pages of the full-token budget (every kind's, at swa ratio 1).
        self.num_pages = (num_pages if num_pages is not None
                          else host_pages_for(dp.num_pages, hicache_ratio, hicache_size_bytes))
        self._check_fits(where, hicache_ratio, num_pages is not None)
        fallback = pin_memory is None if pin_fallback is None else bool(pin_fallback)
        self.pinned = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        if self.pinned and not fallback and not torch.cuda.is_available():
            raise ConfigError(f"{where}: pin_memory=True needs CUDA, and none is available")
        #: Why pinned memory was refused (None: it was not, or was not asked for).
        self.pin_error: str | None = None
        self.buffers: dict[str, list[torch.Tensor | None]] = {}
        #: page_first: the one tensor of each pool kind, (num_pages, buffers, page_bytes).
        self.pool_tensors: dict[str, torch.Tensor] = {}
        self._alloc_all(where, torch, fallback)
        self.allocator = PageAllocator(self.num_pages, f"stage {self.stage_map.stage} host")

    def _kind_pages(self, where: str, num_pages: int | None, hicache_ratio: float | None,
                    hicache_size_bytes: int | None) -> dict[str, int]:
        """Host pages per mirrored kind: ``num_pages`` each, or its device units x ratio."""
        if num_pages is not None:
            if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages <= 0:
                raise ConfigError(f"{where}: number of host pages must be a positive integer, got {num_pages!r}")
            return {p: num_pages for p in self.kinds}
        units = self.device_pools.units
        return {p: host_pages_for(units[p], hicache_ratio, hicache_size_bytes) for p in self.kinds}

    def _check_fits(self, where: str, hicache_ratio: float | None, by_pages: bool) -> None:
        """The RAM rule of ``host_tier`` for this tier alone, before any tensor exists."""
        need = sum(self.pool_bytes().values())
        mem = read_meminfo()
        if mem is None or need <= ram_budget(mem):
            return
        per_page = self.token_page_bytes()
        ratio = 2.0 if hicache_ratio is None else hicache_ratio
        dev = self.device_pools.num_pages
        if by_pages:  # sized by a page count, not by a ratio
            fit = ram_budget(mem) // max(1, per_page)
            hint = f"lower the host page count to {fit}" if fit else "free memory or use a larger host"
        else:
            hint = fit_advice(lambda pages, r: host_pages_for(pages, r) * per_page, ram_budget(mem),
                              dev, ratio, pages_flag="--device-pages")
        raise ConfigError(
            f"{where}: {self.num_pages} host pages x {per_page} B = {fmt_bytes(need)} needed, only "
            f"{fmt_bytes(ram_budget(mem))} of host RAM available ({fmt_bytes(mem.available)} less the "
            f"reserve); {hint}"
        )

    def _alloc_all(self, where: str, torch, fallback: bool) -> None:
        """Every buffer, pinned if asked; a refused pin falls back to pageable or refuses."""
        try:
            for pool in POOLS:
                self.buffers[pool] = self._alloc(pool, torch)
            return
        except RuntimeError as exc:
            if not self.pinned:
                raise ConfigError(f"{where}: allocating {fmt_bytes(sum(self.pool_bytes().values()))} "
                                  f"of host memory failed: {_first_line(exc)}") from None
            error = _first_line(exc)
        self.buffers.clear()
        self.pool_tensors.clear()
        if not fallback:
            raise ConfigError(f"{where}: pinned host memory refused ({error}); pin_memory=True needs "
                              "CUDA and enough pinnable RAM: lower --hicache-ratio") from None
        self.pin_error, self.pinned = error, False
        self._alloc_all(where, torch, fallback)

    def _alloc(self, pool: str, torch) -> list:
        slots = self.plan[pool]
        if not slots:
            return []
        shape = (self.kind_pages[pool], self.page_bytes(pool))
        if self.layout == "layer_first":
            return [torch.zeros(shape, dtype=torch.uint8, pin_memory=self.pinned) if ok else None for ok in slots]
        whole = torch.zeros((shape[0], len(slots), shape[1]), dtype=torch.uint8, pin_memory=self.pinned)
        self.pool_tensors[pool] = whole
        return [whole[:, i, :] if ok else None for i, ok in enumerate(slots)]

    # -- sizes -------------------------------------------------------------------------------
    def page_bytes(self, pool: str) -> int:
        return self.device_pools.page_bytes(pool)

    def page_stride(self, pool: str) -> int:
        """Bytes from page p to page p+1 inside one buffer of ``pool`` (layout dependent)."""
        pb = self.page_bytes(pool)
        return pb * len(self.plan[pool]) if self.layout == "page_first" else pb

    def token_page_bytes(self) -> int:
        return sum(sum(slots) * self.page_bytes(p) for p, slots in self.plan.items() if slots)

    def pool_bytes(self) -> dict[str, int]:
        """Bytes each pool's present buffers hold (page_first: the same total, one tensor)."""
        return {pool: sum(self.kind_pages[pool] * self.page_bytes(pool) for ok in slots if ok)
                for pool, slots in self.plan.items()}

    # -- lookup --------------------------------------------------------------------------------
    def get_raw_buffer(self, pool: str, global_layer_id: int):
        index = self.stage_map.pool_index(pool, global_layer_id)
        bufs = self.buffers.get(pool, [])
        if not 0 <= index < len(bufs) or bufs[index] is None:
            m = self.stage_map
            raise LayerNotOwnedError(
                f"stage {m.stage} host (global layers [{m.start}, {m.end})): global layer "
                f"{global_layer_id} maps to {KINDS[pool].label} buffer {index}, which the host pool "
                f"does not hold ({len(bufs)} buffers)"
            )
        return bufs[index]

    def __repr__(self) -> str:
        return (f"HostPools(stage={self.stage_map.stage}, pages={self.num_pages}, layout={self.layout}, "
                f"pinned={self.pinned})")


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
