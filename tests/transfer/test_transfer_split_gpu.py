"""Queue wait vs DMA time on a real GPU: CUDA-event DMA times, event times on the host clock, queues.

No pydantic here (the GPU machine runs the transfer layer alone): only the controller and its stats.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
from plans import pools as make_pools
from stagecache.runtime.memory.host_pools import HostPools
from stagecache.runtime.model.families import load_spec
from stagecache.runtime.model.layer_map import build_layout
from stagecache.runtime.transfer.clock import EventClock, host_time
from stagecache.runtime.transfer.controller import TransferController
from stagecache.runtime.transfer.stats import TransferStats

pytestmark = pytest.mark.gpu

FLASH = load_spec("deepseek-v4-flash")


def controller(pages: int):
    stage = build_layout(FLASH, 4).stages[1]
    dp = make_pools(FLASH, stage, 256, pages, device="cuda", host_pages=pages)
    hp = HostPools(dp, pin_memory=True)
    dp.allocator.alloc(pages)
    hp.allocator.alloc(pages)
    stats = TransferStats()
    c = TransferController(dp, hp, stats)
    assert c.path == "triton"
    return c, stats


def test_gpu_event_times_land_on_the_host_clock():
    clock = EventClock(torch.device("cuda"))
    ref = clock.reference(time.perf_counter())
    side = torch.cuda.Stream()  # idle: its events fire when submitted
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(side)
    ha = time.perf_counter()
    time.sleep(0.05)
    b.record(side)
    hb = time.perf_counter()
    torch.cuda.synchronize()
    assert abs(host_time(ref, a) - ha) < 1e-3
    assert abs(host_time(ref, b) - hb) < 1e-3
    assert host_time(ref, b) - host_time(ref, a) == pytest.approx(hb - ha, abs=1e-3)


def test_gpu_dma_time_from_events_split_over_kinds_by_bytes():
    c, stats = controller(24)
    for _ in range(2):  # the first of each compiles and captures
        backup = c.backup(list(range(8)), list(range(8, 16)), blocking=True)
        load = c.load(list(range(8, 16)), list(range(16, 24)), blocking=True)
    layered = c.load_layer_by_layer(list(range(8, 16)), list(range(8)))
    layered.synchronize()
    for r in (backup, load, layered):
        assert r.seconds > 0 and r.queue_seconds > 0, r
        assert r.nbytes / r.seconds < 1e12, r  # DMA time, not a host stamp: under 1 TB/s over PCIe
    live = stats.live()
    for d in ("d2h", "h2d"):
        kinds = getattr(live.transfer_split, d)
        assert set(kinds) == {k for k, _ in c.selection().kinds}
        assert sum(k.bytes for k in kinds.values()) == getattr(live.transfer_bytes, d)
        assert sum(k.dma_seconds for k in kinds.values()) == pytest.approx(getattr(live.transfer_seconds, d))
        assert all(k.dma_seconds > 0 and k.queue_seconds > 0 for k in kinds.values())
        gb = {name: k.bytes / k.dma_seconds for name, k in kinds.items()}  # split by bytes: one rate
        assert max(gb.values()) == pytest.approx(min(gb.values()), rel=1e-6)


def test_gpu_queue_wait_grows_behind_a_long_copy():
    c, stats = controller(136)
    big, small = list(range(128)), [130]
    for _ in range(2):
        c.backup(big, big, blocking=True)
        c.load(small, small, blocking=True)
    alone = statistics.median(c.load(small, small, blocking=True).queue_seconds for _ in range(5))
    long = c.backup(big, big)  # ~300 MB: milliseconds of DMA
    behind = c.load(small, small)  # same stream: starts when the backup ends
    long.synchronize()
    behind.synchronize()
    waited_for = long.called + long.queue_seconds + long.seconds - behind.called  # the backup's rest
    assert long.seconds > 1e-3, long
    assert behind.queue_seconds == pytest.approx(waited_for, abs=2e-4)
    assert behind.queue_seconds > 0.5 * long.seconds > 10 * alone
    assert behind.seconds < long.seconds / 10  # its own DMA time is its own small copy


def test_gpu_queue_wait_counts_work_queued_on_the_callers_stream():
    """A kernel queued before the load on the caller's stream delays its start: that is queue wait."""
    if not hasattr(torch.cuda, "_sleep"):
        pytest.skip("torch.cuda._sleep is not available in this torch")
    c, stats = controller(8)
    c.load([1], [1], blocking=True)
    torch.cuda._sleep(1000)  # load the sleep kernel now: a lazy load would idle the stream between the events
    torch.cuda.synchronize()
    before = torch.cuda.Event(enable_timing=True)
    after = torch.cuda.Event(enable_timing=True)
    before.record()
    torch.cuda._sleep(50_000_000)  # tens of ms of a spinning kernel
    after.record()
    r = c.load([1], [2])
    r.synchronize()
    slept = before.elapsed_time(after) / 1e3
    assert slept > 5e-3
    assert r.queue_seconds > 0.8 * slept
    assert stats.live().transfer_split.h2d["swa"].queue_seconds > 0.8 * slept
