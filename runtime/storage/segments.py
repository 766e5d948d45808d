"""The file store's log: records appended to segment files, their format, and reading them back.

Why a log: one file per 4 MiB object costs a create, a rename and a fresh read-ahead window per
object, and on a virtual disk that alone held plain per-file reads to half of one sequential
file.  A *segment* is one file that records are appended to and never rewritten in place, so a
batch of objects is one sequential stream.  A record at offset ``E`` of its segment::

    RECORD struct | key | zero padding | payload

Every byte of a record is checked when read (struct and key by CRC and by value, padding for
zeros, payload by CRC); a payload of at least ``ALIGN_FROM`` bytes starts on a 4 KiB boundary (a
misaligned copy out of the page cache costs about twice as much).  A writer that dies mid-record
leaves a torn tail that ``scan`` stops at, or a payload that fails its CRC: a miss and an error,
never data (docs/l3.md).
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import crc32c

MAGIC = b"SCL3rec1"
#: magic, head bytes, key bytes, payload bytes, payload CRC-32C, flags, CRC-32C of struct + key.
RECORD = struct.Struct("<8sIIQIII")
REMOVED = 1  # flag: a tombstone (the key was removed or found corrupt)
MAX_KEY = 255
#: Payloads at least this large start page-aligned in the file.
ALIGN_FROM = 64 << 10
PAGE = 4096
#: The most bytes a record's head can take (struct, longest key, alignment padding).
HEAD_MAX = RECORD.size + MAX_KEY + PAGE
SEGMENT_SUFFIX = ".l3seg"
#: Checksums of payloads this large run on the checksum thread (the GIL released), overlapped
#: with the next record's I/O; smaller ones inline (a thread hop costs more than they do).
THREAD_CRC_FROM = 256 << 10


@dataclass(frozen=True)
class Head:
    """A record's parsed head."""

    key: str
    head: int
    payload: int
    crc: int
    flags: int

    @property
    def size(self) -> int:
        return self.head + self.payload


def head_bytes(offset: int, key_len: int, payload: int) -> int:
    """Bytes from a record's start to its payload when the record starts at ``offset``."""
    base = RECORD.size + key_len
    if payload >= ALIGN_FROM:
        return -(-(offset + base) // PAGE) * PAGE - offset
    return -(-base // 8) * 8


def record_bound(payload: int, key_len: int = MAX_KEY) -> int:
    """The most bytes a record of ``payload`` bytes takes on disk, wherever it starts."""
    if payload >= ALIGN_FROM:
        return RECORD.size + key_len + PAGE - 1 + payload
    return head_bytes(0, key_len, payload) + payload


def pack_head(offset: int, key: str, payload: int, crc: int, flags: int = 0) -> bytes:
    raw = key.encode()
    head = head_bytes(offset, len(raw), payload)
    fields = [MAGIC, head, len(raw), payload, crc, flags]
    check = crc32c.crc32c(raw, crc32c.crc32c(RECORD.pack(*fields, 0)))
    return RECORD.pack(*fields, check) + raw + bytes(head - RECORD.size - len(raw))


def parse_head(buf: bytes | bytearray | memoryview) -> Head | None:
    """The head at the start of ``buf``, or None when any of its bytes is wrong.

    ``buf`` holds the head (or as much of the file as there is: a head cut short by the end of
    the file is found by the caller, whose record then runs past the end).
    """
    if len(buf) < RECORD.size:
        return None
    magic, head, key_len, payload, crc, flags, check = RECORD.unpack_from(buf)
    if magic != MAGIC or key_len > MAX_KEY or flags & ~REMOVED:
        return None
    if not RECORD.size + key_len <= head <= HEAD_MAX or len(buf) < RECORD.size + key_len:
        return None
    raw = bytes(buf[RECORD.size:RECORD.size + key_len])
    fields = RECORD.pack(magic, head, key_len, payload, crc, flags, 0)
    if crc32c.crc32c(raw, crc32c.crc32c(fields)) != check:
        return None
    pad = memoryview(buf)[RECORD.size + key_len:min(head, len(buf))]
    if pad != bytes(len(pad)):
        return None
    try:
        key = raw.decode()
    except UnicodeDecodeError:
        return None
    return Head(key, head, payload, crc, flags)


def scan(fd: int, size: int) -> tuple[list[tuple[int, Head]], int]:
    """The whole records of a segment (offset, head) in file order, and where they end.

    Stops at the first record that is not whole (a torn tail); payloads are not read (their
    CRC is checked when an object is read).
    """
    out: list[tuple[int, Head]] = []
    off = 0
    while off + RECORD.size <= size:
        h = parse_head(os.pread(fd, min(HEAD_MAX, size - off), off))
        if h is None or off + h.size > size:
            break
        out.append((off, h))
        off += h.size
    return out, off


_SEGMENT_RE = re.compile(r"^(?P<tag>[A-Za-z0-9_.-]+)\.s(?P<seq>\d{10})-[0-9a-f]{8}" + re.escape(SEGMENT_SUFFIX) + "$")


def segment_name(tag: str, seq: int) -> str:
    return f"{tag}.s{seq:010d}-{os.urandom(4).hex()}{SEGMENT_SUFFIX}"


def parse_segment_name(name: str) -> tuple[str, int] | None:
    """(tag, sequence number) of a segment file name; None for any other name."""
    m = _SEGMENT_RE.match(name)
    return (m["tag"], int(m["seq"])) if m else None


# -- I/O ----------------------------------------------------------------------------------------
def _advance(views: list[memoryview], n: int) -> None:
    while views and n >= len(views[0]):
        n -= len(views[0])
        views.pop(0)
    if views and n:
        views[0] = views[0][n:]


def pwrite_all(fd: int, buffers: Sequence[bytes | memoryview], offset: int) -> None:
    """``pwritev`` until every byte is out (a short write continues where it stopped)."""
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        n = os.pwritev(fd, views, offset)
        offset += n
        _advance(views, n)


def pread_all(fd: int, buffers: Sequence[bytearray | memoryview], offset: int) -> int:
    """``preadv`` until the buffers are full or the file ends; bytes read."""
    views = [memoryview(b).cast("B") for b in buffers]
    total = 0
    while views:
        n = os.preadv(fd, views, offset)
        if n == 0:
            break
        total += n
        offset += n
        _advance(views, n)
    return total


# -- checksums ----------------------------------------------------------------------------------
def crc_of(buffers: Sequence[memoryview]) -> int:
    value = 0
    for b in buffers:
        value = crc32c.crc32c(b, value)
    return value


_pool: ThreadPoolExecutor | None = None


def _forget_pool() -> None:
    global _pool
    _pool = None  # a forked child has no checksum thread: it starts its own


os.register_at_fork(after_in_child=_forget_pool)


class Done:
    """A checksum computed inline, with the face of a ``Future``."""

    def __init__(self, value: int):
        self.value = value

    def result(self) -> int:
        return self.value


#: A checksum being computed.
Check = Future[int] | Done


def crc_async(buffers: Sequence[memoryview], nbytes: int, threaded: bool = True) -> Check:
    """The payload's CRC-32C: on the checksum thread for a large payload (``crc32c`` releases
    the GIL for large buffers, so it runs beside the caller's next ``pwritev``/``preadv``), else
    at once (also when ``threaded`` is False: the caller is about to reuse the buffers).  One
    thread: checksums of one batch come back in order, and a 2-core host keeps a
    core for the copy."""
    global _pool
    if nbytes < THREAD_CRC_FROM or not threaded:
        return Done(crc_of(buffers))
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="l3-crc")
    return _pool.submit(crc_of, list(buffers))
