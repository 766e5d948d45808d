"""What ``--l3*`` asks for, and opening one stage's store from it and the run's plan.

The size bound (``--l3-size-gb``) is the deployment's: it is split so that every stage holds the
same number of *pages* (each stage's share is that page count times its own bytes per page), so
the stages' L3 tiers fill and evict alike, as their device and host tiers do.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import defaults
from ..plan.plan import RunPlan, StagePlan
from .base import L3Store, StoreUnavailable
from .file import FileStore
from .keys import KeySpace, key_space
from .segments import record_bound


@dataclass(frozen=True)
class L3Options:
    """The L3 flags of ``serve`` and ``bench hicache``, validated once (picklable)."""

    backend: str = "none"  # none | file | mooncake
    dir: str | None = None  # file: the deployment's directory
    size_bytes: int = int(defaults.L3_SIZE_GB * (1 << 30))
    reset: bool = False
    mooncake_master: str | None = None  # HOST:PORT; serve starts a local master when None
    probe_interval: float = 1.0

    @property
    def enabled(self) -> bool:
        return self.backend != "none"


def object_bytes(stage_plan: StagePlan) -> dict[str, int]:
    """Bytes of one L3 object per host-cached pool kind of a stage (one page, every buffer)."""
    return {p.pool: p.present * p.page_bytes for p in stage_plan.pools
            if p.present and p.host_pages and p.kind.host_cached and p.kind.paged}


def capacity_pages(plan: RunPlan, size_bytes: int) -> int:
    """Pages every stage may keep so that all stages together stay within ``size_bytes``."""
    per_page = sum(sum(record_bound(b) for b in object_bytes(s).values()) for s in plan.stages)
    return size_bytes // per_page if per_page else 0


def stage_capacity_bytes(plan: RunPlan, stage: int, size_bytes: int) -> int:
    own = sum(record_bound(b) for b in object_bytes(plan.stage(stage)).values())
    return capacity_pages(plan, size_bytes) * own


def open_store(opts: L3Options, plan: RunPlan, stage: int, tp_rank: int = 0) -> tuple[L3Store, KeySpace]:
    """Stage ``stage``'s store and key space (``StoreUnavailable`` with one line if it cannot open)."""
    space = key_space(plan, stage, tp_rank)
    if opts.backend == "file":
        if not opts.dir:
            raise StoreUnavailable("--l3 file needs a directory (--l3-dir)")
        cap = stage_capacity_bytes(plan, stage, opts.size_bytes)
        # a stage with no page-addressed pool (a Mamba-only stage) stores nothing in L3
        if cap <= 0 and object_bytes(plan.stage(stage)):
            raise StoreUnavailable(f"--l3-size-gb {opts.size_bytes / (1 << 30):g}: too small for one "
                                   "page of every stage")
        return FileStore(opts.dir, cap, owner=space.prefix), space
    if opts.backend == "mooncake":
        from .mooncake import MooncakeStore

        if not opts.mooncake_master:
            raise StoreUnavailable("--l3 mooncake needs a master address (--l3-mooncake-master)")
        segment = max(64 << 20, opts.size_bytes // max(1, plan.pp_size))
        return MooncakeStore(opts.mooncake_master, segment, probe_interval=opts.probe_interval), space
    raise StoreUnavailable(f"--l3 {opts.backend!r}: no store to open")
