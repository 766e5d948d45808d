"""The embedded file store: private directory, atomic writes, LRU bound, checksum on every read."""

from __future__ import annotations

import os

import pytest
import torch
from stagecache.runtime.storage.base import Outcome, StoreUnavailable
from stagecache.runtime.storage.file import HEADER, SUFFIX, FileStore

OWNER = "sc1.0123456789abcdef.t0.p0.L0-2"


def key(i: int) -> str:
    return f"{OWNER}.swa.{i:016x}"


def page(i: int, n: int = 1024) -> torch.Tensor:
    return torch.full((n,), i, dtype=torch.uint8)


def test_directory_is_created_private(tmp_path):
    FileStore(tmp_path / "a" / "b")
    assert os.stat(tmp_path / "a" / "b").st_mode & 0o777 == 0o700


def test_a_directory_others_can_enter_is_refused(tmp_path):
    d = tmp_path / "open"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    with pytest.raises(StoreUnavailable, match="mode 0755 lets other users in"):
        FileStore(d)


def test_a_symlinked_directory_is_refused(tmp_path):
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(StoreUnavailable, match="a symlink is refused"):
        FileStore(tmp_path / "link")


def test_an_object_name_that_is_a_symlink_is_not_followed(tmp_path):
    store = FileStore(tmp_path / "l3")
    target = tmp_path / "secret"
    target.write_bytes(b"x" * (HEADER.size + 16))
    os.symlink(target, tmp_path / "l3" / (key(1) + SUFFIX))
    out = store.batch_get_into([key(1)], [[torch.zeros(16, dtype=torch.uint8)]])
    assert out == [Outcome.FAILED]  # O_NOFOLLOW: ELOOP, counted, no data
    assert store.stats.errors["failed"] == 1


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend", "header"])
def test_a_damaged_object_is_a_miss_and_an_error_never_data(tmp_path, damage):
    store = FileStore(tmp_path / "l3")
    assert store.batch_set_from([key(1)], [[page(7)]]) == [Outcome.OK]
    path = tmp_path / "l3" / (key(1) + SUFFIX)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[500] ^= 0x01
    elif damage == "truncate":
        data = data[:-1]
    elif damage == "extend":
        data += b"\0"
    else:
        data[-HEADER.size] ^= 0xFF
    path.write_bytes(bytes(data))
    dst = torch.zeros(1024, dtype=torch.uint8)
    assert store.batch_get_into([key(1)], [[dst]]) == [Outcome.CORRUPT]
    assert store.stats.errors["corrupt"] == 1 and store.stats.reads == 0
    assert not path.exists()  # dropped: the next backup writes it anew
    assert store.batch_exists([key(1)]) == 0


def test_a_change_of_any_byte_of_the_file_is_caught(tmp_path):
    store = FileStore(tmp_path / "l3")
    src = torch.arange(64, dtype=torch.uint8)
    store.batch_set_from([key(1)], [[src]])
    path = tmp_path / "l3" / (key(1) + SUFFIX)
    good = path.read_bytes()
    assert len(good) == 64 + HEADER.size
    for i in range(len(good)):  # payload and trailer alike
        store.batch_set_from([key(1)], [[src]])
        bad = bytearray(good)
        bad[i] ^= 0x01
        path.write_bytes(bytes(bad))
        dst = torch.zeros(64, dtype=torch.uint8)
        assert store.batch_get_into([key(1)], [[dst]]) == [Outcome.CORRUPT], i
    assert store.stats.errors["corrupt"] == len(good) and store.stats.reads == 0


def test_size_bound_evicts_least_recently_used(tmp_path):
    one = HEADER.size + 1024
    store = FileStore(tmp_path / "l3", capacity_bytes=3 * one, owner=OWNER)
    store.batch_set_from([key(i) for i in range(3)], [[page(i)] for i in range(3)])
    store.batch_get_into([key(0)], [[torch.zeros(1024, dtype=torch.uint8)]])  # 0 is used again
    store.batch_set_from([key(3)], [[page(3)]])
    assert [store.exists(key(i)) for i in range(4)] == [True, False, True, True]
    assert store.stats.evictions == 1 and store.stats.used_bytes == 3 * one


def test_an_object_larger_than_the_bound_is_refused_and_counted(tmp_path):
    store = FileStore(tmp_path / "l3", capacity_bytes=100, owner=OWNER)
    assert store.batch_set_from([key(1)], [[page(1)]]) == [Outcome.NO_SPACE]
    assert store.stats.errors["no_space"] == 1


def test_reopening_keeps_objects_and_their_lru_order(tmp_path):
    one = HEADER.size + 1024
    store = FileStore(tmp_path / "l3", capacity_bytes=3 * one, owner=OWNER)
    for i in range(3):
        store.batch_set_from([key(i)], [[page(i)]])
        os.utime(tmp_path / "l3" / (key(i) + SUFFIX), ns=(i * 10**9, i * 10**9))
    again = FileStore(tmp_path / "l3", capacity_bytes=3 * one, owner=OWNER)
    assert again.stats.used_bytes == 3 * one
    again.batch_set_from([key(9)], [[page(9)]])
    assert not again.exists(key(0)) and again.exists(key(1))  # the oldest went first


def test_leftover_temporary_files_are_removed_and_writes_are_whole(tmp_path):
    (tmp_path / "l3").mkdir(mode=0o700)
    (tmp_path / "l3" / ".tmp-deadbeef").write_bytes(b"half")
    os.utime(tmp_path / "l3" / ".tmp-deadbeef", (1, 1))  # a dead writer's
    (tmp_path / "l3" / ".tmp-inflight").write_bytes(b"now")  # another process writing right now
    store = FileStore(tmp_path / "l3")
    assert not (tmp_path / "l3" / ".tmp-deadbeef").exists()
    (tmp_path / "l3" / ".tmp-inflight").unlink()  # kept: it was young
    store.batch_set_from([key(1)], [[page(1)]])
    assert [p.name for p in (tmp_path / "l3").iterdir()] == [key(1) + SUFFIX]
    assert os.stat(tmp_path / "l3" / (key(1) + SUFFIX)).st_mode & 0o777 == 0o600


def test_reset_removes_every_stagecache_object_only(tmp_path):
    store = FileStore(tmp_path / "l3")
    store.batch_set_from([key(1)], [[page(1)]])
    store.set("sc1.manifest", b"{}")
    (tmp_path / "l3" / "notes.txt").write_text("mine")
    assert store.reset() == 2
    assert [p.name for p in (tmp_path / "l3").iterdir()] == ["notes.txt"]
