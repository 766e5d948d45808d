"""Triton kernel that copies scattered pages of many layer buffers in one launch.

A KV transfer moves the same page ids of every layer of a pool: with one
``copy_`` per page and layer that is thousands of tiny copies (the per-page
loop the benchmark uses as baseline).  Here every layer buffer is an address
in a pointer table, and one launch covers ``layers x pages`` programs, each
copying a chunk of one page:

    dst_table[l] + dst_idx[i] * dst_stride  <-  src_table[l] + src_idx[i] * src_stride

The same kernel serves every direction: device pool -> pinned host pool
directly (zero-copy through unified addressing), device pool -> a contiguous
staging buffer (gather before one large DMA), and the reverse of both.

Bytes are moved as the widest integer word that divides every address, page
size and stride, so a copy is bit-exact whatever dtype the bytes encode.
Importable and runnable on CPU tensors with ``TRITON_INTERPRET=1`` set before
the first import (tests do this in a subprocess).
"""

from __future__ import annotations

from collections.abc import Sequence

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is a test/gpu dependency
    triton = None
    tl = None
    HAVE_TRITON = False

#: Words per program along a page; 1024 x 8 B = 8 KiB per program for int64.
BLOCK_WORDS = 1024

#: Give the compiler the 16-byte alignment hint when addresses allow it (the benchmark's
#: sweep turns it off to measure what it buys; a compiler that rejects it turns it off).
USE_ALIGN16 = True

if HAVE_TRITON:

    @triton.jit
    def _copy_pages_kernel(
        src_table,  # int64[L]: base address of each source layer buffer (in bytes)
        dst_table,  # int64[L]
        src_idx,  # int64[N]: source page ids
        dst_idx,  # int64[N]
        n_pages,
        src_stride,  # words from page p to p+1 in a source buffer
        dst_stride,
        words_per_page,
        WORD: tl.constexpr,  # bytes per word: 8, 4, 2 or 1
        BLOCK: tl.constexpr,
        ALIGN16: tl.constexpr,  # every base address, page and stride is a multiple of 16 bytes
    ):
        pid = tl.program_id(0)  # layer * n_pages + page slot
        chunk = tl.program_id(1)
        layer = pid // n_pages
        slot = pid % n_pages
        if WORD == 8:
            ptype = tl.pointer_type(tl.int64)
        elif WORD == 4:
            ptype = tl.pointer_type(tl.int32)
        elif WORD == 2:
            ptype = tl.pointer_type(tl.int16)
        else:
            ptype = tl.pointer_type(tl.int8)
        src_addr = tl.load(src_table + layer)
        dst_addr = tl.load(dst_table + layer)
        if ALIGN16:  # lets the compiler use 16-byte accesses (addresses come from a table)
            src_addr = tl.multiple_of(src_addr, 16)
            dst_addr = tl.multiple_of(dst_addr, 16)
        src = src_addr.to(ptype)
        dst = dst_addr.to(ptype)
        sp = tl.load(src_idx + slot).to(tl.int64)
        dp = tl.load(dst_idx + slot).to(tl.int64)
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = offs < words_per_page
        vals = tl.load(src + sp * src_stride + offs, mask=mask)
        tl.store(dst + dp * dst_stride + offs, vals, mask=mask)


    @triton.jit
    def _copy_flat_kernel(
        src_table, dst_table, src_idx, dst_idx, n_pages, src_stride, dst_stride, words_per_page,
        total_words,
        WORD: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Small pages: one flat index space over (layer, page, word), so no lane idles.

        With 1 KiB pages a program-per-page grid leaves most of every block
        masked off and pays a program per page; here each program copies
        ``BLOCK`` consecutive words that may span several pages and layers.
        """
        w = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = w < total_words
        seg = w // words_per_page
        off = w - seg * words_per_page
        layer = seg // n_pages
        slot = seg - layer * n_pages
        if WORD == 8:
            ptype = tl.pointer_type(tl.int64)
        elif WORD == 4:
            ptype = tl.pointer_type(tl.int32)
        elif WORD == 2:
            ptype = tl.pointer_type(tl.int16)
        else:
            ptype = tl.pointer_type(tl.int8)
        src = tl.load(src_table + layer, mask=mask, other=0).to(ptype)
        dst = tl.load(dst_table + layer, mask=mask, other=0).to(ptype)
        sp = tl.load(src_idx + slot, mask=mask, other=0).to(tl.int64)
        dp = tl.load(dst_idx + slot, mask=mask, other=0).to(tl.int64)
        vals = tl.load(src + sp * src_stride + off, mask=mask)
        tl.store(dst + dp * dst_stride + off, vals, mask=mask)


#: Pages of fewer words than this use the flat kernel (C128 KV, indexer, C128 state at 256 tokens).
FLAT_BELOW_WORDS = 2048


def word_bytes(page_bytes: int, strides: Sequence[int], addresses: Sequence[int]) -> int:
    """Widest alignment (16/8/4/2/1 bytes) dividing the page size, both strides and every address.

    16 means 8-byte words whose pairs may be moved as one 16-byte access.
    """
    for w in (16, 8, 4, 2):
        if page_bytes % w == 0 and all(s % w == 0 for s in strides) and all(a % w == 0 for a in addresses):
            return w
    return 1


def copy_pages(
    src_table,
    dst_table,
    src_idx,
    dst_idx,
    page_bytes: int,
    src_stride_bytes: int,
    dst_stride_bytes: int,
    word: int,
    block_words: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Launch one copy of ``len(src_idx)`` pages for every entry of the tables.

    ``src_table``/``dst_table`` are int64 tensors of byte addresses (one per
    layer), ``src_idx``/``dst_idx`` int64 page ids, all on the launch device.
    The caller checks ids and alignment (``word_bytes``); this function only
    launches, so it is cheap enough to call once per pool kind per transfer.
    """
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed; the Triton transfer path is unavailable")
    n_layers = int(src_table.numel())
    n_pages = int(src_idx.numel())
    if n_layers == 0 or n_pages == 0:
        return
    if n_layers != int(dst_table.numel()) or n_pages != int(dst_idx.numel()):
        raise ValueError("copy_pages: source and destination tables/ids differ in length")
    align16 = word == 16 and USE_ALIGN16  # 8-byte words, 16-byte accesses allowed
    word = min(word, 8)
    words = page_bytes // word
    if words < FLAT_BELOW_WORDS:
        block = block_words or BLOCK_WORDS
        total = n_layers * n_pages * words
        _copy_flat_kernel[(triton.cdiv(total, block),)](
            src_table, dst_table, src_idx, dst_idx, n_pages,
            src_stride_bytes // word, dst_stride_bytes // word, words, total,
            WORD=word, BLOCK=block, num_warps=num_warps or max(1, min(8, block // 256)),
        )
        return
    block = min(block_words or BLOCK_WORDS, triton.next_power_of_2(words))
    grid = (n_layers * n_pages, triton.cdiv(words, block))
    args = (src_table, dst_table, src_idx, dst_idx, n_pages, src_stride_bytes // word,
            dst_stride_bytes // word, words)
    warps = num_warps or max(1, min(8, block // 256))
    try:
        _copy_pages_kernel[grid](*args, WORD=word, BLOCK=block, ALIGN16=align16, num_warps=warps)
    except Exception:
        if not align16:
            raise
        _disable_align16()
        _copy_pages_kernel[grid](*args, WORD=word, BLOCK=block, ALIGN16=False, num_warps=warps)


def _disable_align16() -> None:
    """The hint failed to compile on this Triton: fall back to plain 8-byte words for good."""
    global USE_ALIGN16
    USE_ALIGN16 = False
