"""The Triton stage-copy kernel and the controller's device mover, run on CPU with TRITON_INTERPRET=1.

``TRITON_INTERPRET`` must be set before triton is first imported, so the checks
run in a fresh interpreter; the script asserts and prints one line per check.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(r'''
    import random
    import torch
    from stagecache.runtime.transfer import kernels
    from stagecache.runtime.transfer.controller import TransferController
    from stagecache.runtime.transfer.device import LaunchShape
    from stagecache.runtime.memory.host_pools import HostPools
    from stagecache.runtime.model.layer_map import build_layout
    from stagecache.runtime.model.families.deepseek_v4 import HOST_CACHED as POOLS
    from stagecache.runtime.memory.pools import StagePools
    from stagecache.runtime.model.families import load_spec
    from stagecache.runtime.plan.plan import Sizing, plan_stage

    assert kernels.HAVE_TRITON

    # 1. raw kernel: every word size, chunked and partial pages, strided (page_first-like)
    #    host side, scattered ids, both directions, a persistent grid smaller than the work
    for page_bytes, word in ((64, 8), (40, 8), (36, 4), (18, 2), (9, 1), (3 * 64 + 16, 8), (3 * 64 + 8, 8)):
        L, P = 3, 7
        dev = [torch.randint(0, 256, (P, page_bytes), dtype=torch.uint8) for _ in range(L)]
        host = torch.zeros((P, L, page_bytes), dtype=torch.uint8)
        anchor = torch.zeros(2, dtype=torch.int64)
        spans = [kernels.BufferSpan(page_bytes, dev[i].data_ptr(), host.data_ptr() + i * page_bytes,
                                    page_bytes, L * page_bytes) for i in range(L)]
        geo = kernels.chunk_table(spans, anchor.data_ptr(), chunk_bytes=64)
        assert geo.word == word, (page_bytes, geo.word)
        assert geo.chunks == L * len(kernels.chunk_sizes(page_bytes, 64))
        assert sum(r[4] for r in geo.rows) * geo.word == L * page_bytes
        table = torch.tensor(geo.rows, dtype=torch.int64)
        view = anchor.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[geo.word])
        did, hid = [5, 0, 3], [1, 6, 2]
        ids = torch.tensor([3, *did, *hid])
        off = (ids.data_ptr() - anchor.data_ptr()) // 8
        kernels.launch_stage_copy(view, anchor, table, off, geo, True, programs=2, num_warps=1)
        for i in range(L):
            assert torch.equal(host[hid, i], dev[i][did]), (page_bytes, i)
        assert int(host[[p for p in range(P) if p not in hid]].sum()) == 0
        host.zero_()  # another grid moves the same bytes
        kernels.launch_stage_copy(view, anchor, table, off, geo, True, programs=3, num_warps=1)
        for i in range(L):
            assert torch.equal(host[hid, i], dev[i][did]), (page_bytes, i, "3 programs")
        for t in dev:
            t.zero_()
        kernels.launch_stage_copy(view, anchor, table, off, geo, False, programs=3, num_warps=1)
        for i in range(L):
            assert torch.equal(dev[i][did], host[hid, i]), (page_bytes, i)
        assert all(int(t[[p for p in range(P) if p not in did]].sum()) == 0 for t in dev)
        zero = torch.zeros(1, dtype=torch.int64)
        host.zero_()
        kernels.launch_stage_copy(view, anchor, table, (zero.data_ptr() - anchor.data_ptr()) // 8, geo, True, 2)
        assert int(host.sum()) == 0  # n = 0: nothing moves
        print(f"kernel word={geo.word} ok")

    # 2. the controller's device mover: round trip bit-identical for every pool, both layouts,
    #    a layer subset and a layer-by-layer load through the same kernel
    spec = load_spec("tiny-v4")
    stage = build_layout(spec, 2).stages[1]
    rng = random.Random(7)
    for layout in ("layer_first", "page_first"):
        dp = StagePools(plan_stage(spec, stage, page_size=128, sizing=Sizing.runtime(6, host_pages=9)))
        hp = HostPools(dp, layout=layout)
        dp.allocator.alloc(6)
        hp.allocator.alloc(9)
        for bufs in dp.buffers.values():
            for b in bufs:
                b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8))
        before = {p: [b.clone() for b in bufs] for p, bufs in dp.buffers.items()}
        c = TransferController(dp, hp, use_triton=True, shape=LaunchShape(num_warps=4))
        src, host, dst = rng.sample(range(6), 3), rng.sample(range(9), 3), rng.sample(range(6), 3)
        r = c.backup(src, host).synchronize()
        assert r.path == "triton", r.path
        for pool in POOLS:
            for i, b in enumerate(hp.buffers[pool]):
                assert torch.equal(b[host], before[pool][i][src]), (layout, pool, i)
        for bufs in dp.buffers.values():
            for b in bufs:
                b.zero_()
        c.load(host, dst).synchronize()
        for pool in POOLS:
            for i, b in enumerate(dp.buffers[pool]):
                assert torch.equal(b[dst], before[pool][i][src]), (layout, pool, i)
        g = stage.pool_layers("c4")[0].global_id
        for bufs in dp.buffers.values():
            for b in bufs:
                b.zero_()
        c.load_layer_by_layer(host, dst, layers=[g])
        i = stage.pool_map("indexer")[stage.local_id(g)]
        assert torch.equal(dp.buffers["indexer"][i][dst], before["indexer"][i][src])
        assert int(dp.buffers["swa"][stage.local_id(g) + 1].sum()) == 0
        print(f"controller {layout} ok")
''')


def test_triton_kernels_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.split("\n")
    assert sum(line.startswith("kernel word=") for line in lines) == 7
    for layout in ("layer_first", "page_first"):
        assert f"controller {layout} ok" in lines


def test_a_short_last_piece_joins_the_chunk_before_it():
    from stagecache.runtime.transfer.kernels import chunk_sizes

    assert chunk_sizes(200, 64) == [64, 64, 72]  # an 8-byte tail is not an item of its own
    assert chunk_sizes(208, 64) == [64, 64, 64, 16]  # a quarter chunk stays one
    assert chunk_sizes(8448, 8192) == [8448] and chunk_sizes(1168, 1024) == [1168]
    assert chunk_sizes(40, 64) == [40] and chunk_sizes(16384, 8192) == [8192, 8192]

