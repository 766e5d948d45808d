"""Which buffers a transfer moves: a frozen selection, built once per (layers, pool kinds) and cached.

A selection is pure data (pool kind, global layer, buffer index, page bytes and the host page
stride of every selected buffer), resolved through the pools' one global -> stage-local
translation (``get_raw_buffer``), so the engines never look at layer ids and a selection is a
stable cache key for the launch geometry and the CUDA graph built from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from ..errors import LayerNotOwnedError
from ..memory.host_pools import HostPools
from ..memory.pools import StagePools
from .pages import TransferError


@dataclass(frozen=True)
class BufferRef:
    """One selected buffer: the buffer of ``pool`` that global ``layer`` maps to, on both sides."""

    pool: str
    layer: int  # global layer id
    index: int  # the buffer's index in its pool (what the translation gave)
    page_bytes: int
    host_stride: int  # bytes from host page p to p+1 (page_first: all buffers of the kind)


@dataclass(frozen=True)
class Selection:
    """The buffers one transfer moves and the global layers they cover.

    Hash and byte count are computed once: a selection is a dict key on every call (its
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


def buffer_pair(ref: BufferRef, dp: StagePools, hp: HostPools) -> tuple[torch.Tensor, torch.Tensor]:
    """The device and host tensors of a selected buffer, through the translation."""
    return dp.get_raw_buffer(ref.pool, ref.layer), hp.get_raw_buffer(ref.pool, ref.layer)


def buffer_addresses(sel: Selection, dp: StagePools, hp: HostPools) -> list[tuple[int, int, int, int, int]]:
    """Where the engines copy a selection's pages from and to, per selected buffer: (page bytes,
    device base address, host base address, device page stride, host page stride), all in bytes.

    Addresses of live tensors, so made by an engine (once per selection), not kept in it."""
    rows = []
    for ref in sel.buffers:
        d, h = buffer_pair(ref, dp, hp)
        rows.append((ref.page_bytes, d.data_ptr(), h.data_ptr(), d.stride(0) * d.element_size(),
                     h.stride(0) * h.element_size()))
    return rows


def mirrored_kinds(dp: StagePools, hp: HostPools) -> tuple[str, ...]:
    """Pool kinds with at least one buffer on both sides (the kinds HiCache pages move)."""
    return tuple(p for p in hp.kinds if any(b is not None for b in dp.buffers.get(p, ())))


def _layer_ids(dp: StagePools, layers: Sequence[int]) -> list[int]:
    """The requested global layers, checked (integers owned by the stage), duplicates dropped."""
    m = dp.stage_map
    gids: list[int] = []
    for g in layers:
        if isinstance(g, bool) or not isinstance(g, int):
            raise TransferError(f"stage {m.stage}: layer ids must be integers, got {g!r}")
        m.local_id(g)  # LayerNotOwnedError names the stage's range
        if g not in gids:
            gids.append(g)
    return gids


def select(dp: StagePools, hp: HostPools, layers: Sequence[int] | None,
           kinds: Sequence[str] | None) -> Selection:
    """The selection of ``layers`` (global ids; None = the whole stage) of ``kinds`` (None = all
    mirrored), each buffer found by ``get_raw_buffer(pool, layer)``."""
    m = dp.stage_map
    if kinds is not None:
        unknown = [k for k in kinds if k not in hp.buffers]
        if unknown:
            raise TransferError(f"stage {m.stage}: unknown pool kind(s) {unknown}; "
                                f"pools are {', '.join(hp.buffers)}")
    gids = list(range(m.start, m.end)) if layers is None else _layer_ids(dp, layers)
    refs, seen = [], set()
    for pool in mirrored_kinds(dp, hp):
        if kinds is not None and pool not in kinds:
            continue
        for g in gids:
            if not any(e.global_id == g for e in m.pool_layers(pool)):
                continue  # the layer has no buffer of this kind (its ratio)
            try:
                dp.get_raw_buffer(pool, g), hp.get_raw_buffer(pool, g)
            except LayerNotOwnedError as exc:
                if layers is None:
                    continue  # a faulty stage's missing buffer: the whole-stage move skips it
                raise TransferError(f"stage {m.stage}: {exc}") from None
            index = m.pool_index(pool, g)
            if (pool, index) not in seen:
                seen.add((pool, index))
                refs.append(BufferRef(pool, g, index, dp.page_bytes(pool), hp.page_stride(pool)))
    return Selection(tuple(refs), tuple(gids))
