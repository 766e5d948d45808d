"""How full each pool kind of a stage is, on the device and in the host tier: read from the allocators.

Each kind has its *own* space inside its tier's page-id space (an SWA-budget kind can hold fewer
pages than a full-budget one; a per-request kind counts request slots), so per kind and tier
this reports ``used`` / ``capacity`` / ``peak`` units of that space -- views, never to be summed
across kinds -- and the kind's own bytes, which do sum to the stage's (docs/pools.md,
"Occupancy of every pool kind").
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model.pool_kinds import PoolKind
from .allocator import PageAllocator
from .host_pools import HostPools
from .pools import StagePools


@dataclass(frozen=True)
class Occupancy:
    """One pool kind on one tier of one stage."""

    pool: str
    tier: str  # device | host
    unit: str  # page | slot
    used: int
    capacity: int
    peak: int  # the most units ever in use at once (the allocator's high-water mark)
    unit_bytes: int  # one unit over every buffer of the kind

    @property
    def used_bytes(self) -> int:
        return self.used * self.unit_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.capacity * self.unit_bytes



def _row(kind: PoolKind, tier: str, capacity: int, allocator: PageAllocator, unit_bytes: int) -> Occupancy:
    return Occupancy(kind.name, tier, "page" if kind.paged else "slot",
                     allocator.used_below(capacity), capacity, min(allocator.peak_used, capacity),
                     unit_bytes)


def stage_occupancy(pools: StagePools, host: HostPools | None = None) -> list[Occupancy]:
    """Every pool kind the stage holds buffers of, device rows then host rows (display order)."""
    rows = []
    for plan in pools.plan.pools:
        p, n = plan.pool, plan.present
        if not n:
            continue
        alloc = pools.allocator if plan.kind.paged else pools.slot_allocator
        rows.append(_row(plan.kind, "device", pools.units[p], alloc, n * pools.page_bytes(p)))
    if host is not None:
        for plan in pools.plan.pools:
            n = sum(host.mirrored.get(plan.pool, ()))
            if n:
                rows.append(_row(plan.kind, "host", host.kind_pages[plan.pool], host.allocator,
                                 n * host.page_bytes(plan.pool)))
    return rows
