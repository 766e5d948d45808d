"""The transfer boundary's page-id check: the one-pass C check (transfer/native.py) and the numpy
checks give the same answer -- accepted, or refused with the same message -- on every input."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stagecache.runtime.memory.allocator import PageAllocator
from stagecache.runtime.transfer import native, pages
from stagecache.runtime.transfer.pages import PageChecker, TransferError

DEV_PAGES, HOST_PAGES = 40, 70
needs_cc = pytest.mark.skipif(native.ids_ok_function() is None,
                              reason="no C compiler here: the numpy checks are the only ones")


def _allocators(free_dev: list[int], free_host: list[int]) -> tuple[PageAllocator, PageAllocator]:
    dev, host = PageAllocator(DEV_PAGES, "stage 0 device"), PageAllocator(HOST_PAGES, "stage 0 host")
    dev.alloc(DEV_PAGES)
    host.alloc(HOST_PAGES)
    dev.free(sorted(set(free_dev)))
    host.free(sorted(set(free_host)))
    return dev, host


def _numpy_checker(monkeypatch, dev: PageAllocator, host: PageAllocator) -> PageChecker:
    with monkeypatch.context() as m:
        m.setattr(native, "ids_ok_function", lambda: None)
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


def test_no_compiler_or_switched_off_means_numpy(monkeypatch):
    monkeypatch.setattr(native, "_LOADED", [])
    monkeypatch.setenv("STAGECACHE_NATIVE", "0")
    assert native.ids_ok_function() is None
    monkeypatch.setattr(native, "_LOADED", [])
    monkeypatch.delenv("STAGECACHE_NATIVE")
    monkeypatch.setenv("XDG_CACHE_HOME", "/nonexistent/cache")
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    monkeypatch.delenv("CC", raising=False)
    assert native.ids_ok_function() is None
    dev, host = _allocators([], [])
    checker = PageChecker(0, dev, host)
    assert checker._native is None and checker.check([0], [1], "host").count == 1
    with pytest.raises(TransferError, match="destination host page"):
        checker.check(list(range(pages.SMALL + 1)), [0] * (pages.SMALL + 1), "host")


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_the_check_is_built_into_a_fresh_cache(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_LOADED", [])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("STAGECACHE_NATIVE", raising=False)
    assert native.ids_ok_function() is not None
    built = list((tmp_path / "stagecache").glob("ids-*.so"))
    assert len(built) == 1 and built[0].stat().st_size > 0


def test_checks_from_several_threads_keep_their_answers():
    """Transfers on the CPU engines may be called from several threads; the checks share their
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


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_a_cache_others_can_write_is_not_loaded_from(monkeypatch, tmp_path):
    """A library file planted where other users can write is never loaded: the check is built
    into a private directory instead (and works)."""
    monkeypatch.setattr(native, "_LOADED", [])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("STAGECACHE_NATIVE", raising=False)
    shared = tmp_path / "stagecache"
    shared.mkdir()
    shared.chmod(0o777)
    name = f"ids-{native.hashlib.sha256(native.SOURCE.encode()).hexdigest()[:16]}.so"
    (shared / name).write_bytes(b"not a library")
    lib = native._library()
    assert lib is not None and str(shared) not in lib._name
    assert (shared / name).read_bytes() == b"not a library"  # left alone, never loaded
    dev, host = _allocators([], [])
    assert PageChecker(0, dev, host).check([0, 1], [2, 3], "host").count == 2



@needs_cc
@pytest.mark.parametrize(("fail_at", "calls"), [
    (None, [("record", 11, 9), ("launch", 12, 9), ("record", 13, 9)]),
    ("launch", [("record", 11, 9), ("launch", 12, 9)]),  # no end event after a failed launch
])
def test_the_compiled_launch_makes_the_runtime_calls_in_order(fail_at, calls):
    """``stagecache_launch`` through stand-ins for cudaEventRecord and cudaGraphLaunch: start
    event, graph, end event on the caller's stream, and nothing after the first error."""
    import ctypes

    seen: list[tuple[str, int, int]] = []
    proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)

    def stand_in(name: str):
        def call(handle, stream):
            seen.append((name, handle, stream))
            return 700 if name == fail_at else 0
        return proto(call)

    record, launch = stand_in("record"), stand_in("launch")
    fns = np.array([ctypes.cast(record, ctypes.c_void_p).value, ctypes.cast(launch, ctypes.c_void_p).value],
                   dtype=np.int64)
    err = native.launch_function()(int(fns.ctypes.data), 9, 11, 12, 13)
    assert err == (700 if fail_at else 0) and seen == calls
