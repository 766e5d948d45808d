"""The embedded L3 backend: one private directory per deployment, pages in a log of segments.

Private (0700, owner-checked, ``O_NOFOLLOW``, ``O_EXCL``), append-only (a crash loses recent
objects, never returns a torn one: every byte is checked when read), bounded by emptying the
oldest segment with a second chance for what was used.  Small objects (manifests, probes) are
files of their own, renamed into place.  docs/l3.md describes the layout.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import crc32c

from ..errors import ConfigError
from ..private_fs import ensure_private_dir
from .base import L3Store, Outcome, Segments, StoreUnavailable, segments_bytes
from .keys import SCHEME, check_key
from .segments import (
    REMOVED,
    SEGMENT_SUFFIX,
    Check,
    Head,
    crc_async,
    pack_head,
    parse_head,
    parse_segment_name,
    pread_all,
    pwrite_all,
    record_bound,
    scan,
    segment_name,
)

log = logging.getLogger(__name__)

MAGIC = b"SCL3obj1"
#: A small object's trailer: magic, payload bytes, CRC-32C of the payload, a reserved word (0).
HEADER = struct.Struct("<8sQII")
SUFFIX = ".obj"
#: A segment's size: large enough that a batch streams, small enough to evict in steps.
SEGMENT_BYTES = 256 << 20
#: A bounded store's segments are at most this share of the bound (eviction's step).
SEGMENTS_PER_BOUND = 16
#: A temporary file older than this is a dead writer's, removed when a store opens the directory.
STALE_TEMP_S = 600.0
_OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_SEGMENT = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def private_dir(path: Path, what: str = "--l3-dir") -> Path:
    """``path`` as a directory only this user can enter (``private_fs``: created 0700 with its
    parents, or checked with every directory above it); a refusal makes the store unavailable."""
    try:
        return ensure_private_dir(path, what, parents=True, closed=True)
    except ConfigError as exc:
        raise StoreUnavailable(str(exc)) from None


def _mv(t: object) -> memoryview:
    """A tensor's bytes as a flat memoryview (what ``preadv`` fills and ``crc32c`` reads fastest)."""
    return memoryview(t.numpy()).cast("B")  # type: ignore[attr-defined]


@dataclass(eq=False)
class _Segment:
    """One segment file of this store: its records' keys in file order, its size on disk."""

    seq: int
    name: str
    size: int = 0
    keys: list[str] = field(default_factory=list)
    fd: int = -1  # open read-write while it is the one being appended to


@dataclass(eq=False)
class _Record:
    """Where an object lives, and whether it was used since it was written (second chance)."""

    seg: _Segment
    offset: int
    head: Head
    used: bool = False


class FileStore(L3Store):
    """A private directory of segment files and small-object files (see the module docstring).

    ``owner``: the key prefix of the stage whose store this is; it names the store's segments,
    so stages sharing a directory each append to, bound and evict their own.
    """

    backend = "file"

    def __init__(self, root: str | os.PathLike, capacity_bytes: int = 0, owner: str | None = None):
        super().__init__()
        self.root = private_dir(Path(root))
        self.owner = owner
        self.tag = check_key(owner) if owner else f"{SCHEME}.shared"
        self.stats.capacity_bytes = capacity_bytes
        self.segment_bytes = (min(SEGMENT_BYTES, max(1, capacity_bytes // SEGMENTS_PER_BOUND))
                              if capacity_bytes else SEGMENT_BYTES)
        self._index: dict[str, _Record] = {}
        self._segments: dict[int, _Segment] = {}  # by sequence number: oldest first
        self._active: _Segment | None = None
        self._next_seq = 0
        self._dead: list[str] = []  # corrupt objects found by the read in progress
        self._scan()

    # -- opening: rebuild the index from the segments -------------------------------------------
    def _scan(self) -> None:
        found = []
        with os.scandir(self.root) as it:
            for entry in it:
                if entry.name.startswith(".tmp-"):
                    self._stale_temp(entry)
                    continue
                parsed = parse_segment_name(entry.name)
                if parsed and parsed[0] == self.tag:
                    found.append((parsed[1], entry.name))
        for seq, name in sorted(found):
            self._adopt(seq, name)
            self._next_seq = seq + 1

    def _adopt(self, seq: int, name: str) -> None:
        try:
            fd = os.open(os.path.join(self.root, name), _OPEN_READ)
        except OSError as exc:
            log.warning("L3 file store %s: cannot open segment %s: %s", self.root, name, exc)
            return
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return
            records, end = scan(fd, st.st_size)
        except OSError as exc:
            log.warning("L3 file store %s: cannot read segment %s: %s", self.root, name, exc)
            return
        finally:
            os.close(fd)
        if end != st.st_size:
            log.warning("L3 file store %s: segment %s ends in %d bytes that are no whole record "
                        "(a torn write): ignored", self.root, name, st.st_size - end)
        seg = _Segment(seq, name, st.st_size)
        self._segments[seq] = seg
        self.stats.used_bytes += seg.size
        for off, h in records:
            seg.keys.append(h.key)
            if h.flags & REMOVED:
                self._index.pop(h.key, None)
            else:
                self._index[h.key] = _Record(seg, off, h)

    def _stale_temp(self, entry: os.DirEntry) -> None:
        """A temporary file left by a writer that died between create and rename; one younger
        than ``STALE_TEMP_S`` may be another process's write in flight (stages share the directory)."""
        try:
            if time.time() - entry.stat(follow_symlinks=False).st_mtime > STALE_TEMP_S:
                self._unlink(entry.name)
        except FileNotFoundError:
            pass

    def _unlink(self, name: str) -> None:
        try:
            os.unlink(os.path.join(self.root, name))
        except FileNotFoundError:
            pass

    # -- appending ------------------------------------------------------------------------------
    def _segment_for(self, size: int) -> _Segment:
        """The segment the next record of ``size`` bytes goes to (a new one when it is full)."""
        seg = self._active
        if seg is not None and seg.size and seg.size + size > self.segment_bytes:
            self._seal()
            seg = None
        if seg is None:
            name = segment_name(self.tag, self._next_seq)
            fd = os.open(os.path.join(self.root, name), _OPEN_SEGMENT, 0o600)
            seg = self._active = _Segment(self._next_seq, name, fd=fd)
            self._segments[seg.seq] = seg
            self._next_seq += 1
        return seg

    def _seal(self) -> None:
        if self._active is not None:
            os.close(self._active.fd)
            self._active.fd = -1
            self._active = None

    def _append(self, key: str, payload: Sequence[memoryview], nbytes: int, crc: int,
                flags: int = 0) -> Outcome:
        """One record at the end of the active segment; the index learns of it once it is out."""
        try:
            seg = self._segment_for(record_bound(nbytes, len(key)))
            head = pack_head(seg.size, key, nbytes, crc, flags)
            pwrite_all(seg.fd, [head, *payload], seg.size)
        except OSError as exc:
            log.warning("L3 file store %s: writing %s failed: %s", self.root, key, exc)
            if self._active is not None:
                self._truncate(self._active)
            return Outcome.NO_SPACE if exc.errno in (errno.ENOSPC, errno.EDQUOT) else Outcome.FAILED
        offset, size = seg.size, len(head) + nbytes
        seg.size += size
        seg.keys.append(key)
        self.stats.used_bytes += size
        if not flags & REMOVED:
            self._index[key] = _Record(seg, offset, Head(key, len(head), nbytes, crc, flags))
        return Outcome.OK

    def _truncate(self, seg: _Segment) -> None:
        """Cut a failed write's bytes off (the next record goes where it would have)."""
        try:
            os.ftruncate(seg.fd, seg.size)
        except OSError:
            self._seal()  # the next record starts a new segment

    def _drop(self, key: str, tombstone: bool) -> None:
        """Forget ``key``; with ``tombstone``, so that a restart forgets it too."""
        if self._index.pop(key, None) is not None and tombstone:
            self._append(key, [], 0, 0, REMOVED)

    # -- the bound ------------------------------------------------------------------------------
    def _room(self, need: int) -> bool:
        """Empty the oldest segments until ``need`` more bytes fit; False if they never can."""
        cap = self.stats.capacity_bytes
        if not cap:
            return True
        if need > cap:
            return False
        while self.stats.used_bytes + need > cap and self._segments:
            self._empty(next(iter(self._segments.values())))
        return self.stats.used_bytes + need <= cap

    def _empty(self, seg: _Segment) -> None:
        """Re-append the segment's used objects (their second chance spent), evict the rest,
        delete the file."""
        if seg is self._active:
            self._seal()
        keep = []
        for key in seg.keys:
            rec = self._index.get(key)
            if rec is None or rec.seg is not seg:
                continue
            if rec.used:
                keep.append(rec)
            else:
                del self._index[key]
                self.stats.evictions += 1
        if keep:
            self._move(seg, keep)
        del self._segments[seg.seq]
        self.stats.used_bytes -= seg.size
        self._unlink(seg.name)

    def _move(self, seg: _Segment, records: list[_Record]) -> None:
        try:
            fd = os.open(os.path.join(self.root, seg.name), _OPEN_READ)
        except OSError:
            for rec in records:
                self._index.pop(rec.head.key, None)
            return
        try:
            for rec in records:
                h = rec.head
                buf = bytearray(h.payload)
                got = pread_all(fd, [buf], rec.offset + h.head)
                del self._index[h.key]
                if got != h.payload or self._append(h.key, [memoryview(buf)], h.payload, h.crc) is not Outcome.OK:
                    self.stats.evictions += 1
        finally:
            os.close(fd)

    # -- reading --------------------------------------------------------------------------------
    def _read_batch(self, keys: Sequence[str], views: Sequence[list[memoryview]],
                    threaded: bool = True) -> list[Outcome]:
        """Read the objects in file order, each with one ``preadv``; check them (on the checksum
        thread when ``threaded``: no two objects of the batch are read into the same bytes)."""
        out = [Outcome.MISSING] * len(keys)
        todo = []
        for i, key in enumerate(keys):
            rec = self._index.get(key)
            if rec is None:
                continue
            if rec.head.payload != sum(len(v) for v in views[i]):
                out[i] = self._corrupt(key, f"{rec.head.payload} bytes stored, {sum(len(v) for v in views[i])} asked for")
                continue
            todo.append((rec.seg.seq, rec.offset, i, rec))
        todo.sort(key=lambda t: t[:2])
        checks = []
        opened: dict[int, int | None] = {}
        try:
            for _, _, i, rec in todo:
                fd = rec.seg.fd if rec.seg.fd >= 0 else self._open_segment(rec.seg, opened)
                if fd is None:
                    self._lose(rec.seg)
                    continue
                out[i], check = self._read_one(fd, rec, views[i], threaded)
                if check is not None:
                    checks.append((i, rec, check))
        finally:
            for fd in opened.values():
                if fd is not None:
                    os.close(fd)
        for i, rec, check in checks:
            value = check.result()
            if value != rec.head.crc:
                out[i] = self._corrupt(keys[i], f"checksum {value:#010x} != stored {rec.head.crc:#010x}")
            else:
                rec.used = True
                out[i] = Outcome.OK
        self._bury()
        return out

    def _lose(self, seg: _Segment) -> None:
        """Forget a segment that is gone (``--l3-reset`` by the head stage, a person): its
        objects are misses, and the next backup writes them anew."""
        if self._segments.pop(seg.seq, None) is seg:
            self.stats.used_bytes -= seg.size
            for key in seg.keys:
                rec = self._index.get(key)
                if rec is not None and rec.seg is seg:
                    del self._index[key]

    def _open_segment(self, seg: _Segment, opened: dict[int, int | None]) -> int | None:
        """A batch's fd of a sealed segment (opened once per batch); None if it is gone."""
        if seg.seq not in opened:
            try:
                opened[seg.seq] = os.open(os.path.join(self.root, seg.name), _OPEN_READ)
            except OSError as exc:
                log.warning("L3 file store %s: cannot open segment %s: %s", self.root, seg.name, exc)
                opened[seg.seq] = None
        return opened[seg.seq]

    def _read_one(self, fd: int, rec: _Record, payload: list[memoryview],
                  threaded: bool) -> tuple[Outcome, Check | None]:
        """Read one record; (FAILED or CORRUPT, None) or (OK so far, its pending checksum)."""
        h = rec.head
        head = bytearray(h.head)
        try:
            got = pread_all(fd, [head, *payload], rec.offset)
        except OSError as exc:
            log.warning("L3 file store %s: reading %s failed: %s", self.root, h.key, exc)
            return Outcome.FAILED, None
        if got != h.size:
            return self._corrupt(h.key, f"short record: {got} of {h.size} bytes"), None
        if parse_head(head) != h:
            return self._corrupt(h.key, "its head changed"), None
        return Outcome.OK, crc_async(payload, h.payload, threaded)

    def _corrupt(self, key: str, why: str) -> Outcome:
        """Drop a bad object; its tombstone is written when the batch's reads are done."""
        log.warning("L3 file store %s: object %s is corrupt (%s): dropped", self.root, key, why)
        if self._index.pop(key, None) is not None:
            self._dead.append(key)
        return Outcome.CORRUPT

    def _bury(self) -> None:
        """Tombstones for the objects a read found corrupt (so a restart does not adopt them)."""
        for key in self._dead:
            self._append(key, [], 0, 0, REMOVED)
        self._dead.clear()

    # -- the interface --------------------------------------------------------------------------
    def _get_into(self, keys: Sequence[str], views: Sequence[Segments]) -> list[Outcome]:
        starts = [t.data_ptr() for segs in views for t in segs]
        distinct = len(set(starts)) == len(starts)  # else a later read overwrites a checked one
        return self._read_batch(keys, [[_mv(t) for t in segs] for segs in views], distinct)

    def _set_from(self, keys: Sequence[str], views: Sequence[Segments]) -> list[Outcome]:
        """Append the new objects, each object's checksum computed while the one before it is
        written (a key already stored is kept and counts as used)."""
        out = [Outcome.OK] * len(keys)
        todo = []
        for i, (key, segs) in enumerate(zip(keys, views, strict=True)):
            rec = self._index.get(check_key(key))
            if rec is not None:
                rec.used = True
                continue
            arrays = [_mv(t) for t in segs]
            todo.append((i, key, arrays, segments_bytes(segs)))
        checks = [crc_async(arrays, n) for _, _, arrays, n in todo]
        for (i, key, arrays, n), check in zip(todo, checks, strict=True):
            crc = check.result()
            if key in self._index:  # the same key twice in one batch
                continue
            fits = self._room(record_bound(n, len(key)))
            out[i] = self._append(key, arrays, n, crc) if fits else Outcome.NO_SPACE
        return out

    def _exists(self, keys: Sequence[str]) -> list[bool]:
        """Up to the first key not stored (``batch_exists`` counts the leading run only)."""
        out = []
        for key in keys:
            found = key in self._index or self._is_file(key)
            out.append(found)
            if not found:
                break
        return out

    def remove(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._drop(check_key(key), tombstone=True)
            self._unlink(key + SUFFIX)

    def reset(self) -> int:
        """Delete every stagecache file in the directory (all stages' segments, the small
        objects); how many files went."""
        self._seal()
        n = 0
        with os.scandir(self.root) as it:
            names = [e.name for e in it]
        for name in names:
            ours = name.startswith(SCHEME + ".") and name.endswith((SUFFIX, SEGMENT_SUFFIX))
            if ours or name.startswith(".tmp-"):
                self._unlink(name)
                n += 1
        self._index.clear()
        self._segments.clear()
        self.stats.used_bytes = 0
        return n

    def close(self) -> None:
        self._seal()

    # -- small objects: a file each -------------------------------------------------------------
    def _path(self, key: str) -> str:
        return os.path.join(self.root, check_key(key) + SUFFIX)

    def _is_file(self, key: str) -> bool:
        try:
            return stat.S_ISREG(os.stat(self._path(key), follow_symlinks=False).st_mode)
        except FileNotFoundError:
            return False

    def get(self, key: str) -> bytes | None:
        try:
            fd = os.open(self._path(key), _OPEN_READ)
        except FileNotFoundError:
            rec = self._index.get(key)
            if rec is None:
                return None
            buf = bytearray(rec.head.payload)
            return bytes(buf) if self._read_batch([key], [[memoryview(buf)]]) == [Outcome.OK] else None
        except OSError as exc:
            raise StoreUnavailable(f"L3 file store {self.root}: cannot open {key}: {exc}") from None
        try:
            return self._read_file(key, fd)
        finally:
            os.close(fd)

    def _read_file(self, key: str, fd: int) -> bytes | None:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not HEADER.size <= st.st_size <= HEADER.size + (16 << 20):
            return self._bad_file(key, f"{st.st_size} bytes")
        raw = os.pread(fd, st.st_size, 0)
        magic, length, crc, reserved = HEADER.unpack_from(raw, len(raw) - HEADER.size)
        data = raw[:-HEADER.size]
        if len(raw) != st.st_size or magic != MAGIC or length != len(data) or reserved:
            return self._bad_file(key, "bad trailer or short read")
        if crc32c.crc32c(data) != crc:
            return self._bad_file(key, "checksum")
        return data

    def _bad_file(self, key: str, why: str) -> None:
        log.warning("L3 file store %s: object %s is corrupt (%s): dropped", self.root, key, why)
        self._unlink(key + SUFFIX)
        return None

    def set(self, key: str, data: bytes) -> Outcome:
        """Write (or replace) a small object: a temporary file renamed over its name."""
        path = self._path(key)
        self._drop(key, tombstone=True)
        tmp = os.path.join(self.root, f".tmp-{os.urandom(8).hex()}")
        try:
            fd = os.open(tmp, _OPEN_NEW, 0o600)
            try:
                pwrite_all(fd, [data, HEADER.pack(MAGIC, len(data), crc32c.crc32c(data), 0)], 0)
            finally:
                os.close(fd)
            os.rename(tmp, path)
        except OSError as exc:
            self._unlink(os.path.basename(tmp))
            log.warning("L3 file store %s: writing %s failed: %s", self.root, key, exc)
            return Outcome.NO_SPACE if exc.errno in (errno.ENOSPC, errno.EDQUOT) else Outcome.FAILED
        return Outcome.OK

