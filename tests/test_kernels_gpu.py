"""Transfers on a real GPU: every path, both layouts, bit-identical; events and stats."""

from __future__ import annotations

import random

import pytest
import torch
from stagecache.runtime.memory.host_pools import HostPools
from stagecache.runtime.memory.pools import StagePools
from stagecache.runtime.model.layer_map import build_layout
from stagecache.runtime.model.pool_kinds import HOST_CACHED
from stagecache.runtime.model.spec import load_spec
from stagecache.runtime.transfer.controller import TransferController
from stagecache.runtime.transfer.stats import TransferStats

pytestmark = pytest.mark.gpu

FLASH = load_spec("deepseek-v4-flash")
TINY = load_spec("tiny-v4")


def filled(spec, stage, page_size, pages, host_pages, layout):
    dp = StagePools(spec, stage, page_size, pages, device="cuda")
    for bufs in dp.buffers.values():
        for b in bufs:
            b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, device="cuda"))
    hp = HostPools(dp, num_pages=host_pages, layout=layout)
    assert hp.pinned and all(b.is_pinned() for bufs in hp.buffers.values() for b in bufs)
    return dp, hp


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize(("mode", "use_triton"), [("direct", True), ("staged", True), ("auto", True),
                                                  ("auto", False)])
@pytest.mark.parametrize("model", ["tiny-v4", "deepseek-v4-flash"])
def test_gpu_round_trip_bit_identical(layout, mode, use_triton, model):
    spec = TINY if model == "tiny-v4" else FLASH
    page_size = 128 if model == "tiny-v4" else 256
    stage = build_layout(spec, 2 if model == "tiny-v4" else 4).stages[1]
    dp, hp = filled(spec, stage, page_size, 40, 64, layout)
    stats = TransferStats()
    c = TransferController(dp, hp, stats, use_triton=use_triton, mode=mode)
    rng = random.Random(hash((layout, mode, model)) & 0xFFFF)
    for host in (list(range(10, 30)), rng.sample(range(64), 20)):  # one long run, then scattered
        src, dst = rng.sample(range(40), 20), rng.sample(range(40), 20)
        before = {p: [b.clone() for b in bufs] for p, bufs in dp.buffers.items()}
        r = c.backup(src, host)
        r.synchronize()
        assert r.seconds is not None and r.seconds > 0
        for pool in HOST_CACHED:
            for i, b in enumerate(hp.buffers[pool]):
                assert torch.equal(b[host], before[pool][i][src].cpu()), (pool, i, r.path)
        for bufs in dp.buffers.values():
            for b in bufs:
                b.zero_()
        c.load(host, dst, blocking=True)
        for pool in HOST_CACHED:
            for i, b in enumerate(dp.buffers[pool]):
                assert torch.equal(b[dst], before[pool][i][src]), (pool, i, r.path)
    snap = stats.snapshot()
    assert snap["d2h"]["count"] == 2 and snap["h2d"]["bytes"] == 40 * dp.token_page_bytes()


def test_gpu_layer_by_layer_wait_on_current_stream():
    stage = build_layout(FLASH, 4).stages[2]
    dp, hp = filled(FLASH, stage, 256, 16, 16, "layer_first")
    c = TransferController(dp, hp, TransferStats())
    before = {p: [b.clone() for b in bufs] for p, bufs in dp.buffers.items()}
    c.backup(list(range(8)), list(range(8, 16)), blocking=True)
    for bufs in dp.buffers.values():
        for b in bufs:
            b.zero_()
    r = c.load_layer_by_layer(list(range(8, 16)), list(range(8)))
    sums = []
    for g in r.layers:
        r.wait(g)  # the current stream now waits for layer g only
        sums.append(dp.get_swa_raw_buffer(g)[:8].sum(dtype=torch.int64))
    torch.cuda.current_stream().synchronize()
    r.synchronize()
    for g, s in zip(r.layers, sums, strict=True):
        want = before["swa"][stage.pool_index("swa", g)][:8].sum(dtype=torch.int64)
        assert int(s) == int(want)
    for pool in HOST_CACHED:
        for i, b in enumerate(dp.buffers[pool]):
            assert torch.equal(b[:8], before[pool][i][:8])


def test_gpu_kernel_direct_into_pinned_host():
    from stagecache.runtime.transfer.kernels import copy_pages, word_bytes

    L, P, pb = 4, 32, 1168
    src = [torch.randint(0, 256, (P, pb), dtype=torch.uint8, device="cuda") for _ in range(L)]
    dst = torch.zeros((P, L, pb), dtype=torch.uint8, pin_memory=True)
    s_tab = torch.tensor([t.data_ptr() for t in src], device="cuda")
    d_tab = torch.tensor([dst.data_ptr() + i * pb for i in range(L)], device="cuda")
    s_idx = torch.tensor([3, 17, 5, 30], device="cuda")
    d_idx = torch.tensor([0, 1, 31, 7], device="cuda")
    w = word_bytes(pb, (pb, L * pb), [t.data_ptr() for t in src] + [dst.data_ptr()])
    copy_pages(s_tab, d_tab, s_idx, d_idx, pb, pb, L * pb, w)
    torch.cuda.synchronize()
    for i in range(L):
        assert torch.equal(dst[d_idx.cpu(), i], src[i][s_idx].cpu())


def test_gpu_pageable_host_goes_through_dma():
    """Unpinned host pools cannot be reached by the kernel: the controller must stage + DMA."""
    stage = build_layout(TINY, 2).stages[0]
    dp = StagePools(TINY, stage, 128, 8, device="cuda")
    for bufs in dp.buffers.values():
        for b in bufs:
            b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, device="cuda"))
    hp = HostPools(dp, num_pages=8, pin_memory=False)
    c = TransferController(dp, hp)
    r = c.backup([1, 5, 2], [0, 1, 2], blocking=True)
    assert r.path == "torch-staged"
    for pool in HOST_CACHED:
        for i, b in enumerate(hp.buffers[pool]):
            assert torch.equal(b[[0, 1, 2]], dp.buffers[pool][i][[1, 5, 2]].cpu())


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_gpu_staged_ring_reuse_bit_identical(layout, monkeypatch):
    """Tiny units and a 2-slot staging ring: every slot is reused, guarded only by events."""
    from stagecache.runtime.transfer import controller as ctl

    monkeypatch.setattr(ctl, "STAGING_CHUNK_MIN_BYTES", 1)
    monkeypatch.setattr(ctl, "STAGING_CHUNK_BYTES", 300_000)
    monkeypatch.setattr(ctl, "STAGING_MAX_BYTES", 1)
    stage = build_layout(FLASH, 4).stages[1]
    dp, hp = filled(FLASH, stage, 256, 48, 64, layout)
    c = TransferController(dp, hp, TransferStats(), mode="staged")
    rng = random.Random(11)
    host = list(range(3, 23)) + list(range(40, 60))  # two runs
    src, dst = rng.sample(range(48), 40), rng.sample(range(48), 40)
    before = {p: [b.clone() for b in bufs] for p, bufs in dp.buffers.items()}
    for _ in range(3):  # back-to-back calls reuse the cached staging buffer and id buffers
        r = c.backup(src, host)
    r.synchronize()
    assert r.path == "triton-staged"
    for pool in HOST_CACHED:
        for i, b in enumerate(hp.buffers[pool]):
            assert torch.equal(b[host], before[pool][i][src].cpu()), (pool, i)
    for bufs in dp.buffers.values():
        for b in bufs:
            b.zero_()
    c.load(host, dst, blocking=True)
    for pool in HOST_CACHED:
        for i, b in enumerate(dp.buffers[pool]):
            assert torch.equal(b[dst], before[pool][i][src]), (pool, i)


def test_gpu_auto_stages_big_runs_and_goes_direct_for_scattered(monkeypatch):
    from stagecache.runtime.transfer import controller as ctl

    stage = build_layout(FLASH, 4).stages[1]
    dp, hp = filled(FLASH, stage, 256, 64, 128, "layer_first")
    c = TransferController(dp, hp, TransferStats(), mode="auto")
    monkeypatch.setattr(ctl, "AUTO_STAGED_MIN_BYTES", 1 << 20)
    monkeypatch.setattr(ctl, "AUTO_STAGED_MIN_DMA_BYTES", 1 << 20)
    src = random.Random(3).sample(range(64), 32)
    r_run = c.backup(src, list(range(32)), blocking=True)
    r_scat = c.backup(src, list(range(0, 64, 2)), blocking=True)
    # swa pages (149,504 B) x 32 per layer: one 4.8 MB DMA per layer -> staged;
    # every other host page: 149 KB DMAs -> direct
    assert r_run.path in ("triton-staged", "triton-mixed")
    assert r_scat.path == "triton-direct"
    for i, b in enumerate(hp.buffers["swa"]):
        assert torch.equal(b[list(range(0, 64, 2))], dp.buffers["swa"][i][src].cpu())
