"""Which buffers a transfer moves: a frozen selection, built once per (layers, pool kinds) and cached.

A plan is pure data (pool kind, buffer index, page bytes and both page strides of
every selected buffer) derived from the device pools, their host mirror and the
stage's layer map, so the engines never look at layer ids and a plan is a
stable cache key for the launch geometry and the CUDA graph built from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from ..memory.host_pools import HostPools
from ..memory.pools import StagePools
from .pages import TransferError


@dataclass(frozen=True)
class BufferRef:
    """One selected buffer: ``buffers[pool][index]`` on both sides."""

    pool: str
    index: int
    page_bytes: int
    host_stride: int  # bytes from host page p to p+1 (page_first: all buffers of the kind)


@dataclass(frozen=True)
class Plan:
    """The buffers one transfer moves and the global layers they cover.

    Hash and byte count are computed once: a plan is a dict key on every call (its
    generated hash would walk every buffer, ~15 us for a 39-buffer stage).
    """

    buffers: tuple[BufferRef, ...]
    layers: tuple[int, ...]

    @cached_property
    def _hash(self) -> int:
        return hash((self.buffers, self.layers))

    def __hash__(self) -> int:
        return self._hash

    @cached_property
    def page_bytes(self) -> int:
        """Bytes of one token page over the selected buffers."""
        return sum(b.page_bytes for b in self.buffers)

    def nbytes(self, pages: int) -> int:
        return self.page_bytes * pages

    @cached_property
    def kinds(self) -> tuple[tuple[str, int], ...]:
        """``(pool kind, bytes of one token page over its selected buffers)``, in buffer order.

        What ``TransferStats`` splits a transfer's bytes and DMA time by; computed once.
        """
        per: dict[str, int] = {}
        for b in self.buffers:
            per[b.pool] = per.get(b.pool, 0) + b.page_bytes
        return tuple(per.items())


def buffer_addresses(plan: Plan, dp: StagePools, hp: HostPools) -> list[tuple[int, int, int, int, int]]:
    """Where the engines copy a plan's pages from and to, per selected buffer: (page bytes, device
    base address, host base address, device page stride, host page stride), all in bytes.

    Addresses of live tensors, so made by an engine (once per plan), not kept in the plan."""
    rows = []
    for ref in plan.buffers:
        d, h = dp.buffers[ref.pool][ref.index], hp.buffers[ref.pool][ref.index]
        rows.append((ref.page_bytes, d.data_ptr(), h.data_ptr(), d.stride(0) * d.element_size(),
                     h.stride(0) * h.element_size()))
    return rows


def mirrored_kinds(dp: StagePools, hp: HostPools) -> tuple[str, ...]:
    """Pool kinds with at least one buffer on both sides (the kinds HiCache pages move)."""
    return tuple(p for p, bufs in hp.buffers.items()
                 if any(h is not None and d is not None for d, h in zip(dp.buffers.get(p, ()), bufs, strict=False)))


def _ref(dp: StagePools, hp: HostPools, pool: str, index: int) -> BufferRef:
    return BufferRef(pool, index, dp.page_bytes(pool), hp.page_stride(pool))


def build_plan(dp: StagePools, hp: HostPools, layers: Sequence[int] | None,
               kinds: Sequence[str] | None) -> Plan:
    """The plan of ``layers`` (global ids; None = the whole stage) of ``kinds`` (None = all mirrored)."""
    m = dp.stage_map
    mirrored = mirrored_kinds(dp, hp)
    if kinds is not None:
        unknown = [k for k in kinds if k not in hp.buffers]
        if unknown:
            raise TransferError(f"stage {m.stage}: unknown pool kind(s) {unknown}; "
                                f"pools are {', '.join(hp.buffers)}")
    selected = [p for p in mirrored if kinds is None or p in kinds]
    if layers is None:
        refs = [_ref(dp, hp, pool, i) for pool in selected
                for i, (d, h) in enumerate(zip(dp.buffers[pool], hp.buffers[pool], strict=True))
                if d is not None and h is not None]
        return Plan(tuple(refs), tuple(range(m.start, m.end)))
    gids: list[int] = []
    for g in layers:
        if isinstance(g, bool) or not isinstance(g, int):
            raise TransferError(f"stage {m.stage}: layer ids must be integers, got {g!r}")
        m.local_id(g)  # LayerNotOwnedError names the stage's range
        if g not in gids:
            gids.append(g)
    refs = []
    for pool in selected:
        for g in gids:
            idx = m.pool_map(pool).get(m.local_id(g))
            if idx is None:
                continue
            if idx >= len(dp.buffers[pool]) or dp.buffers[pool][idx] is None or hp.buffers[pool][idx] is None:
                raise TransferError(f"stage {m.stage}: {pool} buffer {idx} of layer {g} is missing")
            refs.append(_ref(dp, hp, pool, idx))
    return Plan(tuple(refs), tuple(gids))
