"""The Triton copy kernel and the controller's Triton paths, run on CPU with TRITON_INTERPRET=1.

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
    from stagecache.runtime.memory.host_pools import HostPools
    from stagecache.runtime.model.layer_map import build_layout
    from stagecache.runtime.model.pool_kinds import HOST_CACHED, kind_table
    from stagecache.runtime.memory.pools import StagePools
    from stagecache.runtime.model.spec import load_spec

    assert kernels.HAVE_TRITON

    # 1. raw kernel: every word size, strided (page_first-like) destination, scattered ids
    # small pages take the flat kernel, 16 KiB+ pages the program-per-page kernel
    for page_bytes, want_word in ((64, 16), (36, 4), (18, 2), (9, 1), (8 * 2050, 16), (4 * 2101, 4), (8 * 2051, 8)):
        L, P = 3, 7
        src = [torch.randint(0, 256, (P, page_bytes), dtype=torch.uint8) for _ in range(L)]
        dst = torch.zeros((P, L, page_bytes), dtype=torch.uint8)  # one page of all layers contiguous
        s_tab = torch.tensor([t.data_ptr() for t in src], dtype=torch.int64)
        d_tab = torch.tensor([dst.data_ptr() + l * page_bytes for l in range(L)], dtype=torch.int64)
        s_idx, d_idx = torch.tensor([5, 0, 3]), torch.tensor([1, 6, 2])
        w = kernels.word_bytes(page_bytes, (page_bytes, L * page_bytes), [t.data_ptr() for t in src] + [dst.data_ptr()])
        assert w == want_word, (page_bytes, w)
        block = 4 if page_bytes < 100 else 512
        kernels.copy_pages(s_tab, d_tab, s_idx, d_idx, page_bytes, page_bytes, L * page_bytes, w, block_words=block)
        for l in range(L):
            assert torch.equal(dst[d_idx, l], src[l][s_idx]), (page_bytes, l)
        untouched = [p for p in range(P) if p not in d_idx.tolist()]
        assert int(dst[untouched].sum()) == 0
        print(f"kernel word={w} ok")

    # 2. controller Triton paths: round trip bit-identical for every pool, both layouts and modes;
    #    tiny staging chunks so the staged path really pipelines several chunks
    from stagecache.runtime.transfer import controller as ctl
    ctl.STAGING_CHUNK_MIN_BYTES, ctl.STAGING_CHUNKS, ctl.STAGING_MAX_BYTES = 1, 3, 1
    spec = load_spec("tiny-v4")
    stage = build_layout(spec, 2).stages[1]
    rng = random.Random(7)
    for layout in ("layer_first", "page_first"):
        for mode in ("direct", "staged"):
            dp = StagePools(spec, stage, 128, 6)
            hp = HostPools(dp, num_pages=9, layout=layout)
            for bufs in dp.buffers.values():
                for b in bufs:
                    b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8))
            before = {p: [b.clone() for b in bufs] for p, bufs in dp.buffers.items()}
            c = TransferController(dp, hp, use_triton=True, mode=mode)
            n = 3
            src = rng.sample(range(6), n)
            host = [4, 5, 0] if mode == "staged" else rng.sample(range(9), n)  # runs and a gap
            dst = rng.sample(range(6), n)
            r = c.backup(src, host).synchronize()
            assert r.path == f"triton-{mode}", r.path
            for pool in HOST_CACHED:
                for i, b in enumerate(hp.buffers[pool]):
                    assert torch.equal(b[host], before[pool][i][src]), (layout, mode, pool, i)
            for bufs in dp.buffers.values():
                for b in bufs:
                    b.zero_()
            c.load(host, dst).synchronize()
            for pool in HOST_CACHED:
                for i, b in enumerate(dp.buffers[pool]):
                    assert torch.equal(b[dst], before[pool][i][src]), (layout, mode, pool, i)
            # a layer subset through the same kernels
            g = stage.pool_layers("c4")[0].global_id
            for bufs in dp.buffers.values():
                for b in bufs:
                    b.zero_()
            c.load_layer_by_layer(host, dst, layers=[g])
            i = stage.pool_map("indexer")[stage.local_id(g)]
            assert torch.equal(dp.buffers["indexer"][i][dst], before["indexer"][i][src])
            assert int(dp.buffers["swa"][stage.local_id(g) + 1].sum()) == 0
            print(f"controller {layout} {mode} ok")

    # 3. auto picks staged for long host runs and direct for scattered pages (thresholds scaled
    #    down to tiny pages), and its staged choice round-trips bit-identically too
    ctl.AUTO_STAGED_MIN_BYTES, ctl.AUTO_STAGED_MIN_DMA_BYTES = 1, 2 * kind_table(spec, 128).page_bytes("swa")
    dp = StagePools(spec, stage, 128, 6)
    hp = HostPools(dp, num_pages=9)
    for bufs in dp.buffers.values():
        for b in bufs:
            b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8))
    c = TransferController(dp, hp, use_triton=True, mode="auto")
    r = c.backup([5, 0, 3], [2, 3, 4]).synchronize()
    assert r.path in ("triton-staged", "triton-mixed"), r.path
    for pool in HOST_CACHED:
        for i, b in enumerate(hp.buffers[pool]):
            assert torch.equal(b[[2, 3, 4]], dp.buffers[pool][i][[5, 0, 3]]), (pool, i)
    assert c.backup([5, 0, 3], [0, 4, 8]).synchronize().path == "triton-direct"
    print("auto choice ok")
''')


def test_triton_kernels_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.split("\n")
    assert sum(line.startswith("kernel word=") for line in lines) == 7
    for layout in ("layer_first", "page_first"):
        for mode in ("direct", "staged"):
            assert f"controller {layout} {mode} ok" in lines
    assert "auto choice ok" in lines
