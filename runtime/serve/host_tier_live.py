"""A serving stage's host-tier verdict and pool occupancy, as ``StageLive`` fields.

The verdict is ``memory.host_tier``'s, over this stage's pools and the host's
``/proc/meminfo``, re-read at most every ``RAM_CHECK_INTERVAL_S`` (a small file
read: cheap enough for every publish and every heartbeat), so a host that runs
short during the run turns the status without a restart.  The tier is allocated
by then, so the bytes still to allocate are 0 and the RAM rule reduces to
"MemAvailable above the reserve".

The ``host-ram-short`` fault raises the reserve to all of the host's RAM after
the stage's first micro-batch (``arm``): the readings stay real, the status turns.
"""

from __future__ import annotations

from typing import Any

from ..live.numbers import HostTierLive, PoolOccupancy
from ..memory.host_tier import RamWatch, host_tier_check
from ..memory.occupancy import stage_occupancy


class StageHostTier:
    """One stage's host-tier status, computed afresh on every ``live()``."""

    def __init__(self, pools: Any, host: Any, write_policy: str, faults: set[str] = frozenset()):
        self.pools, self.host, self.write_policy = pools, host, write_policy
        self.watch = RamWatch()
        self.short_fault = "host-ram-short" in faults
        self.where = f"stage {pools.stage_map.stage} host tier"

    def arm(self) -> None:
        """After the first micro-batch: the ``host-ram-short`` fault reserves all RAM."""
        if self.short_fault:
            self.watch.reserve_fraction = 1.0

    def live(self) -> HostTierLive:
        host, pools = self.host, self.pools
        mem = self.watch.read()
        device = {p: pools.units[p] for p in host.kinds}
        check = host_tier_check(self.where, device, {p: host.kind_pages[p] for p in device}, 0, mem,
                                host.pin_error, self.write_policy, self.watch.reserve_fraction)
        return HostTierLive(
            status=list(check.statuses), reasons=list(check.reasons), ready=check.ready,
            pinned=bool(host.pinned), pin_error=host.pin_error, device_pages=pools.num_pages,
            host_pages=host.num_pages, host_bytes=sum(host.pool_bytes().values()),
            mem_available_bytes=mem.available if mem else None,
            mem_total_bytes=mem.total if mem else None,
            reserve_bytes=mem.reserve(self.watch.reserve_fraction) if mem else None,
            checked_at=self.watch.checked_at,
        )


def occupancy_live(pools: Any, host: Any | None) -> list[PoolOccupancy]:
    """``memory.occupancy`` rows as ``StageLive.pool_occupancy``."""
    return [PoolOccupancy.model_validate(o, from_attributes=True) for o in stage_occupancy(pools, host)]
