"""Transfers on a real GPU: every mover, both layouts, bit-identical; events, ordering, stats."""

from __future__ import annotations

import random

import pytest
import torch
from plans import pools as make_pools
from stagecache.runtime.memory.host_pools import HostPools
from stagecache.runtime.model.families import load_spec
from stagecache.runtime.model.families.deepseek_v4 import HOST_CACHED as POOLS
from stagecache.runtime.model.layer_map import build_layout
from stagecache.runtime.transfer import device, native
from stagecache.runtime.transfer.controller import TransferController, TransferError
from stagecache.runtime.transfer.stats import TransferStats

pytestmark = pytest.mark.gpu
needs_native = pytest.mark.skipif(native.module() is None, reason="the compiled helper was not built at install")

FLASH = load_spec("deepseek-v4-flash")
TINY = load_spec("tiny-v4")


def filled(spec, stage, page_size, pages, host_pages, layout, pin_memory=True):
    dp = make_pools(spec, stage, page_size, pages, device="cuda", host_pages=host_pages)
    for bufs in dp.buffers.values():
        for b in bufs:
            b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, device="cuda"))
    hp = HostPools(dp, layout=layout, pin_memory=pin_memory)
    assert hp.pinned == pin_memory
    dp.allocator.alloc(pages)
    hp.allocator.alloc(host_pages)
    return dp, hp


def snapshot(dp):
    return {p: [b.clone() for b in bufs] for p, bufs in dp.buffers.items()}


def zero(dp):
    for bufs in dp.buffers.values():
        for b in bufs:
            b.zero_()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("use_triton", [True, False])
@pytest.mark.parametrize("model", ["tiny-v4", "deepseek-v4-flash"])
def test_gpu_round_trip_bit_identical(layout, use_triton, model):
    spec = TINY if model == "tiny-v4" else FLASH
    page_size = 128 if model == "tiny-v4" else 256
    stage = build_layout(spec, 2 if model == "tiny-v4" else 4).stages[1]
    dp, hp = filled(spec, stage, page_size, 40, 64, layout)
    stats = TransferStats()
    c = TransferController(dp, hp, stats, use_triton=use_triton)
    assert c.path == ("triton" if use_triton else "torch")
    rng = random.Random(hash((layout, use_triton, model)) & 0xFFFF)
    for host in (list(range(10, 30)), rng.sample(range(64), 20)):  # one long run, then scattered
        src, dst = rng.sample(range(40), 20), rng.sample(range(40), 20)
        before = snapshot(dp)
        r = c.backup(src, host)
        r.synchronize()
        assert r.seconds is not None and r.seconds > 0
        for pool in POOLS:
            for i, b in enumerate(hp.buffers[pool]):
                assert torch.equal(b[host], before[pool][i][src].cpu()), (pool, i, r.path)
        zero(dp)
        c.load(host, dst, blocking=True)
        for pool in POOLS:
            for i, b in enumerate(dp.buffers[pool]):
                assert torch.equal(b[dst], before[pool][i][src]), (pool, i, r.path)
    live = stats.live()
    assert live.transfer_count.d2h == 2 and live.transfer_bytes.h2d == 40 * dp.token_page_bytes()


def test_gpu_layer_by_layer_wait_on_current_stream():
    stage = build_layout(FLASH, 4).stages[2]
    dp, hp = filled(FLASH, stage, 256, 16, 16, "layer_first")
    c = TransferController(dp, hp, TransferStats())
    before = snapshot(dp)
    c.backup(list(range(8)), list(range(8, 16)), blocking=True)
    zero(dp)
    r = c.load_layer_by_layer(list(range(8, 16)), list(range(8)))
    sums = []
    for g in r.layers:
        r.wait(g)  # the current stream now waits for layer g only
        sums.append(dp.get_raw_buffer("swa", g)[:8].sum(dtype=torch.int64))
    torch.cuda.current_stream().synchronize()
    r.synchronize()
    for g, s in zip(r.layers, sums, strict=True):
        want = before["swa"][stage.pool_index("swa", g)][:8].sum(dtype=torch.int64)
        assert int(s) == int(want)
    for pool in POOLS:
        for i, b in enumerate(dp.buffers[pool]):
            assert torch.equal(b[:8], before[pool][i][:8])


def test_gpu_back_to_back_calls_reuse_the_ring_and_stay_ordered(monkeypatch):
    """More calls in flight than ring entries, a call bigger than an entry, and a load right after
    the backup that writes its host pages: all on one stream, so every result is the latest."""
    monkeypatch.setattr(device, "RING_ENTRIES", 2)
    monkeypatch.setattr(device, "ENTRY_PAGES_MAX", 4)
    stage = build_layout(FLASH, 4).stages[1]
    dp, hp = filled(FLASH, stage, 256, 48, 64, "layer_first")
    c = TransferController(dp, hp, TransferStats())
    rng = random.Random(5)
    for _ in range(6):
        src, host = rng.sample(range(48), 3), rng.sample(range(64), 3)
        before = snapshot(dp)
        c.backup(src, host)
        dst = rng.sample(range(48), 3)
        c.load(host, dst)  # not waited for: ordered behind the backup on the copy stream
        torch.cuda.synchronize()
        for pool in POOLS:
            for i, b in enumerate(dp.buffers[pool]):
                assert torch.equal(b[dst], before[pool][i][src]), (pool, i)
    big_src, big_host = rng.sample(range(48), 40), rng.sample(range(64), 40)  # > ENTRY_PAGES_MAX: ten pieces over two entries
    before = snapshot(dp)
    c.backup(big_src, big_host, blocking=True)
    for pool in POOLS:
        for i, b in enumerate(hp.buffers[pool]):
            assert torch.equal(b[big_host], before[pool][i][big_src].cpu()), (pool, i)
    c.synchronize()


def _ring_word(c, entry, field):
    return int(c.mover._ring.words[native.RING + native.PER_ENTRY * entry + field])


@needs_native
def test_gpu_one_call_move_is_timed_by_its_entrys_events_until_finished():
    """A one-launch move is one call into C: its ring entry's graph records the entry's own events,
    the entry stays owned (and guarded by the end event) until the move is known finished, then it
    is free without another query; the DMA time read from those events is the copy's."""
    stage = build_layout(TINY, 2).stages[1]
    dp, hp = filled(TINY, stage, 128, 16, 16, "layer_first")
    stats = TransferStats()
    c = TransferController(dp, hp, stats)
    assert c.mover._native is not None
    first = c.backup([0, 1], [2, 3])
    k = int(c.mover._ring.words[native.NEXT] - 1) % device.RING_ENTRIES
    assert (first._start, first._end) == c.mover._ring.events[k]
    assert _ring_word(c, k, native.OWNED) == 1 and _ring_word(c, k, native.MARK) == first._end.cuda_event
    first.synchronize()
    assert _ring_word(c, k, native.OWNED) == 0 and _ring_word(c, k, native.MARK) == 0
    assert 0 < first.seconds < 0.05 and first.queue_seconds >= 0 and first.queued >= first.called
    assert stats.live().transfer_count.d2h == 1
    for pool in POOLS:
        for d, h in zip(dp.buffers[pool], hp.buffers[pool], strict=True):
            assert torch.equal(h[[2, 3]], d[[0, 1]].cpu())
    c.synchronize()


@needs_native
def test_gpu_a_full_ring_finishes_the_oldest_move_before_reusing_its_events():
    """More one-launch moves in flight than the ring has entries (the stream held busy): the call
    that comes back to an entry first waits for and finishes the move its events time (its stats
    recorded once, with its own DMA time), then reuses them; every copy lands."""
    stage = build_layout(TINY, 2).stages[1]
    dp, hp = filled(TINY, stage, 128, 16, 16, "layer_first")
    stats = TransferStats()
    c = TransferController(dp, hp, stats)
    for _ in range(device.RING_ENTRIES):  # every entry's graph captured (capturing syncs nothing, but
        c.backup([15], [15])             # building the kernel's tables does) before the stream is held
    c.synchronize()
    stats = c.stats = TransferStats()
    torch.cuda._sleep(50_000_000)  # the caller's stream is busy: nothing below finishes early
    moves = [c.backup([i], [i]) for i in range(device.RING_ENTRIES)]
    assert all(m.seconds is None for m in moves)
    extra = c.backup([device.RING_ENTRIES], [device.RING_ENTRIES])
    assert moves[0].seconds is not None and 0 < moves[0].seconds < 0.05  # finished to free its entry
    assert extra._end is moves[0]._end
    c.synchronize()
    assert stats.live().transfer_count.d2h == device.RING_ENTRIES + 1
    for pool in POOLS:
        for d, h in zip(dp.buffers[pool], hp.buffers[pool], strict=True):
            n = device.RING_ENTRIES + 1
            assert torch.equal(h[:n], d[:n].cpu())


def test_gpu_copy_waits_for_the_callers_stream():
    """A backup queued right after a write on the caller's stream copies the written bytes."""
    stage = build_layout(FLASH, 4).stages[1]
    dp, hp = filled(FLASH, stage, 256, 8, 8, "layer_first")
    c = TransferController(dp, hp)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)  # keep the caller's stream busy, then write
        for bufs in dp.buffers.values():
            for b in bufs:
                b[2].fill_(0x77)
        c.backup([2], [5])
    torch.cuda.synchronize()
    for bufs in hp.buffers.values():
        for b in bufs:
            assert bool((b[5] == 0x77).all())


def test_gpu_pageable_host_goes_through_torch():
    """Unpinned host pools cannot be reached by the kernel: the controller uses torch indexing."""
    stage = build_layout(TINY, 2).stages[0]
    dp, hp = filled(TINY, stage, 128, 8, 8, "layer_first", pin_memory=False)
    c = TransferController(dp, hp)
    r = c.backup([1, 5, 2], [0, 1, 2], blocking=True)
    assert r.path == "torch"
    for pool in POOLS:
        for i, b in enumerate(hp.buffers[pool]):
            assert torch.equal(b[[0, 1, 2]], dp.buffers[pool][i][[1, 5, 2]].cpu())


def test_gpu_refuses_unallocated_pages():
    stage = build_layout(FLASH, 4).stages[1]
    dp, hp = filled(FLASH, stage, 256, 8, 8, "layer_first")
    hp.allocator.free([4])
    c = TransferController(dp, hp)
    with pytest.raises(TransferError, match="not allocated"):
        c.backup([1], [4])
    assert all(int(b[4].sum()) == 0 for bufs in hp.buffers.values() for b in bufs)
