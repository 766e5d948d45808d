"""The embedded L3 backend: one private directory per deployment, one file per object.

* **Private**: the directory is created 0700; an existing one must be a real directory (not a
  symlink), owned by this user and closed to group and others, else it is refused with one line.
  Files are opened ``O_NOFOLLOW``; temporaries are created ``O_CREAT | O_EXCL`` (0600).
* **Atomic**: an object is written to a temporary file and renamed over its name, so a reader
  sees a whole object or none; nothing is fsynced (a crash may lose recent objects, and a torn
  file fails its checksum).
* **Checked**: a 24-byte trailer holds a magic, the payload length and the payload's CRC-32C
  (hardware-accelerated ``crc32c``); it follows the payload, so the payload starts on a page
  boundary of the file (a misaligned copy out of the page cache costs twice as much); a read
  checks the file size, the trailer and the checksum,
  and an object that fails is a miss, a counted ``corrupt`` error and is deleted -- never data.
* **Bounded**: the store keeps at most ``capacity_bytes`` of its own objects (those of its key
  space), evicting the least recently used first; the index is rebuilt from the files' mtimes
  when a store opens an existing directory, so the order survives a restart.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import struct
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import crc32c

from .base import L3Store, Outcome, Segments, StoreUnavailable, segments_bytes
from .keys import SCHEME, check_key

log = logging.getLogger(__name__)

MAGIC = b"SCL3obj1"
#: The trailer: magic, payload bytes, CRC-32C of the payload, a reserved word that must be 0 (so a
#: changed byte anywhere in the file is caught: the payload by the checksum, the trailer by value).
HEADER = struct.Struct("<8sQII")
SUFFIX = ".obj"
#: Objects of one batch read whose files are opened (and asked for) before the first is read.
READ_AHEAD_OBJECTS = 32
#: A temporary file older than this is a dead writer's, removed when a store opens the directory.
STALE_TEMP_S = 600.0
_OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def private_dir(path: Path, what: str = "--l3-dir") -> Path:
    """``path`` as a directory only this user can enter (created 0700 with its parents)."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(path)
    except OSError as exc:
        raise StoreUnavailable(f"{what} {str(path)!r}: cannot create: {exc.strerror or exc}") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise StoreUnavailable(f"{what} {str(path)!r}: not a directory (a symlink is refused)")
    if st.st_uid != os.getuid():
        raise StoreUnavailable(f"{what} {str(path)!r}: owned by uid {st.st_uid}, not by this user "
                               f"(uid {os.getuid()}); expected a private directory")
    if st.st_mode & 0o077:
        raise StoreUnavailable(f"{what} {str(path)!r}: mode {stat.S_IMODE(st.st_mode):04o} lets other "
                               "users in; expected 0700 (chmod 700 it)")
    return path


def _write_all(fd: int, buffers: list) -> None:
    """``writev`` until every byte is out (a short write continues where it stopped)."""
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def _read_all(fd: int, buffers: list) -> int:
    """``readv`` until the buffers are full or the file ends; bytes read."""
    views = [memoryview(b).cast("B") for b in buffers]
    total = 0
    while views:
        n = os.readv(fd, views)
        if n == 0:
            break
        total += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
    return total


def _mv(t: object) -> memoryview:
    """A tensor's bytes as a flat memoryview (what ``readv`` fills and ``crc32c`` reads fastest)."""
    return memoryview(t.numpy()).cast("B")  # type: ignore[attr-defined]


class FileStore(L3Store):
    """A directory of object files (see the module docstring).

    ``owner``: the key prefix whose objects this store bounds and evicts (a stage's key space);
    other objects in the directory (other stages', manifests) are read and written but never
    evicted by it.  ``capacity_bytes`` 0: no bound.
    """

    backend = "file"

    def __init__(self, root: str | os.PathLike, capacity_bytes: int = 0, owner: str | None = None):
        super().__init__()
        self.root = private_dir(Path(root))
        self.owner = owner
        self.stats.capacity_bytes = capacity_bytes
        self._index: OrderedDict[str, int] = OrderedDict()  # owned key -> file bytes, LRU first
        self._scan()

    # -- index ----------------------------------------------------------------------------------
    def _owned(self, key: str) -> bool:
        return self.owner is None or key.startswith(self.owner + ".")

    def _scan(self) -> None:
        """Adopt the owned objects already in the directory, least recently used first."""
        found = []
        with os.scandir(self.root) as it:
            for entry in it:
                name = entry.name
                if name.startswith(".tmp-"):
                    self._stale_temp(entry)
                    continue
                if not name.endswith(SUFFIX) or not self._owned(name[:-len(SUFFIX)]):
                    continue
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISREG(st.st_mode):
                    found.append((st.st_mtime_ns, name[:-len(SUFFIX)], st.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self.stats.used_bytes += size

    def _stale_temp(self, entry: os.DirEntry) -> None:
        """A temporary file left by a writer that died between create and rename; one younger
        than ``STALE_TEMP_S`` may be another process's write in flight (stages share the directory)."""
        try:
            if time.time() - entry.stat(follow_symlinks=False).st_mtime > STALE_TEMP_S:
                self._unlink(entry.name)
        except FileNotFoundError:
            pass

    def _path(self, key: str) -> str:
        return os.path.join(self.root, check_key(key) + SUFFIX)

    def _unlink(self, name: str) -> None:
        try:
            os.unlink(os.path.join(self.root, name))
        except FileNotFoundError:
            pass

    def _forget(self, key: str) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self.stats.used_bytes -= size

    def _room(self, need: int) -> bool:
        """Evict owned objects, LRU first, until ``need`` more bytes fit; False if they never can."""
        cap = self.stats.capacity_bytes
        if not cap:
            return True
        if need > cap:
            return False
        while self.stats.used_bytes + need > cap and self._index:
            key, _ = next(iter(self._index.items()))
            self._forget(key)
            self._unlink(key + SUFFIX)
            self.stats.evictions += 1
        return self.stats.used_bytes + need <= cap

    # -- objects --------------------------------------------------------------------------------
    def _write(self, key: str, buffers: list, payload: int, crc: int, replace: bool) -> Outcome:
        path = self._path(key)
        if not replace and key in self._index:
            self._index.move_to_end(key)  # same key, same bytes: keep it, refresh its use
            return Outcome.OK
        size = HEADER.size + payload
        if self._owned(key):
            self._forget(key)
            if not self._room(size):
                return Outcome.NO_SPACE
        tmp = os.path.join(self.root, f".tmp-{os.urandom(8).hex()}")
        try:
            fd = os.open(tmp, _OPEN_NEW, 0o600)
            try:
                _write_all(fd, [*buffers, HEADER.pack(MAGIC, payload, crc, 0)])
            finally:
                os.close(fd)
            os.rename(tmp, path)
        except OSError as exc:
            self._unlink(os.path.basename(tmp))
            log.warning("L3 file store %s: writing %s failed: %s", self.root, key, exc)
            return Outcome.NO_SPACE if exc.errno in (errno.ENOSPC, errno.EDQUOT) else Outcome.FAILED
        if self._owned(key):
            self._index[key] = size
            self.stats.used_bytes += size
        return Outcome.OK

    def _open(self, key: str) -> int | Outcome:
        """An fd of the object, its whole file asked for at once (``WILLNEED``: one deep read
        instead of a read-ahead window that starts small in every file); or the outcome."""
        try:
            fd = os.open(self._path(key), _OPEN_READ)
        except FileNotFoundError:
            self._forget(key)
            return Outcome.MISSING
        except OSError as exc:
            log.warning("L3 file store %s: opening %s failed: %s", self.root, key, exc)
            return Outcome.FAILED
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        return fd

    def _read(self, key: str, buffers: list, payload: int, fd: int | Outcome | None = None) -> Outcome:
        """Read one object into ``buffers`` (``payload`` bytes in all) and check it."""
        fd = self._open(key) if fd is None else fd
        if isinstance(fd, Outcome):
            return fd
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != HEADER.size + payload:
                return self._corrupt(key, f"{st.st_size} bytes, expected {HEADER.size + payload}")
            head = bytearray(HEADER.size)
            got = _read_all(fd, [*buffers, head])
        except OSError as exc:
            log.warning("L3 file store %s: reading %s failed: %s", self.root, key, exc)
            return Outcome.FAILED
        finally:
            os.close(fd)
        magic, length, crc, reserved = HEADER.unpack(head)
        if got != HEADER.size + payload or magic != MAGIC or length != payload or reserved:
            return self._corrupt(key, "bad trailer or short read")
        value = 0
        for b in buffers:
            value = crc32c.crc32c(b, value)
        if value != crc:
            return self._corrupt(key, f"checksum {value:#010x} != stored {crc:#010x}")
        if key in self._index:
            self._index.move_to_end(key)
        elif self._owned(key):  # written by another process sharing the directory
            self._index[key] = HEADER.size + payload
            self.stats.used_bytes += HEADER.size + payload
        return Outcome.OK

    def _corrupt(self, key: str, why: str) -> Outcome:
        log.warning("L3 file store %s: object %s is corrupt (%s): dropped", self.root, key, why)
        self._forget(key)
        self._unlink(key + SUFFIX)
        return Outcome.CORRUPT

    # -- the interface --------------------------------------------------------------------------
    def _get_into(self, keys: Sequence[str], views: Sequence[Segments]) -> list[Outcome]:
        out: list[Outcome] = []
        for lo in range(0, len(keys), READ_AHEAD_OBJECTS):  # the disk sees a batch's reads at once
            fds = [self._open(k) for k in keys[lo:lo + READ_AHEAD_OBJECTS]]
            for i, fd in enumerate(fds):
                segs = views[lo + i]
                out.append(self._read(keys[lo + i], [_mv(t) for t in segs], segments_bytes(segs), fd))
        return out

    def _set_from(self, keys: Sequence[str], views: Sequence[Segments]) -> list[Outcome]:
        out = []
        for key, segs in zip(keys, views, strict=True):
            if key in self._index:
                self._index.move_to_end(key)
                out.append(Outcome.OK)
                continue
            arrays = [_mv(t) for t in segs]
            crc = 0
            for a in arrays:
                crc = crc32c.crc32c(a, crc)
            out.append(self._write(key, arrays, segments_bytes(segs), crc, replace=False))
        return out

    def _exists(self, keys: Sequence[str]) -> list[bool]:
        """Up to the first key not stored (``batch_exists`` counts the leading run only)."""
        out = []
        for key in keys:
            if key in self._index:
                out.append(True)
                continue
            try:
                found = stat.S_ISREG(os.stat(self._path(key), follow_symlinks=False).st_mode)
            except FileNotFoundError:
                found = False
            out.append(found)
            if not found:
                break
        return out

    def get(self, key: str) -> bytes | None:
        try:
            fd = os.open(self._path(key), _OPEN_READ)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreUnavailable(f"L3 file store {self.root}: cannot open {key}: {exc}") from None
        try:
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if size < HEADER.size or size > HEADER.size + (16 << 20):
            self._corrupt(key, f"{size} bytes")
            return None
        buf = bytearray(size - HEADER.size)
        return bytes(buf) if self._read(key, [buf], len(buf)) is Outcome.OK else None

    def set(self, key: str, data: bytes) -> Outcome:
        return self._write(key, [data], len(data), crc32c.crc32c(data), replace=True)

    def remove(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._forget(key)
            self._unlink(check_key(key) + SUFFIX)

    def reset(self) -> int:
        """Delete every stagecache object in the directory (all stages', the manifests)."""
        n = 0
        with os.scandir(self.root) as it:
            names = [e.name for e in it]
        for name in names:
            if (name.startswith(SCHEME + ".") and name.endswith(SUFFIX)) or name.startswith(".tmp-"):
                self._unlink(name)
                n += 1
        self._index.clear()
        self.stats.used_bytes = 0
        return n
