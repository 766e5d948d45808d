"""The transfer boundary's one page-id check: its compiled pass (transfer/native.py, built at
install) and its numpy reference give the same answer -- accepted, or refused with the same
message -- on every input; and the compiled one-call move (check, ring entry, graph launch) driven
through stand-in runtime calls."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stagecache.runtime.memory.allocator import PageAllocator
from stagecache.runtime.transfer import native
from stagecache.runtime.transfer.pages import PageChecker, TransferError

DEV_PAGES, HOST_PAGES = 40, 70
needs_cc = pytest.mark.skipif(native.module() is None,
                              reason="the compiled helper was not built at install (no C compiler or headers)")


def _allocators(free_dev: list[int], free_host: list[int]) -> tuple[PageAllocator, PageAllocator]:
    dev, host = PageAllocator(DEV_PAGES, "stage 0 device"), PageAllocator(HOST_PAGES, "stage 0 host")
    dev.alloc(DEV_PAGES)
    host.alloc(HOST_PAGES)
    dev.free(sorted(set(free_dev)))
    host.free(sorted(set(free_host)))
    return dev, host


def _numpy_checker(monkeypatch, dev: PageAllocator, host: PageAllocator) -> PageChecker:
    with monkeypatch.context() as m:
        m.setattr(native, "module", lambda: None)
        checker = PageChecker(0, dev, host)
    assert checker._native is None
    return checker


def _outcome(checker: PageChecker, d: object, h: object, dest: str) -> tuple[str, object]:
    try:
        ids = checker.check(d, h, dest)
    except TransferError as exc:
        return "refused", str(exc)
    return "ok", (ids.device.tolist(), ids.host.tolist())


_ids = st.lists(st.integers(-3, HOST_PAGES + 3), max_size=80)


@needs_cc
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_native_and_numpy_checks_agree(monkeypatch, data):
    """Random ids around both ranges (negative, past the end), freed pages, repeats on either
    side, both directions, lists and tensors; one checker of each kind for many calls, so the
    C check's generation marks are reused across calls."""
    free_dev = data.draw(st.lists(st.integers(0, DEV_PAGES - 1), max_size=4))
    free_host = data.draw(st.lists(st.integers(0, HOST_PAGES - 1), max_size=4))
    dev, host = _allocators(free_dev, free_host)
    fast, slow = PageChecker(0, dev, host), _numpy_checker(monkeypatch, dev, host)
    assert fast._native is not None
    for _ in range(5):
        n = data.draw(st.integers(0, 60))
        valid = data.draw(st.booleans())
        if valid:  # mostly-good moves: distinct allocated ids, so acceptance is exercised
            d = data.draw(st.lists(st.integers(0, DEV_PAGES - 1), min_size=n, max_size=n))
            h = data.draw(st.lists(st.integers(0, HOST_PAGES - 1), min_size=n, max_size=n, unique=True))
        else:
            d, h = data.draw(_ids), data.draw(_ids)
        dest = data.draw(st.sampled_from(["host", "device"]))
        as_tensor = data.draw(st.booleans())
        args = (torch.tensor(d, dtype=torch.int64), torch.tensor(h, dtype=torch.int64)) if as_tensor else (d, h)
        assert _outcome(fast, *args, dest) == _outcome(slow, *args, dest), (d, h, dest)


@needs_cc
def test_native_check_refuses_each_fault_and_accepts_repeats_across_calls():
    dev, host = _allocators([5], [9])
    checker = PageChecker(0, dev, host)
    assert checker._native is not None
    for _ in range(3):  # the same good ids, call after call: never mistaken for repeats
        assert checker.check([0, 1, 2], [3, 4, 6], "host").count == 3
    assert checker.check([1, 1], [3, 4], "host").count == 2  # a repeated *source* is fine
    for d, h, dest, msg in [([0], [HOST_PAGES], "host", "out of range"),
                            ([-1], [0], "host", "out of range"),
                            ([5], [0], "host", r"device page\(s\) \[5\] are not allocated"),
                            ([0], [9], "device", r"host page\(s\) \[9\] are not allocated"),
                            ([0, 1], [4, 4], "host", "destination host page"),
                            ([2, 2], [3, 4], "device", "destination device page")]:
        with pytest.raises(TransferError, match=msg):
            checker.check(d, h, dest)
    strided = np.arange(12, dtype=np.int64)[::3]  # a non-contiguous view is copied, not misread
    assert checker.check(strided, strided + 1, "host").device.tolist() == [0, 3, 6, 9]


def test_switched_off_or_not_built_means_numpy_and_one_log_line(monkeypatch, caplog):
    """No compiler ever runs: the helper is the one built at install, or there is none -- then one
    warning says so, and the numpy reference check does the work."""
    import builtins

    monkeypatch.setattr(native, "_LOADED", [])
    monkeypatch.setenv("STAGECACHE_NATIVE", "0")
    assert native.module() is None
    monkeypatch.setattr(native, "_LOADED", [])
    monkeypatch.delenv("STAGECACHE_NATIVE")
    real_import = builtins.__import__

    def no_helper(name, globals=None, locals=None, fromlist=(), level=0):
        if fromlist and "_native" in fromlist:
            raise ImportError("no module named '_native'")
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", no_helper)
    with caplog.at_level("WARNING", logger="stagecache.runtime.transfer.native"):
        assert native.module() is None
        assert native.module() is None  # asked again: the answer is kept, no second line
    monkeypatch.setattr(builtins, "__import__", real_import)
    warnings = [r for r in caplog.records if "compiled transfer helper is not installed" in r.getMessage()]
    assert len(warnings) == 1
    dev, host = _allocators([], [])
    checker = PageChecker(0, dev, host)
    assert checker._native is None and checker.check([0], [1], "host").count == 1
    with pytest.raises(TransferError, match="destination host page"):
        checker.check(list(range(40)), [0] * 40, "host")


@needs_cc
def test_the_helper_is_the_installed_extension_and_nothing_is_compiled_at_run_time(monkeypatch):
    """The module comes from the package (built by the build backend), never from a cache dir."""
    import subprocess

    def refuse(*a, **k):
        raise AssertionError("a compiler was started at run time")

    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(native, "_LOADED", [])
    mod = native.module()
    assert mod is not None and mod.__name__ == "stagecache.runtime.transfer._native"


def test_checks_from_several_threads_keep_their_answers():
    """Transfers on the CPU mover may be called from several threads; the checks share their
    scratch arrays, so each call's answer must still be its own (good moves pass, repeats fail)."""
    import threading

    dev, host = _allocators([], [])
    checker = PageChecker(0, dev, host)
    wrong: list[str] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for i in range(400):
            n = int(rng.integers(1, 40))
            h = rng.choice(HOST_PAGES, n, replace=False)
            d = rng.choice(DEV_PAGES, n)
            bad = i % 3 == 0 and n > 1
            if bad:
                h[-1] = h[0]
            try:
                checker.check(d, h, "host")
                if bad:
                    wrong.append(f"accepted a repeat: {h.tolist()}")
            except TransferError as exc:
                if not bad:
                    wrong.append(f"refused a good move: {exc}")

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong, wrong[:3]


class _Runtime:
    """Stand-ins for cudaEventQuery and cudaGraphLaunch, called from C through their addresses."""

    def __init__(self):
        import ctypes

        self.launched: list[tuple[int, int]] = []
        self.queried: list[int] = []
        self.query_rc, self.launch_rc = 0, 0
        q = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
        launch = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
        self._query = q(lambda event: self.queried.append(event) or self.query_rc)
        self._launch = launch(lambda exec_, stream: self._launched(exec_, stream))
        self.addresses = [ctypes.cast(f, ctypes.c_void_p).value for f in (self._query, self._launch)]

    def _launched(self, exec_, stream) -> int:
        if not self.launch_rc:
            self.launched.append((exec_, stream))
        return self.launch_rc


def _ring(checker: PageChecker, rt: _Runtime, entries: int, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """The ring's words as the device mover sets them, over numpy rows instead of pinned memory."""
    from stagecache.runtime.transfer.ring import MIN_BUCKET, bucket_sizes

    w = checker.context.words
    rows = np.zeros((entries, 1 + 2 * cap), dtype=np.int64)
    w[[native.ENTRIES, native.CAP, native.NEXT, native.ROWS, native.ROW_WORDS]] = (
        entries, cap, 0, rows.ctypes.data, 1 + 2 * cap)
    w[[native.QUERY, native.LAUNCH]] = rt.addresses
    w[native.BUCKETS], w[native.MIN_BUCKET] = len(bucket_sizes(cap)), MIN_BUCKET
    for k in range(entries):
        w[native.RING + native.PER_ENTRY * k + native.END] = 1001 + k
    return w, rows


def _entry_word(k: int, field: int) -> int:
    return native.RING + native.PER_ENTRY * k + field


@needs_cc
def test_the_compiled_move_takes_ring_entries_in_turn_and_says_what_is_missing():
    """The one-call move: graph missing -> its entry, bucket index and size; launched -> ids in the
    entry's row, the entry owned and guarded by its end event; an owned entry, a busy one, bad ids,
    a failed launch and moves it does not take each leave the ring as it was."""
    from stagecache.runtime.transfer.ring import bucket, bucket_sizes

    dev_alloc, host_alloc = _allocators([7], [])
    checker, rt = PageChecker(0, dev_alloc, host_alloc), _Runtime()
    w, rows = _ring(checker, rt, entries=2, cap=40)
    execs = np.zeros(2 * len(bucket_sizes(40)), dtype=np.int64)
    move = native.module().move
    d, h = np.array([3, 1, 2], dtype=np.int64), np.array([9, 8, 10], dtype=np.int64)

    assert move(w, d, h, False, execs, 77) == native.NEED_GRAPH
    assert (w[native.WANT_ENTRY], w[native.WANT_INDEX], w[native.WANT_SIZE], w[native.NEXT]) == (0, 0, 16, 0)
    execs[0] = 5001
    assert move(w, d, h, False, execs, 77) == 0 and rt.launched == [(5001, 77)]
    assert rows[0, :7].tolist() == [3, 3, 1, 2, 9, 8, 10]
    assert (w[_entry_word(0, native.OWNED)], w[_entry_word(0, native.MARK)], w[native.NEXT]) == (1, 1001, 1)

    big_d, big_h = np.arange(20, dtype=np.int64) + 10, np.arange(20, dtype=np.int64) + 30
    assert move(w, big_d, big_h, True, execs, 78) == native.NEED_GRAPH
    assert (w[native.WANT_ENTRY], w[native.WANT_INDEX], w[native.WANT_SIZE]) == (1, 1, 32)
    execs[1 * 3 + 1] = 5002
    assert move(w, big_d, big_h, True, execs, 78) == 1 and rt.launched[-1] == (5002, 78)
    assert rows[1, 0] == 20 and rows[1, 1:21].tolist() == big_d.tolist() and w[native.NEXT] == 0

    assert move(w, d, h, False, execs, 77) == native.OWNED_ENTRY and w[native.WANT_ENTRY] == 0
    w[_entry_word(0, native.OWNED)] = 0  # the owner finished; its end event still guards the entry
    rt.query_rc = 600
    assert move(w, d, h, False, execs, 77) == native.BUSY and rt.queried == [1001]
    rt.query_rc = 0
    for bad_d, bad_h in (([7], [1]), ([0], [HOST_PAGES]), ([0, 1], [4, 4]), ([-1], [0])):
        assert move(w, np.array(bad_d), np.array(bad_h), False, execs, 77) == native.IDS_BAD
    assert move(w, np.array([1, 1]), np.array([4, 5]), False, execs, 77) == 0  # repeated source: fine
    assert w[native.NEXT] == 1 and len(rt.launched) == 3

    w[_entry_word(1, native.OWNED)] = w[_entry_word(1, native.MARK)] = 0
    rt.launch_rc = 700
    assert move(w, d, h, False, execs, 77) == native.NEED_GRAPH  # entry 1 has no 16-page graph yet
    execs[1 * 3] = 5003
    assert move(w, d, h, False, execs, 77) == native.CUDA_ERROR and w[native.ERR] == 700
    assert w[native.NEXT] == 1 and w[_entry_word(1, native.OWNED)] == 0
    rt.launch_rc = 0
    for args in ((np.arange(41), np.arange(41)), (np.array([1], dtype=np.int32), np.array([2])),
                 (np.array([1, 2]), np.array([3])), (np.array([], dtype=np.int64), np.array([], dtype=np.int64)),
                 ([1], [2]), (np.arange(6)[::2], np.arange(3))):
        assert move(w, *args, False, execs, 77) == native.NOT_HANDLED
    assert len(rt.launched) == 3 and w[native.NEXT] == 1

    allocated = np.delete(np.arange(DEV_PAGES, dtype=np.int64), 7)
    for n in range(1, DEV_PAGES):  # the bucket the C move picks is the device mover's
        w[_entry_word(1, native.MARK)] = w[_entry_word(1, native.OWNED)] = 0
        w[native.NEXT] = 1
        execs[:] = 0
        assert move(w, allocated[:n], allocated[:n], False, execs, 77) == native.NEED_GRAPH
        assert w[native.WANT_SIZE] == bucket(n, 40) == bucket_sizes(40)[w[native.WANT_INDEX]]


@needs_cc
def test_the_compiled_calls_read_cpu_int64_tensors_in_place_and_nothing_else():
    """Torch ids are read without a numpy view; any tensor that is not a 1-D contiguous int64 CPU
    tensor (strided, int32, 2-D, on another device) is left to the general path, never misread."""
    dev_alloc, host_alloc = _allocators([7], [])
    checker, rt = PageChecker(0, dev_alloc, host_alloc), _Runtime()
    w, rows = _ring(checker, rt, entries=2, cap=40)
    execs = np.full(2 * 3, 5001, dtype=np.int64)
    mod = native.module()
    d, h = torch.tensor([3, 1, 2]), torch.tensor([9, 8, 10])
    assert mod.ids_ok(w, d, h, False) is True and mod.ids_ok(w, torch.tensor([7]), torch.tensor([1]), False) is False
    assert mod.move(w, d, h, True, execs, 5) == 0 and rows[0, :7].tolist() == [3, 3, 1, 2, 9, 8, 10]
    assert mod.move(w, d[1:], h[1:], True, execs, 5) == 1 and rows[1, :5].tolist() == [2, 1, 2, 8, 10]
    w[_entry_word(0, native.OWNED)] = w[_entry_word(0, native.MARK)] = 0
    for bad in (torch.arange(6)[::2], torch.tensor([1, 2, 3], dtype=torch.int32), torch.zeros((3, 1), dtype=torch.int64),
                torch.empty(3, dtype=torch.int64, device="meta")):
        assert mod.move(w, bad, h, True, execs, 5) == native.NOT_HANDLED
        assert mod.ids_ok(w, bad, h, True) is None
    assert len(rt.launched) == 2 and w[native.NEXT] == 0


def test_the_context_layout_is_the_same_in_c_and_python():
    """The word indices and codes are written twice (the C enum, native.py's constants): equal."""
    import re
    from pathlib import Path

    source = (Path(native.__file__).with_name("native.c")).read_text()
    enums = [[name.split("=")[0].strip() for name in body.split(",")]
             for body in re.findall(r"enum \{([^}]*)\};", source)]
    words, per_entry, codes = enums
    assert [getattr(native, n) for n in words] == list(range(len(words)))
    assert [getattr(native, n) for n in per_entry] == list(range(len(per_entry)))
    c_codes = dict(re.findall(r"(\w+) = (-\d+)", source))
    assert {n: int(v) for n, v in c_codes.items()} == {n: getattr(native, n) for n in c_codes} and len(codes) == 6


@needs_cc
@pytest.mark.parametrize("threads", [1, 2, 3, 7])
@pytest.mark.parametrize("pages", [1, 2, 5, 9])
def test_the_compiled_cpu_copy_moves_every_page_of_every_buffer_once(threads, pages):
    """``copy_pages`` against numpy indexing: buffers of different page sizes and strides, the
    (buffer, page) items split over threads by bytes, both directions."""
    rng = np.random.default_rng(threads * 10 + pages)
    sizes = [(24, 24), (40, 64), (8, 8), (1168, 1200), (16, 48)]  # (page bytes, host stride)
    dev = [rng.integers(0, 256, (12, pb), dtype=np.uint8) for pb, _ in sizes]
    host = [np.zeros((20, stride), dtype=np.uint8) for _, stride in sizes]
    table = np.array([v for (pb, _), d, h in zip(sizes, dev, host, strict=True)
                      for v in (pb, d.ctypes.data, h.ctypes.data, d.strides[0], h.strides[0])], dtype=np.int64)
    d_ids = rng.choice(12, pages, replace=False).astype(np.int64)
    h_ids = rng.choice(20, pages, replace=False).astype(np.int64)
    native.module().copy_pages(table, d_ids, h_ids, True, threads)
    for (pb, _), d, h in zip(sizes, dev, host, strict=True):
        assert np.array_equal(h[h_ids, :pb], d[d_ids]) and not h[np.setdiff1d(np.arange(20), h_ids)].any()
        assert not h[:, pb:].any()  # nothing past a page's bytes
    for d in dev:
        d[:] = 0
    native.module().copy_pages(table, torch.from_numpy(d_ids), torch.from_numpy(h_ids), False, threads)
    for (pb, _), d, h in zip(sizes, dev, host, strict=True):
        assert np.array_equal(d[d_ids], h[h_ids, :pb]) and not d[np.setdiff1d(np.arange(12), d_ids)].any()


def _copy_case(seed: int, pages: int = 40) -> tuple[np.ndarray, list, list, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    dev = [rng.integers(0, 256, (64, pb), dtype=np.uint8) for pb in (4096, 1168, 65536)]
    host = [np.zeros((80, d.shape[1]), dtype=np.uint8) for d in dev]
    table = np.array([v for d, h in zip(dev, host, strict=True)
                      for v in (d.shape[1], d.ctypes.data, h.ctypes.data, d.strides[0], h.strides[0])], dtype=np.int64)
    return table, dev, host, rng.choice(64, pages, replace=False).astype(np.int64), \
        rng.choice(80, pages, replace=False).astype(np.int64)


@needs_cc
def test_the_kept_copy_threads_serve_concurrent_callers():
    """Several Python threads copying at once with threads=2 (each its own OpenMP team, or
    threads of its own): every copy lands whole, none waits forever."""
    import threading

    cases = [_copy_case(seed) for seed in range(6)]
    errors = []

    def work(case: tuple) -> None:
        table, dev, host, d_ids, h_ids = case
        for _ in range(30):
            for h in host:
                h[:] = 0
            native.module().copy_pages(table, d_ids, h_ids, True, 2)
            if not all(np.array_equal(h[h_ids], d[d_ids]) for d, h in zip(dev, host, strict=True)):
                errors.append("incomplete copy")

    threads = [threading.Thread(target=work, args=(c,)) for c in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)


@needs_cc
def test_a_forked_child_copies_with_threads_too():
    """OpenMP's threads do not survive a fork (a parallel region in the child would wait for
    them forever): the child copies on threads of its own, whole."""
    import multiprocessing

    table, dev, host, d_ids, h_ids = _copy_case(7)
    native.module().copy_pages(table, d_ids, h_ids, True, 2)  # the parent's OpenMP threads exist now
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_copy, args=(queue,))
    child.start()
    child.join(timeout=60)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive and child.exitcode == 0 and queue.get(timeout=5) is True


def _child_copy(queue) -> None:
    table, dev, host, d_ids, h_ids = _copy_case(8)
    native.module().copy_pages(table, d_ids, h_ids, True, 3)
    queue.put(all(np.array_equal(h[h_ids], d[d_ids]) for d, h in zip(dev, host, strict=True)))
