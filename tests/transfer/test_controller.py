"""Transfers on CPU: device -> host -> device is bit-identical for every pool kind and layout."""

from __future__ import annotations

import contextlib
import sys
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from plans import pools as make_pools
from stagecache.runtime.errors import LayerNotOwnedError
from stagecache.runtime.memory.host_pools import HostPools
from stagecache.runtime.model.families import load_spec
from stagecache.runtime.model.families.deepseek_v4 import HOST_CACHED
from stagecache.runtime.model.layer_map import build_layout
from stagecache.runtime.transfer import native
from stagecache.runtime.transfer.controller import TransferController, TransferError
from stagecache.runtime.transfer.pages import plain_ids
from stagecache.runtime.transfer.selection import buffer_pair
from stagecache.runtime.transfer.stats import TransferStats

TINY = load_spec("tiny-v4")
STAGE = build_layout(TINY, 2).stages[1]  # has every pool kind
DEV_PAGES, HOST_PAGES = 12, 20


def make(layout: str, seed: int = 0):
    """Pools with every page allocated (transfers refuse unallocated pages)."""
    dp = make_pools(TINY, STAGE, 128, DEV_PAGES, host_pages=HOST_PAGES)
    hp = HostPools(dp, layout=layout)
    dp.allocator.alloc(DEV_PAGES)
    hp.allocator.alloc(HOST_PAGES)
    g = torch.Generator().manual_seed(seed)
    for bufs in dp.buffers.values():
        for b in bufs:
            b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))
    stats = TransferStats()
    return dp, hp, TransferController(dp, hp, stats), stats


def snapshot(dp):
    return {p: [b.clone() for b in bufs] for p, bufs in dp.buffers.items()}


page_sets = st.integers(1, DEV_PAGES).flatmap(lambda n: st.tuples(
    st.permutations(range(DEV_PAGES)).map(lambda p: p[:n]),
    st.permutations(range(HOST_PAGES)).map(lambda p: p[:n]),
    st.permutations(range(DEV_PAGES)).map(lambda p: p[:n]),
))


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled-copy", "numpy-copy"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@settings(max_examples=12, deadline=None)
@given(pages=page_sets)
def test_round_trip_bit_identical_every_pool(layout, compiled, pages):
    """Both CPU copy paths: one C call per move where the helper is built, numpy indexing else."""
    if compiled and native.module() is None:
        pytest.skip("the compiled helper was not built at install: the numpy path is the only one")
    src, host, dst = (list(x) for x in pages)
    with contextlib.nullcontext() if compiled else mock.patch.object(native, "module", lambda: None):
        dp, hp, c, stats = make(layout)
    assert (c.mover._native is not None) == compiled
    before = snapshot(dp)
    c.backup(src, host).synchronize()
    for pool in HOST_CACHED:  # host holds exactly the device bytes
        for i, b in enumerate(hp.buffers[pool]):
            assert torch.equal(b[host], before[pool][i][src]), (pool, i)
    for bufs in dp.buffers.values():  # wipe the device, then load back elsewhere
        for b in bufs:
            b.zero_()
    c.load(host, dst).synchronize()
    for pool in HOST_CACHED:
        assert dp.buffers[pool], pool
        for i, b in enumerate(dp.buffers[pool]):
            assert torch.equal(b[dst], before[pool][i][src]), (pool, i)
            untouched = sorted(set(range(DEV_PAGES)) - set(dst))
            assert int(b[untouched].sum()) == 0
    live = stats.live()
    nbytes = len(src) * dp.token_page_bytes()
    assert live.transfer_bytes.d2h == nbytes and live.transfer_bytes.h2d == nbytes
    assert stats.pages("d2h") == len(src) and live.transfer_count.h2d == 1


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_layer_subset_moves_only_those_layers(layout):
    dp, hp, c, stats = make(layout)
    c4_layer = STAGE.pool_layers("c4")[1].global_id
    c128_layer = STAGE.pool_layers("c128")[0].global_id
    r = c.backup([0, 1], [5, 6], layers=[c4_layer, c128_layer])
    assert r.layers == (c4_layer, c128_layer)
    for pool in HOST_CACHED:
        chosen = {STAGE.pool_map(pool).get(STAGE.local_id(g)) for g in (c4_layer, c128_layer)} - {None}
        for i, b in enumerate(hp.buffers[pool]):
            want = dp.buffers[pool][i][[0, 1]] if i in chosen else torch.zeros_like(b[[5, 6]])
            assert torch.equal(b[[5, 6]], want), (pool, i)
    expected = 2 * sum(dp.page_bytes(p) for p in HOST_CACHED
                       for g in (c4_layer, c128_layer) if STAGE.pool_map(p).get(STAGE.local_id(g)) is not None)
    assert r.nbytes == expected == stats.live().transfer_bytes.d2h


def test_load_layer_by_layer_matches_load():
    dp, hp, c, stats = make("layer_first")
    before = snapshot(dp)
    c.backup([3, 4, 5], [0, 1, 2])
    r = c.load_layer_by_layer([0, 1, 2], [9, 10, 11])
    assert r.layers == tuple(range(STAGE.start, STAGE.end))
    for layer in r.layers:
        r.wait(layer)  # no-op on CPU, but must accept every layer of the transfer
    for pool in HOST_CACHED:
        for i, b in enumerate(dp.buffers[pool]):
            assert torch.equal(b[[9, 10, 11]], before[pool][i][[3, 4, 5]])
    with pytest.raises(TransferError, match="not part of this transfer"):
        r.wait(0)
    assert stats.live().transfer_bytes.h2d == 3 * dp.token_page_bytes()


@pytest.mark.parametrize(("dev", "host", "match"), [
    ([0, 1], [0], "2 device pages but 1 host pages"),
    ([DEV_PAGES], [0], r"device page id\(s\) \[12\] out of range 0..11"),
    ([0], [HOST_PAGES + 3], r"host page id\(s\) \[23\] out of range 0..19"),
    ([0, 1], [4, 4], "destination host page"),
    ([0], ["1"], "must be integers"),
    ([-1], [0], "out of range"),
])
def test_bad_page_ids_are_refused_before_copying(dev, host, match):
    dp, hp, c, stats = make("layer_first")
    with pytest.raises(TransferError, match=match):
        c.backup(dev, host)
    assert all(int(b.sum()) == 0 for bufs in hp.buffers.values() for b in bufs)
    assert stats.live().transfer_count.d2h == 0


@pytest.mark.parametrize("direction", ["backup", "load"])
def test_unallocated_pages_are_refused(direction):
    dp, hp, c, stats = make("layer_first")
    dp.allocator.free([3])
    hp.allocator.free([7, 9])
    host_before = [b.clone() for bufs in hp.buffers.values() for b in bufs]
    dev_before = [b.clone() for bufs in dp.buffers.values() for b in bufs]
    move = c.backup if direction == "backup" else (lambda d, h: c.load(h, d))
    with pytest.raises(TransferError, match=r"device page\(s\) \[3\] are not allocated in stage 1 device"):
        move([0, 3], [1, 2])
    with pytest.raises(TransferError, match=r"host page\(s\) \[7, 9\] are not allocated in stage 1 host"):
        move([0, 1, 2], [7, 8, 9])
    assert all(torch.equal(a, b) for a, b in zip(host_before, [b for bufs in hp.buffers.values() for b in bufs],
                                                    strict=True))
    assert all(torch.equal(a, b) for a, b in zip(dev_before, [b for bufs in dp.buffers.values() for b in bufs],
                                                   strict=True))
    assert stats.live().transfer_count.d2h == stats.live().transfer_count.h2d == 0
    move([0, 1], [1, 2])  # allocated pages still move


def test_bad_layers_and_duplicate_load_destination():
    dp, hp, c, _ = make("page_first")
    with pytest.raises(LayerNotOwnedError, match=r"stage 1 owns global layers \[6, 12\)"):
        c.load([0], [0], layers=[0])
    with pytest.raises(TransferError, match="destination device page"):
        c.load([0, 1], [3, 3])
    assert c.backup([], []).nbytes == 0


def test_controller_refuses_a_host_pool_of_another_stage():
    dp, hp, _, _ = make("layer_first")
    other = make_pools(TINY, build_layout(TINY, 2).stages[0], 128, 4)
    with pytest.raises(TransferError, match="do not mirror"):
        TransferController(other, hp)
    with pytest.raises(TransferError, match="needs device pools on CUDA"):
        TransferController(dp, hp, use_triton=True)


def _host_bytes(hp) -> list[torch.Tensor]:
    return [b.clone() for bufs in hp.buffers.values() for b in bufs]


@pytest.mark.skipif(native.module() is None, reason="the compiled helper was not built at install")
@pytest.mark.parametrize("bad", ["out of range", "unallocated", "repeated destination", "counts differ"])
def test_the_compiled_checked_copy_checks_every_id_before_it_moves_any(bad):
    """``copy_checked`` refuses a move whose *last* id is bad with nothing copied (the check runs
    over every id before the first byte moves), and copies once the ids are good."""
    import numpy as np

    dp, hp, c, _ = make("layer_first")
    hp.allocator.free([19])
    table, threads_from = c.mover._table(c.selection())
    words = c.checker.context.words
    dev = np.array([0, 1, 2, 3], dtype=np.int64)
    host = {"out of range": [4, 5, 6, HOST_PAGES], "unallocated": [4, 5, 6, 19],
            "repeated destination": [4, 5, 6, 4], "counts differ": [4, 5, 6]}[bad]
    before = _host_bytes(hp)
    assert native.module().copy_checked(words, table, dev, np.array(host, dtype=np.int64), True, 1,
                                        threads_from) is False
    assert all(torch.equal(a, b) for a, b in zip(before, _host_bytes(hp), strict=True))
    # ids it does not read in place: not taken (the controller converts and checks them)
    assert native.module().copy_checked(words, table, dev.astype(np.int32), dev, True, 1, threads_from) is None
    assert native.module().copy_checked(words, table, dev, np.array([4, 5, 6, 7], dtype=np.int64), True, 1,
                                        threads_from) is True
    for ref in c.selection().buffers:
        d, h = buffer_pair(ref, dp, hp)
        assert torch.equal(h[[4, 5, 6, 7]], d[[0, 1, 2, 3]]), ref


@pytest.mark.skipif(native.module() is None, reason="the compiled helper was not built at install")
@pytest.mark.parametrize("ids", ["tensor", "numpy", "list"])
def test_a_cpu_move_is_checked_and_copied_in_one_call(ids):
    """The CPU mover's one-call path takes the controller's common move (tensors and arrays read
    in place, a list once converted); the result reads back the same ids, and a bad id still
    goes to the checks that name it, with nothing moved."""
    import numpy as np

    dp, hp, c, stats = make("page_first")
    sel = c.selection()
    as_given = {"tensor": torch.tensor, "numpy": lambda v: np.array(v, dtype=np.int64), "list": list}[ids]
    dev, host = (plain_ids(as_given(v), "page", 1) for v in ([0, 1], [2, 3]))  # what the controller passes
    assert c.mover.check_and_move(sel, dev, host, True) is not None
    result = c.backup(as_given([5, 6, 7]), as_given([8, 9, 10]))
    assert result.device_pages == [5, 6, 7] and result.host_pages == [8, 9, 10] and result.pages == 3
    assert result.nbytes == sel.nbytes(3) and result.seconds is not None and result.seconds >= 0
    assert stats.live().transfer_count.d2h == 1  # the check_and_move call above is the mover alone
    for ref in sel.buffers:
        d, h = buffer_pair(ref, dp, hp)
        assert torch.equal(h[[2, 3, 8, 9, 10]], d[[0, 1, 5, 6, 7]]), ref
    before = _host_bytes(hp)
    with pytest.raises(TransferError, match=r"destination host page\(s\) \[11\] appear more than once"):
        c.backup(as_given([0, 1, 2]), as_given([11, 12, 11]))
    assert all(torch.equal(a, b) for a, b in zip(before, _host_bytes(hp), strict=True))


def test_the_transfer_layer_imports_without_triton_and_loads_it_only_when_asked():
    """A CPU run never launches the Triton kernel, so importing the transfer layer (every stage
    process, every CLI command that moves pages) must not pay for importing triton."""
    import subprocess
    import sys

    code = ("import sys; import stagecache.runtime.transfer.controller; "
            "from stagecache.runtime.serve import stage_worker; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'triton'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_triton_that_does_not_import_leaves_the_torch_path(monkeypatch):
    from stagecache.runtime.transfer import device, kernels

    kernels.stage_copy_kernel.cache_clear()
    monkeypatch.setitem(sys.modules, "stagecache.runtime.transfer.triton_copy", None)  # import fails
    monkeypatch.setattr(kernels, "HAVE_TRITON", True)
    try:
        assert device.have_triton() is False
    finally:
        kernels.stage_copy_kernel.cache_clear()
