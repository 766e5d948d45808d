"""The Triton kernel that moves n token pages of every selected buffer of a stage in one launch.

Its geometry (the chunk table) and its launch are in ``kernels``, which imports this module on the
first launch: importing triton costs about 0.7 CPU-seconds, which a run on CPU never needs.  The
serve supervisor preloads it into the forkserver when the stages run on CUDA, so that every stage
is forked with it compiled in.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _item_addresses(item, total, chunks, per, table, ids, n):
    """Device offset, host offset and words of work item ``item`` (zeros past ``total``)."""
    live = item < total
    chunk = item // per
    page = item - chunk * per
    row = table + chunk * 5
    dev = tl.load(row, mask=live, other=0) + tl.load(ids + 1 + page, mask=live, other=0) * tl.load(
        row + 2, mask=live, other=0)
    host = tl.load(row + 1, mask=live, other=0) + tl.load(ids + 1 + n + page, mask=live, other=0) * tl.load(
        row + 3, mask=live, other=0)
    size = tl.load(row + 4, mask=live, other=0)
    return dev, host, size


@triton.jit(do_not_specialize=["ids_off"])  # a one-off ring entry's offset must not recompile
def stage_copy_kernel(
    anchor,  # pointer every address is a word offset from (int8/16/32/64 by the word size)
    anchor64,  # the same address as an int64 pointer (page ids)
    table,  # int64[C, 5]: the chunk table
    ids_off,  # int64 offset from anchor64 of the ring entry [n, device ids, host ids]
    chunks,  # C
    STEP: tl.constexpr,  # words per program-step: 32 lanes x warps x words per lane
    D2H: tl.constexpr,
    LINE: tl.constexpr,  # words per 128-byte line of host memory (1: no alignment)
):
    ids = anchor64 + ids_off
    n = tl.load(ids)
    total = n * chunks
    per = tl.maximum(n, 1)  # the chunk-major divisor (n = 0: nothing is live)
    lanes = tl.arange(0, STEP)
    step = tl.num_programs(0)
    item = tl.program_id(0).to(tl.int64)
    # the addresses of a program's next item are loaded while it copies the current one, so
    # the latency of the table and id loads is paid once per program, not once per item
    dev, host, size = _item_addresses(item, total, chunks, per, table, ids, n)
    # while loops, not range(): loop bounds loaded from memory are 1-element arrays in
    # some Triton interpreters, which range() refuses
    while item < total:
        nxt = item + step
        ndev, nhost, nsize = _item_addresses(nxt, total, chunks, per, table, ids, n)
        if D2H:
            src = dev
            dst = host
        else:
            src = host
            dst = dev
        # steps start on a 128-byte line of the host side, so every PCIe request of a step
        # covers whole lines but at the chunk's two ends (the anchor is line-aligned)
        shift = host % LINE  # host offsets may be negative (host memory below the anchor)
        w = -tl.where(shift < 0, shift + LINE, shift)
        while w < size:
            pos = w + lanes
            mask = (pos >= 0) & (pos < size)
            vals = tl.load(anchor + src + pos, mask=mask, cache_modifier=".cg")
            tl.store(anchor + dst + pos, vals, mask=mask, cache_modifier=".cs")
            w += STEP
        item = nxt
        dev = ndev
        host = nhost
        size = nsize
