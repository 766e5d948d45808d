"""``stagecache bench transfer-split``: queue wait vs DMA time of real moves, and what measuring them costs.

Two parts, one JSON report:

* ``split`` -- a small load alone, then the same load issued while a long backup
  is in progress: on CUDA queued behind it on the same stream, on CPU from a
  second thread while the first copies.  Its queue wait must grow by about the
  backup's DMA time while its own DMA time stays put; the stats' per-kind
  bytes must sum to the bytes moved.
* ``accounting`` -- what recording the split costs per transfer: the stats call
  with kinds and queue wait against the same call without them (the accounting
  before the split), timed in alternating blocks in the same run; on CUDA also
  the clock conversion of one start event (``clock.host_time``); and the whole
  call + finish with stats against without stats.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..memory.host_pools import HostPools
from ..memory.pools import StagePools
from ..model.spec import ModelSpec
from ..plan.plan import Sizing, build_plan
from ..transfer.controller import TransferController, TransferResult
from ..transfer.stats import DIRECTIONS, TransferStats

ROUNDS = 15  # alternating blocks per timed pair


@dataclass(frozen=True)
class SplitSettings:
    device: str
    pp: int
    stage: int
    page_size: int
    big_pages: int  # pages of the long backup a small load queues behind
    calls: int  # calls per timed block


def _pools(spec: ModelSpec, s: SplitSettings) -> tuple[StagePools, HostPools]:
    pages = s.big_pages + 8
    plan = build_plan(spec, s.pp, page_size=s.page_size, sizing=Sizing.runtime(pages, host_pages=pages))
    dp = StagePools(plan.stage(s.stage), device=s.device)
    hp = HostPools(dp, pin_memory=s.device.startswith("cuda"))
    dp.allocator.alloc(pages)
    hp.allocator.alloc(pages)
    return dp, hp


def _us(results: list[TransferResult]) -> dict[str, float]:
    """Median queue wait and DMA time of ``results``, µs."""
    assert all(r.seconds is not None for r in results)
    return {"queue_us": statistics.median(round(r.queue_seconds * 1e6, 2) for r in results),
            "dma_us": statistics.median(round(r.seconds * 1e6, 2) for r in results)}


def _behind(c: TransferController, cuda: bool, big: list[int], small: list[int]) -> tuple[Any, Any]:
    """(the long backup, the small load issued while it runs): a stream queue or a thread queue."""
    if cuda:
        first = c.backup(big, big)
        second = c.load(small, small)
        return first.synchronize(), second.synchronize()
    started, out = threading.Event(), {}

    def long_backup() -> None:
        started.set()
        out["first"] = c.backup(big, big)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(0.0002)  # hand the GIL over often: the load is called while the backup copies
    try:
        t = threading.Thread(target=long_backup)
        t.start()
        started.wait()
        while not c.copying and t.is_alive():  # until the backup holds the copy lock (the copy
            time.sleep(0)                       # itself runs without the GIL)
        second = c.load(small, small)
        t.join()
    finally:
        sys.setswitchinterval(switch)
    return out["first"], second


def split(spec: ModelSpec, s: SplitSettings) -> dict[str, Any]:
    """Queue wait and DMA time of a small load alone and behind a long backup (µs), per-kind sums."""
    cuda = s.device.startswith("cuda")
    dp, hp = _pools(spec, s)
    stats = TransferStats()
    c = TransferController(dp, hp, stats)
    big, small = list(range(s.big_pages)), [s.big_pages + 1]
    for _ in range(3):  # warm: graphs captured, plans built
        c.backup(big, big, blocking=True)
        c.load(small, small, blocking=True)
    alone = [c.load(small, small, blocking=True) for _ in range(5)]
    pairs = [_behind(c, cuda, big, small) for _ in range(5)]
    c.synchronize()
    live = stats.live()
    split = live.transfer_split
    kinds_sum = {d: sum(k.bytes for k in getattr(split, d).values()) for d in DIRECTIONS}
    return {
        "path": c.path, "pool_kinds": [k for k, _ in c.selection().kinds],
        "small_bytes": c.selection().nbytes(1), "big_bytes": c.selection().nbytes(s.big_pages),
        "alone": _us(alone), "long_backup": _us([a for a, _ in pairs]), "behind": _us([b for _, b in pairs]),
        "bytes": live.transfer_bytes.model_dump(),
        "kind_bytes_sum": kinds_sum,
        "kinds": {d: {k: {f: round(getattr(v, f), 6) for f in ("bytes", "moves", "queue_seconds", "dma_seconds")}
                      for k, v in getattr(split, d).items()} for d in DIRECTIONS},
    }


def _alternate(a: Callable[[], None], b: Callable[[], None], calls: int) -> tuple[float, float]:
    """Median µs per call of ``a`` and of ``b``, timed in alternating blocks of ``calls``."""
    ta, tb = [], []
    for _ in range(ROUNDS):
        for fn, out in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            out.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(ta), statistics.median(tb)


def _record_cost(kinds: tuple[tuple[str, int], ...], calls: int) -> dict[str, float]:
    """The stats call with the split against without it, and the call-time stamp plus copy lock."""
    stats = TransferStats()
    nb = sum(b for _, b in kinds)
    new, old = _alternate(lambda: stats.record("h2d", nb, 1e-4, 1, 2e-5, kinds),
                          lambda: stats.record("h2d", nb, 1e-4, 1), calls)
    lock, clock = threading.Lock(), time.perf_counter

    def stamped() -> None:
        called = clock()
        with lock:
            clock()
        clock() - called

    def plain() -> None:
        clock()
        clock()

    stamp, bare = _alternate(stamped, plain, calls)
    return {"record_split_us": round(new, 3), "record_totals_us": round(old, 3),
            "stamp_and_lock_us": round(stamp - bare, 3), "added_us": round(new - old + stamp - bare, 3)}


def _clock_cost(dp: StagePools, calls: int) -> float:
    """µs of one ``host_time`` conversion of a finished start event (the CUDA-only addition)."""
    from ..transfer.clock import EventClock, host_time

    clock = EventClock(dp.device)
    ref = clock.reference(time.perf_counter())
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        host_time(ref, ev)
    return (time.perf_counter() - t0) / calls * 1e6


def accounting(spec: ModelSpec, s: SplitSettings) -> dict[str, Any]:
    """Per-call cost of recording the split (µs), each against its baseline from this run."""
    cuda = s.device.startswith("cuda")
    dp, hp = _pools(spec, s)
    with_stats, bare = TransferController(dp, hp, TransferStats()), TransferController(dp, hp, None)
    page = [s.big_pages + 1]
    out: dict[str, Any] = {"kinds": len(with_stats.selection().kinds)}
    out.update(_record_cost(with_stats.selection().kinds, s.calls * 10))
    if cuda:
        out["clock_us"] = round(_clock_cost(dp, s.calls * 10), 3)
        out["added_us"] = round(out["added_us"] + out["clock_us"], 3)

    def block(c: TransferController) -> Callable[[], None]:
        def one() -> None:
            c.backup(page, page)
            c.load(page, page)
        return one

    for c in (with_stats, bare):
        block(c)()
        c.synchronize()
    a, b = _alternate(block(with_stats), block(bare), s.calls)
    with_stats.synchronize()
    bare.synchronize()
    if cuda:
        torch.cuda.synchronize()
    out["call_with_stats_us"] = round(a / 2, 2)
    out["call_without_stats_us"] = round(b / 2, 2)
    out["stats_ratio"] = round(a / b, 4) if b else None
    return out


def run_bench(spec: ModelSpec, s: SplitSettings) -> dict[str, Any]:
    return {
        "bench": "transfer-split", "model": spec.name, "device": s.device,
        "gpu": torch.cuda.get_device_name() if s.device.startswith("cuda") else None,
        "settings": {"pp": s.pp, "stage": s.stage, "page_size": s.page_size, "big_pages": s.big_pages,
                     "calls": s.calls},
        "split": split(spec, s), "accounting": accounting(spec, s),
    }
