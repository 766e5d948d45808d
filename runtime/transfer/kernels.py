"""The geometry and the launch of the one Triton kernel that moves n token pages of every
selected buffer of a stage in one launch (the kernel itself: ``triton_copy``).

A HiCache move is "the same n page ids in every buffer of every pool kind" (39 buffers on a
flash pp4 stage) and is usually a few pages, so a launch per buffer or per page was dominated by
its fixed host cost.  Here a move is one launch over a chunk table (built once per selection),
items walked chunk-major by a persistent grid, each warp's words starting on a 128-byte line of
the host side (partial-sector writes to pinned memory ran at a tenth of the link speed on the
H200); the page count and ids come from a ring entry, so a launch is identical per entry and is
captured once in a CUDA graph.  docs/bench-transfer.md, "How stagecache moves pages", gives the
layout.  Bytes move as integer words, so copies are bit-exact; runs on CPU tensors under
``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass

#: Whether the Triton engine can run here; its kernel module is imported on the first launch
#: (``stage_copy_kernel``), not with this one: triton's import is about 0.7 CPU-seconds that a CPU
#: run, which never launches it, should not pay in every process that imports the transfer layer.
HAVE_TRITON = importlib.util.find_spec("triton") is not None

#: Bytes per work item (one chunk of one page of one buffer).
CHUNK_BYTES = 8192
#: Bytes per work item of small moves, which would not give every warp of the grid an item.  2 KiB
#: beat 1 KiB in the H200 sweep (a 1,168-byte C128 page is one item, not 1,024 + 144 bytes).
FINE_CHUNK_BYTES = 2048
#: Warps per program (each step moves 32 consecutive words per warp).  4 warps x 16 programs per
#: SM beat 1 x 32 on the H200 at 64 MiB for every pool kind tried, both directions (the bench's
#: ``--sweep``), and tie at one page.
NUM_WARPS = 4
#: Words each lane moves per step (more loads in flight per lane before its stores).
LANE_WORDS = 1
#: Programs per SM of the persistent grid (enough loads/stores in flight to cover PCIe latency).
PROGRAMS_PER_SM = 16
#: Columns of the chunk table: device word offset, host word offset, device page stride
#: (words), host page stride (words), words in the chunk.
TABLE_COLUMNS = 5

@dataclass(frozen=True)
class BufferSpan:
    """Where one buffer's pages live: base addresses (bytes) and page strides (bytes)."""

    page_bytes: int
    dev_addr: int
    host_addr: int
    dev_stride: int
    host_stride: int


@dataclass(frozen=True)
class ChunkTable:
    """The launch geometry of one buffer selection: table rows, word size, alignment."""

    rows: tuple[tuple[int, int, int, int, int], ...]
    word: int  # bytes per word: 8, 4, 2 or 1

    @property
    def chunks(self) -> int:
        return len(self.rows)


def word_bytes(values: Sequence[int]) -> int:
    """Widest word (8/4/2/1 bytes) dividing every address, stride and size."""
    for w in (8, 4, 2):
        if all(v % w == 0 for v in values):
            return w
    return 1


def chunk_table(spans: Sequence[BufferSpan], anchor_addr: int, chunk_bytes: int = CHUNK_BYTES) -> ChunkTable:
    """Cut one token page of every span into chunks; offsets relative to ``anchor_addr``.

    Pure arithmetic on addresses, so it is built once per buffer selection and the
    result (uploaded as an int64 tensor) serves every later call.
    """
    if chunk_bytes < 8 or chunk_bytes % 8:
        raise ValueError(f"chunk_bytes must be a positive multiple of 8, got {chunk_bytes}")
    values = [anchor_addr]
    for s in spans:
        values += [s.page_bytes, s.dev_addr, s.host_addr, s.dev_stride, s.host_stride]
    word = word_bytes(values)
    rows = []
    for s in spans:
        off = 0
        for size in chunk_sizes(s.page_bytes, chunk_bytes):
            rows.append(((s.dev_addr + off - anchor_addr) // word, (s.host_addr + off - anchor_addr) // word,
                         s.dev_stride // word, s.host_stride // word, size // word))
            off += size
    return ChunkTable(tuple(rows), word)


def chunk_sizes(page_bytes: int, chunk_bytes: int) -> list[int]:
    """A page cut into chunks of ``chunk_bytes``; a last piece under a quarter chunk joins the one
    before it (an item of a few hundred bytes costs a program as much address work as a full one)."""
    sizes = [min(chunk_bytes, page_bytes - off) for off in range(0, page_bytes, chunk_bytes)]
    if len(sizes) > 1 and sizes[-1] < chunk_bytes // 4:
        tail = sizes.pop()
        sizes[-1] += tail
    return sizes


@functools.cache
def stage_copy_kernel():
    """The jitted kernel (runtime/transfer/triton_copy.py), imported once, on first use."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed; the Triton transfer engine is unavailable")
    from .triton_copy import stage_copy_kernel as kernel

    return kernel


def launch_stage_copy(anchor, anchor64, table, ids_off: int, geometry: ChunkTable, d2h: bool, programs: int,
                      num_warps: int = NUM_WARPS, lane_words: int = LANE_WORDS) -> None:
    """Queue the one launch of a stage move on the current stream (no host sync, no allocation).

    ``anchor`` is a tensor whose dtype has ``geometry.word`` bytes and whose address the
    table offsets are relative to, ``anchor64`` the same tensor as int64; the ring entry lies
    ``ids_off`` int64 words from it (pinned host memory on CUDA).  With n = 0 in the entry
    the programs exit at once (used to compile before graph capture).
    """
    stage_copy_kernel()[(max(1, programs),)](
        anchor, anchor64, table, ids_off, geometry.chunks, STEP=32 * num_warps * lane_words, D2H=d2h,
        LINE=128 // geometry.word, num_warps=num_warps,
    )
