"""One stage's L3 under ``serve``: open its store, pass the startup checks, report its numbers.

The store is opened when the stage builds its cache (a store that cannot open is a startup
error of that stage, not a crash).  Startup, with barriers between the steps so every stage sees
the others' writes (``StageWorker._startup`` calls ``startup``):

1. stage 0 clears the store if ``--l3-reset`` asked, then checks the manifest (``storage/startup``);
2. every stage writes its probe and its own manifest;
3. every stage reads its probe back.

The errors go to rank 0 with the stage's inventory and into the startup report, so a store of
another deployment, or two stages writing one key space, refuse the run (exit 1) naming both.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..cache.insight import SampledHistogram
from ..cache.storage_tier import BANDWIDTH_BUCKETS_GBPS, StorageTier
from ..storage.base import StoreUnavailable
from ..storage.startup import check_manifest, check_probe, write_probe

if TYPE_CHECKING:
    from ..cache.storage_tier import BandwidthHistogram
    from ..live.numbers import L3Live
    from ..memory.host_pools import HostPools
    from .options import StageConfig

log = logging.getLogger(__name__)


class StageL3:
    """The stage's L3 tier, if ``--l3`` asked for one (``tier`` None otherwise)."""

    def __init__(self, cfg: StageConfig, stage: int, host: HostPools):
        self.cfg, self.stage, self.host = cfg, stage, host
        self.opts = cfg.opts.l3
        self.tier: StorageTier | None = None
        self.error: str | None = None
        self.run_id = f"{os.getpid()}-{cfg.parent_pid}-{os.path.basename(cfg.run_dir)}"

    def open(self) -> StorageTier | None:
        if not self.opts.enabled:
            return None
        from ..storage.options import open_store
        from ..storage.views import HostPageViews

        opts = self.opts
        if opts.backend == "file" and not opts.dir:
            import dataclasses

            opts = dataclasses.replace(opts, dir=os.path.join(self.cfg.run_dir, "l3"))
        self.where = f"{opts.backend} store {opts.dir or opts.mooncake_master}"
        try:
            store, space = open_store(opts, self.cfg.opts.plan, self.stage)
            self.tier = StorageTier(store, space, HostPageViews(self.host))
        except StoreUnavailable as exc:
            self.error = f"stage {self.stage}: L3 {exc}"
            return None
        if hasattr(store, "on_up"):
            store.on_up.append(self._reclaim)
        return self.tier

    def _reclaim(self) -> None:
        """A restarted Mooncake master holds no keys: write this stage's probe and manifest again."""
        tier = self.tier
        if tier is not None:
            if self.stage == 0:
                check_manifest(tier.store, self.cfg.opts.plan.fingerprint.to_dict(), self.where)
            write_probe(tier.store, tier.space, self.run_id)

    def startup(self, barrier: Callable[[], None]) -> list[str]:
        """The three steps of the module docstring; this stage's error lines (empty: ready)."""
        if not self.opts.enabled:
            return []
        tier = self.tier
        errors = [self.error] if self.error else []
        if tier is not None and self.stage == 0:
            if self.opts.reset:
                log.warning("L3 %s: --l3-reset: removed %d files", self.where, tier.store.reset())
            err = check_manifest(tier.store, self.cfg.opts.plan.fingerprint.to_dict(), self.where)
            errors += [err] if err else []
        barrier()
        if tier is not None and not errors:
            err = write_probe(tier.store, tier.space, self.run_id)
            errors += [err] if err else []
        barrier()
        if tier is not None and not errors:
            err = check_probe(tier.store, tier.space, self.run_id)
            errors += [err] if err else []
        return errors

    def close(self) -> None:
        if self.tier is not None:
            self.tier.store.close()


def _histogram(h: BandwidthHistogram) -> SampledHistogram:
    return SampledHistogram(le=list(BANDWIDTH_BUCKETS_GBPS), counts=h.cumulative(), sum=h.sum)


def l3_live(tier: StorageTier | None, page_size: int) -> L3Live:
    """The stage's ``StageLive.l3``."""
    from ..live.numbers import L3Directions, L3Live

    if tier is None:
        return L3Live()
    c, s = tier.counters, tier.store.stats
    return L3Live(
        backend=tier.backend, up=s.up, down_reason=s.down_reason, downs=s.downs,
        prefetched_tokens=c.prefetched_pages * page_size, backuped_tokens=c.backuped_pages * page_size,
        backup_failed_pages=c.backup_failed_pages, fallback_pages=c.fallback_pages,
        bytes=L3Directions(prefetch=s.read_bytes, backup=s.write_bytes),
        seconds=L3Directions(prefetch=s.read_seconds, backup=s.write_seconds),
        objects=L3Directions(prefetch=s.reads, backup=s.writes), misses=s.misses, skipped=s.skipped,
        errors=dict(s.errors), evictions=s.evictions, used_bytes=s.used_bytes,
        capacity_bytes=s.capacity_bytes, prefetch_bandwidth=_histogram(c.prefetch_bandwidth),
        backup_bandwidth=_histogram(c.backup_bandwidth))
