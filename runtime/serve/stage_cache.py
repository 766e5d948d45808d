"""What one stage process serves with: its own pools, host stack, HiCache and layer compute.

Kept apart from ``stage_worker`` (process, dist, publishing) so the per-stage work is one object,
built from the stage's config alone.  Per micro-batch, on every stage, in the same order::

    begin(request) for each request   # HiCache: match, load host hits (h2d), allocate new pages
    verify the host-loaded pages      # their KV bytes must be exactly what was written
    write KV of the new pages         # KvWriter: deterministic bytes per (prefix, layer, pool)
    layer compute on the activation   # [computed tokens, hidden] through the local layers
    finish(request) for each request  # insert into the radix tree; write-through backups (d2h)

The stages hold different layers but the same page-id space size, so their cache decisions are
identical; each stage's per-request records go to rank 0, which compares them (``agreement.py``).
A lookup's miss reasons wait for that verdict: the pages this stage matched below the stages'
agreed prefix are ``stage_disagreement`` misses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..cache.insight import InsightConfig
from ..errors import ConfigError, StageCacheError
from .options import StageConfig

#: ``serve`` keeps its cache insight on the wall clock, every event sampled (a forward pass dwarfs
#: it), with miss reasons deferred until the stages' agreed prefix is known (``agreement.py``).
SERVE_INSIGHT = InsightConfig(clock="seconds", sample_every=1, defer=True)

#: The generated trace of ``serve`` (multi-turn chat, sized for a CPU demo of tiny-v4).
SERVE_WORKLOAD = {
    "system_prompts": 4,
    "system_prompt_len": (512, 1024),
    "turns": (2, 6),
    "user_len": (32, 256),
    "assistant_len": (32, 256),
    "vocab": 4096,
}


class KvMismatchError(StageCacheError):
    """Bytes loaded back from host are not the bytes written: the cache returned wrong KV."""


def transfer_check_live(cache: Any, stage: int) -> Any:
    """The cache's checked transfers (``HiCache.incomplete``) as ``StageLive.transfer_check``."""
    from dataclasses import asdict

    from ..live.divergence import IncompleteBackup
    from ..live.numbers import TransferCheckLive

    found = [IncompleteBackup(time=0.0, stage=stage, **asdict(c)) for c in cache.incomplete]
    return TransferCheckLive(kinds=list(cache.mirror or ()), checked=cache.checked_transfers, count=cache.incomplete_count,
                             incomplete=dict(cache.incomplete_kinds), first=found[0] if found else None,
                             recent=found)


def build_trace(trace: str | None, requests: int, seed: int, fmt: str = "auto") -> list[Any]:
    """The request stream every stage replays: a JSONL file (first ``requests``, in format ``fmt``)
    or a generated one."""
    from ..traces.readers import WorkloadConfig, generate, load_requests

    if trace:
        return list(load_requests(trace, fmt=fmt, limit=requests or None).requests)
    return generate(WorkloadConfig(seed=seed, requests=requests, **SERVE_WORKLOAD))


def request_pages(req: Any, page_size: int) -> int:
    return -(-(len(req.input_ids) + len(req.output_ids)) // page_size)


def _micro_batch_pages(requests: Sequence[Any], page_size: int, micro_batch: int) -> list[tuple[Any, int]]:
    """Each micro-batch with the device pages its requests need at once (they run together)."""
    from .pipeline import split_micro_batches

    return [(mb, sum(request_pages(r, page_size) for r in mb.requests))
            for mb in split_micro_batches(requests, micro_batch)]


def trace_device_pages(requests: Sequence[Any], page_size: int, micro_batch: int) -> int:
    """Device pages the trace's largest micro-batch needs at once (a floor for any size advice)."""
    return max((need for _, need in _micro_batch_pages(requests, page_size, micro_batch)), default=1)


def check_trace_fits(requests: Sequence[Any], page_size: int, device_pages: int, micro_batch: int) -> None:
    """Every micro-batch's requests must fit the device pages at once."""
    for mb, need in _micro_batch_pages(requests, page_size, micro_batch):
        if need > device_pages:
            longest = max(request_pages(r, page_size) for r in mb.requests)
            raise ConfigError(
                f"micro-batch {mb.index} ({len(mb.requests)} requests, longest {longest} pages) needs "
                f"up to {need} device pages of {page_size} tokens at once, but each stage has "
                f"--device-pages {device_pages}; raise --device-pages/--max-total-tokens or lower "
                "--micro-batch"
            )


class LayerCompute:
    """A stand-in for the stage's layers: ``tanh(x @ W_l)`` per local layer on the activation.

    Real matmuls on the real activation tensor, so stage time scales with local
    layers and computed tokens the way a real stage's does (without weights to load).
    """

    def __init__(self, global_ids: list[int], hidden: int, device: Any):
        import torch

        self.hidden = hidden
        self.device = device
        self.weights = []
        for gid in global_ids:
            g = torch.Generator().manual_seed(1_000 + gid)
            w = torch.randn((hidden, hidden), generator=g) / math.sqrt(hidden)
            self.weights.append(w.to(device))
        self.freq = torch.arange(1, hidden + 1, dtype=torch.float32, device=device) / hidden

    def embed(self, tokens: np.ndarray) -> Any:
        import torch

        t = torch.as_tensor(np.asarray(tokens, dtype=np.float32), device=self.device)
        return torch.sin(t[:, None] * self.freq[None, :])

    def forward(self, x: Any) -> Any:
        import torch

        for w in self.weights:
            x = torch.tanh(x @ w)
        return x


class StageCache:
    """One stage's pools, host stack, HiCache and compute (see module docstring)."""

    def __init__(self, cfg: StageConfig):
        import torch

        from ..cache.hicache import HiCache
        from ..cache.kv_writer import KvWriter
        from ..cache.stats import CacheStats
        from ..memory.host_pools import HostPools
        from ..memory.pools import StagePools
        from ..plan.faults import HOST_TIER_FAULTS, backup_left_out
        from ..plan.mirror import mirror_bytes
        from ..transfer.controller import TransferController
        from ..transfer.stats import TransferStats
        from ..validation.checks import validate_stage
        from .agreement import Agreement
        from .host_tier_live import StageHostTier

        self.cfg = cfg
        self.stage = cfg.rank
        self.page_size = cfg.opts.page_size
        self.stage_map = cfg.plan.layer_map
        self.device = torch.device(cfg.torch_device)
        # The stage plan, faults included: a faulty plan is allocated as it is and reports its
        # real inventory to rank 0, which refuses it there.
        self.pools = StagePools(cfg.plan, self.device)
        self.valid = not validate_stage(self.stage_map, self.pools.inventory())
        faults = cfg.opts.plan.stage_faults(self.stage)
        tier_faults = faults & HOST_TIER_FAULTS
        # pinning is the default on CUDA and falls back to pageable memory when refused
        # (memory.host_pools); the pin-refused fault asks for it where it is refused
        pin = True if "pin-refused" in tier_faults else None
        self.host = HostPools(self.pools, layout=cfg.opts.hicache_layout, pin_memory=pin, pin_fallback=True)
        self.host_tier = StageHostTier(self.pools, self.host, cfg.opts.hicache_write_policy, tier_faults)
        self.transfer_stats = TransferStats()
        self.cache = None
        self.writer = None
        # here, not at the top: it imports torch, which serve's parent (validating flags) never needs
        from .stage_l3 import StageL3

        self.l3 = StageL3(cfg, self.stage, self.host)
        if self.valid:  # an invalid stage never serves; its transfer stack is not needed
            self.controller = TransferController(self.pools, self.host, self.transfer_stats)
            self.stats = CacheStats(self.stage, cfg.opts.page_size, transfer=self.transfer_stats)
            # every backup and load is checked against the plan; a backup-without-indexer fault
            # makes this stage's backups leave the kinds out while the host set holds them
            left_out = backup_left_out(cfg.opts.plan.faults, self.stage, cfg.opts.pp_size)
            backup_pools = [k for k in self.host.kinds if k not in left_out] if left_out else None
            self.cache = HiCache(self.pools, self.host, self.controller, cfg.opts.hicache_write_policy,
                                 stats=self.stats, insight=SERVE_INSIGHT, storage=self.l3.open(),
                                 mirror=mirror_bytes(cfg.plan), backup_pools=backup_pools)
            self.writer = KvWriter(self.pools)
        # stage agreement (``agreement.py``) and the ``radix-skew`` fault that tests it
        self.agreement = Agreement(self.stage, cfg.opts.pp_size, self._on_verdict,
                                   describe=lambda req: f"{req.session}/{req.turn}")
        self._misses: dict[int, list[Any]] = {}  # micro-batch -> deferred miss records
        self.skew = "radix-skew" in faults
        self.skewed_pages = 0
        self._finished = 0
        self.compute = LayerCompute([e.global_id for e in self.stage_map.layers], cfg.opts.hidden_size,
                                    self.device)
        self.verified_pages = 0
        self.computed_rows = 0

    # -- startup --------------------------------------------------------------------------------
    def load_trace(self) -> list[Any]:
        return build_trace(self.cfg.opts.trace, self.cfg.opts.requests, self.cfg.opts.seed,
                           self.cfg.opts.trace_format)

    def _on_verdict(self, index: int, agreed: list[int]) -> None:
        """The stages' verdict on a micro-batch: book its deferred miss reasons."""
        records = self._misses.pop(index, ())
        if self.cache is not None and self.cache.insight is not None:
            for rec, pages in zip(records, agreed, strict=False):
                if rec is not None:
                    self.cache.insight.account(rec, pages)

    def _begin_all(self, mb: Any, backed: list[int]) -> list[Any]:
        """``begin`` every request (all aborted if one fails), counting each one's backups."""
        handles = []
        head = self.agreement.head(mb.index, len(mb.requests)) if self.cache.storage else None
        try:
            for i, req in enumerate(mb.requests):
                before = self.stats.backup_pages
                handles.append(self.cache.begin(req, head[i] if head else None, self._refill))
                backed.append(self.stats.backup_pages - before)
        except Exception:
            for h in handles:
                self.cache.abort(h)
            raise
        return handles

    def _finish_all(self, mb: Any, handles: list[Any], backed: list[int]) -> None:
        """``finish`` every request; its record goes to the stage agreement."""
        records = []
        for h, b in zip(handles, backed, strict=True):
            before = self.stats.backup_pages
            cached = self.cache.finish(h)
            records.append((h.device_hit_pages, h.host_hit_pages, b + self.stats.backup_pages - before,
                            cached, 1, h.storage_pages))
            self._finished += 1
            if self.skew and self._finished % 4 == 0 and h.view.cacheable:
                self.skewed_pages += self.cache.discard(int(h.keys[h.view.cacheable - 1]))
        self._misses[mb.index] = [h.misses for h in handles]
        self.agreement.local(mb.index, records)

    # -- one micro-batch ------------------------------------------------------------------------
    def work(self, mb: Any, act_in: Any | None) -> tuple[Any, int]:
        assert self.cache is not None and self.writer is not None
        slots = self.pools.slot_allocator.alloc(len(mb.requests))  # per-request state slots
        try:
            return self._work(mb, act_in)
        finally:
            self.pools.slot_allocator.free(slots)
            self.host_tier.arm()

    def _work(self, mb: Any, act_in: Any | None) -> tuple[Any, int]:
        from .pipeline import decision_digest

        ps = self.page_size
        backed: list[int] = []
        handles = self._begin_all(mb, backed)
        decisions = []
        computed = []
        try:
            for h in handles:
                self._verify_loaded(h)
                self.writer.write(h.new_hashes, h.new_pages)
                req = h.request
                decisions.append((req.session, req.turn, h.device_hit_pages, h.host_hit_pages,
                                  len(h.new_pages), h.storage_pages))
                computed.append(np.asarray(h.tokens[h.matched_pages * ps:]))
            tokens = np.concatenate(computed) if computed else np.zeros(1, dtype=np.int64)
            if act_in is None:
                act_in = self.compute.embed(tokens)
            act_out = self.compute.forward(act_in)
            self.computed_rows += int(act_out.shape[0])
        except Exception:
            for h in handles:
                self.cache.abort(h)
            raise
        self._finish_all(mb, handles, backed)
        return act_out, decision_digest(decisions)

    def _verify_loaded(self, h: Any) -> None:
        """Check the KV bytes of the pages just loaded from host (the ones a PP bug would corrupt),
        L3's included (they came through the host tier)."""
        if h.matched_pages == h.device_hit_pages:
            return
        lo, hi = h.device_hit_pages, h.matched_pages
        bad = self.writer.verify(h.hashes[lo:hi], h.prefix_pages[lo:hi], page_offset=lo)
        self.verified_pages += hi - lo
        if bad:
            raise KvMismatchError(
                f"stage {self.stage}: {len(bad)} page(s) loaded from host or L3 have wrong KV bytes, "
                f"first: {bad[0]}"
            )

    def _refill(self, keys: Any, host_pages: Any) -> None:
        """Write the KV of pages this stage's pipeline took from L3 but this stage could not read."""
        self.writer.write(np.asarray(keys, dtype=np.uint64), host_pages, target=self.host)

    # -- live numbers -----------------------------------------------------------------------------
    def live_fields(self) -> dict[str, Any]:
        """The cache, pool and transfer fields of this stage's ``StageLive``: the typed numbers
        each part produces, by field."""
        from ..live.numbers import PageSpace, PoolBytes
        from .host_tier_live import occupancy_live

        dev_bytes, host_bytes = self.pools.pool_bytes(), self.host.pool_bytes()
        kinds = [p for p in dev_bytes if self.pools.buffers.get(p)]  # pools the stage really has
        fields: dict[str, Any] = {
            "pool_bytes": {p: PoolBytes(device=int(dev_bytes[p]), host=int(host_bytes.get(p, 0)))
                           for p in kinds},
            "host_tier": self.host_tier.live(),
            "pool_occupancy": occupancy_live(self.pools, self.host),
        }
        if self.cache is None:
            return fields
        dev, host = self.cache.dev_alloc, self.host.allocator
        fields["page_spaces"] = {  # one page-id space per tier, shared by the pools listed
            "device": PageSpace(tier="device", used=dev.num_used, total=dev.num_pages, pools=kinds),
            "host": PageSpace(tier="host", used=host.num_used, total=host.num_pages,
                              pools=[p for p in kinds if host_bytes.get(p)]),
        }
        fields.update(dict(self.stats.live()), **dict(self.transfer_stats.live()))
        if self.cache.insight is not None:
            fields["insight"] = self.cache.insight.live(self.skewed_pages)
        fields["agreement"] = self.agreement.live()
        fields["transfer_check"] = transfer_check_live(self.cache, self.stage)
        fields["kv_verified_pages"] = self.verified_pages
        from .stage_l3 import l3_live

        fields["l3"] = l3_live(self.cache.storage, self.page_size)
        fields["computed_rows"] = self.computed_rows
        return fields
