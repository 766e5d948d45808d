"""The embedded file store: private directory, a log of checked records, a bound that keeps what is
used, every byte checked on every read, torn writes never read back."""

from __future__ import annotations

import os

import pytest
import torch
from stagecache.runtime.storage.base import Outcome, StoreUnavailable
from stagecache.runtime.storage.file import HEADER, SUFFIX, FileStore
from stagecache.runtime.storage.segments import (
    HEAD_MAX,
    RECORD,
    SEGMENT_SUFFIX,
    head_bytes,
    parse_head,
    record_bound,
)

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
    with pytest.raises(StoreUnavailable, match=r"lets other users in \(mode 0755\)"):
        FileStore(d)


def test_a_symlinked_directory_is_refused(tmp_path):
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(StoreUnavailable, match="is a symlink"):
        FileStore(tmp_path / "link")


def _segments(root) -> list:
    return sorted(root.glob("*" + SEGMENT_SUFFIX))


def test_a_small_object_name_that_is_a_symlink_is_not_followed(tmp_path):
    store = FileStore(tmp_path / "l3")
    target = tmp_path / "secret"
    target.write_bytes(b"x" * (HEADER.size + 16))
    os.symlink(target, tmp_path / "l3" / ("sc1.manifest" + SUFFIX))
    with pytest.raises(StoreUnavailable, match="cannot open sc1.manifest"):  # O_NOFOLLOW: ELOOP
        store.get("sc1.manifest")


def test_a_segment_that_is_a_symlink_is_not_followed(tmp_path):
    store = FileStore(tmp_path / "l3")
    store.batch_set_from([key(1)], [[page(1)]])
    store.close()
    (seg,) = _segments(tmp_path / "l3")
    os.rename(seg, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", seg)
    again = FileStore(tmp_path / "l3")
    assert again.batch_get_into([key(1)], [[page(0)]]) == [Outcome.MISSING]


@pytest.mark.parametrize("damage", ["payload", "truncate", "magic", "key", "length"])
def test_a_damaged_object_is_a_miss_and_an_error_never_data(tmp_path, damage):
    store = FileStore(tmp_path / "l3")
    assert store.batch_set_from([key(1), key(2)], [[page(7)], [page(8)]]) == [Outcome.OK] * 2
    (seg,) = _segments(tmp_path / "l3")
    data = bytearray(seg.read_bytes())
    (_, first), _ = scan_bytes(data)
    if damage == "payload":
        data[first.head + 500] ^= 0x01
    elif damage == "truncate":
        data = data[:-1]
    elif damage == "magic":
        data[0] ^= 0xFF
    elif damage == "key":
        data[RECORD.size + 3] ^= 0x01
    else:
        data[12] ^= 0x01  # the key's length
    seg.write_bytes(bytes(data))
    dst = torch.zeros(1024, dtype=torch.uint8)
    bad = key(2) if damage == "truncate" else key(1)
    assert store.batch_get_into([bad], [[dst]]) == [Outcome.CORRUPT]
    assert store.stats.errors["corrupt"] == 1 and store.stats.reads == 0
    assert store.batch_exists([bad]) == 0  # dropped: the next backup writes it anew
    assert FileStore(tmp_path / "l3").batch_exists([bad]) == 0  # and a restart does not adopt it
    assert store.batch_set_from([bad], [[page(9)]]) == [Outcome.OK]
    assert store.batch_get_into([bad], [[dst]]) == [Outcome.OK] and bool((dst == 9).all())


def scan_bytes(data: bytearray) -> list:
    """The records of a segment's bytes: (offset, head)."""
    out, off = [], 0
    while off < len(data):
        h = parse_head(bytes(data[off:off + HEAD_MAX]))
        if h is None:
            break
        out.append((off, h))
        off += h.size
    return out


def test_a_change_of_any_byte_of_a_record_is_caught(tmp_path):
    src = torch.arange(64, dtype=torch.uint8)
    n = 0
    for i in range(10_000):
        root = tmp_path / f"l3-{i}"
        store = FileStore(root)
        store.batch_set_from([key(1)], [[src]])
        (seg,) = _segments(root)
        good = seg.read_bytes()  # exactly one record: head (struct, key, padding) and payload
        if i >= len(good):
            break
        bad = bytearray(good)
        bad[i] ^= 0x01
        seg.write_bytes(bytes(bad))
        dst = torch.zeros(64, dtype=torch.uint8)
        assert store.batch_get_into([key(1)], [[dst]]) == [Outcome.CORRUPT], i
        n += 1
    assert n == 64 + head_bytes(0, len(key(1)), 64) == len(good)


def test_a_torn_tail_is_not_adopted_and_the_log_goes_on(tmp_path):
    store = FileStore(tmp_path / "l3")
    store.batch_set_from([key(1), key(2)], [[page(1)], [page(2)]])
    store.close()
    (seg,) = _segments(tmp_path / "l3")
    os.truncate(seg, seg.stat().st_size - 100)  # a writer that died inside the second record
    again = FileStore(tmp_path / "l3")
    dst = torch.zeros(2, 1024, dtype=torch.uint8)
    assert again.batch_get_into([key(1), key(2)], [[d] for d in dst]) == [Outcome.OK, Outcome.MISSING]
    assert again.batch_set_from([key(2)], [[page(2)]]) == [Outcome.OK]
    assert len(_segments(tmp_path / "l3")) == 2  # a new segment: the torn one is never appended to
    assert FileStore(tmp_path / "l3").batch_get_into([key(2)], [[dst[1]]]) == [Outcome.OK]
    assert bool((dst[1] == 2).all())


def test_a_removed_object_stays_removed_after_a_restart(tmp_path):
    store = FileStore(tmp_path / "l3")
    store.batch_set_from([key(1), key(2)], [[page(1)], [page(2)]])
    store.remove([key(1)])
    assert [store.exists(key(1)), store.exists(key(2))] == [False, True]
    again = FileStore(tmp_path / "l3")
    assert [again.exists(key(1)), again.exists(key(2))] == [False, True]


def one_record(payload: int = 1024) -> int:
    return record_bound(payload, len(key(0)))


def test_size_bound_evicts_least_recently_used(tmp_path):
    one = one_record()
    store = FileStore(tmp_path / "l3", capacity_bytes=3 * one, owner=OWNER)
    store.batch_set_from([key(i) for i in range(3)], [[page(i)] for i in range(3)])
    store.batch_get_into([key(0)], [[torch.zeros(1024, dtype=torch.uint8)]])  # 0 is used again
    store.batch_set_from([key(3)], [[page(3)]])
    assert [store.exists(key(i)) for i in range(4)] == [True, False, True, True]
    assert store.stats.evictions == 1 and store.stats.used_bytes == 3 * one
    dst = torch.zeros(1024, dtype=torch.uint8)
    assert store.batch_get_into([key(0)], [[dst]]) == [Outcome.OK] and bool((dst == 0).all())


def test_the_bound_holds_and_used_objects_outlive_unused_ones(tmp_path):
    one = one_record()
    cap = 64 * one  # segments of 4 records: eviction empties 4 at a time
    store = FileStore(tmp_path / "l3", capacity_bytes=cap, owner=OWNER)
    hot = [key(i) for i in range(8)]
    store.batch_set_from(hot, [[page(i)] for i in range(8)])
    dst = torch.zeros(1024, dtype=torch.uint8)
    for i in range(8, 400):
        assert store.batch_set_from([key(i)], [[page(i % 256)]]) == [Outcome.OK]
        assert store.stats.used_bytes <= cap
        if i % 16 == 0:  # the hot keys are used between writes
            assert store.batch_get_into(hot, [[dst] for _ in hot]) == [Outcome.OK] * 8
    assert store.batch_exists(hot) == 8 and not store.exists(key(100))
    assert store.stats.evictions > 300
    assert len(_segments(tmp_path / "l3")) <= 64 // 4 + 1


def test_an_object_larger_than_the_bound_is_refused_and_counted(tmp_path):
    store = FileStore(tmp_path / "l3", capacity_bytes=100, owner=OWNER)
    assert store.batch_set_from([key(1)], [[page(1)]]) == [Outcome.NO_SPACE]
    assert store.stats.errors["no_space"] == 1


def test_reopening_keeps_objects_and_their_age_order(tmp_path):
    one = one_record()
    store = FileStore(tmp_path / "l3", capacity_bytes=3 * one, owner=OWNER)
    for i in range(3):
        store.batch_set_from([key(i)], [[page(i)]])
    store.close()
    again = FileStore(tmp_path / "l3", capacity_bytes=3 * one, owner=OWNER)
    assert again.stats.used_bytes == 3 * one
    again.batch_set_from([key(9)], [[page(9)]])
    assert not again.exists(key(0)) and again.exists(key(1))  # the oldest went first


def test_stages_sharing_a_directory_keep_their_own_segments(tmp_path):
    other = "sc1.0123456789abcdef.t0.p1.L2-4"
    a = FileStore(tmp_path / "l3", capacity_bytes=3 * one_record(), owner=OWNER)
    b = FileStore(tmp_path / "l3", capacity_bytes=3 * one_record(), owner=other)
    a.batch_set_from([key(i) for i in range(3)], [[page(i)] for i in range(3)])
    b.batch_set_from([f"{other}.swa.{i:016x}" for i in range(5)], [[page(i)] for i in range(5)])
    assert a.batch_exists([key(i) for i in range(3)]) == 3  # b's evictions never touch a's objects
    assert FileStore(tmp_path / "l3", owner=OWNER).batch_exists([key(i) for i in range(3)]) == 3
    assert not FileStore(tmp_path / "l3", owner=other).exists(key(0))


def test_leftover_temporary_files_are_removed_and_writes_are_whole(tmp_path):
    (tmp_path / "l3").mkdir(mode=0o700)
    (tmp_path / "l3" / ".tmp-deadbeef").write_bytes(b"half")
    os.utime(tmp_path / "l3" / ".tmp-deadbeef", (1, 1))  # a dead writer's
    (tmp_path / "l3" / ".tmp-inflight").write_bytes(b"now")  # another process writing right now
    store = FileStore(tmp_path / "l3")
    assert not (tmp_path / "l3" / ".tmp-deadbeef").exists()
    (tmp_path / "l3" / ".tmp-inflight").unlink()  # kept: it was young
    store.batch_set_from([key(1)], [[page(1)]])
    store.set("sc1.manifest", b"{}")
    names = sorted(p.name for p in (tmp_path / "l3").iterdir())
    assert len(names) == 2 and names[0] == "sc1.manifest" + SUFFIX and names[1].endswith(SEGMENT_SUFFIX)
    assert all(os.stat(tmp_path / "l3" / n).st_mode & 0o777 == 0o600 for n in names)


def test_reset_removes_every_stagecache_object_only(tmp_path):
    store = FileStore(tmp_path / "l3")
    store.batch_set_from([key(1)], [[page(1)]])
    store.set("sc1.manifest", b"{}")
    (tmp_path / "l3" / "notes.txt").write_text("mine")
    assert store.reset() == 2
    assert [p.name for p in (tmp_path / "l3").iterdir()] == ["notes.txt"]


def test_large_objects_read_into_the_same_buffer_are_each_checked(tmp_path):
    """Checksums run beside the reads; two keys read into one buffer must not fail each other."""
    store = FileStore(tmp_path / "l3")
    big = torch.stack([torch.full((1 << 20,), i, dtype=torch.uint8) for i in range(4)])
    keys = [key(i) for i in range(4)]
    assert store.batch_set_from(keys, [[p] for p in big]) == [Outcome.OK] * 4
    dst = torch.zeros(1 << 20, dtype=torch.uint8)
    assert store.batch_get_into(keys, [[dst]] * 4) == [Outcome.OK] * 4
    assert bool((dst == 3).all())
    out = torch.zeros_like(big)
    assert store.batch_get_into(keys, [[p[:1000], p[1000:]] for p in out]) == [Outcome.OK] * 4
    assert torch.equal(out, big) and store.stats.error_count == 0
