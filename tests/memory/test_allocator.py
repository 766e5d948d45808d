"""PageAllocator: ids, errors that name the pool, and refused calls that change nothing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from stagecache.runtime.errors import StageCacheError
from stagecache.runtime.memory.allocator import (
    AllocatorError,
    DoubleFreeError,
    ForeignPageError,
    OutOfPagesError,
    PageAllocator,
)


def allocated(a: PageAllocator, page: int) -> bool:
    """Whether ``page`` is in use, as the transfer checks see it (the allocator's in-use map)."""
    return bool(a.unallocated(np.array([page], dtype=np.int64)).size == 0)


def state(a: PageAllocator):
    return a.num_free, a.num_used, [allocated(a, i) for i in range(a.num_pages)]


def test_fresh_allocator_hands_out_lowest_ids_and_counts():
    a = PageAllocator(8, "stage 1 device")
    assert a.alloc(3) == [0, 1, 2]
    assert (a.num_free, a.num_used) == (5, 3)
    assert allocated(a, 1) and not allocated(a, 3)
    a.free([1])
    assert not allocated(a, 1) and a.num_free == 6
    assert a.alloc(0) == []


def test_out_of_pages_names_pool_asked_and_free_and_changes_nothing():
    a = PageAllocator(4, "stage 2 host")
    a.alloc(3)
    before = state(a)
    with pytest.raises(OutOfPagesError) as exc:
        a.alloc(2)
    msg = str(exc.value)
    assert "stage 2 host" in msg and "asked for 2" in msg and "1 of 4 free" in msg
    assert isinstance(exc.value, StageCacheError)
    assert state(a) == before


def test_double_free_is_refused_and_atomic():
    a = PageAllocator(6, "stage 0 device")
    ids = a.alloc(4)
    a.free([ids[0]])
    before = state(a)
    with pytest.raises(DoubleFreeError, match=r"stage 0 device: page 0 is not allocated"):
        a.free([ids[1], ids[0]])  # ids[1] valid, ids[0] already free: nothing may be freed
    assert state(a) == before
    with pytest.raises(DoubleFreeError, match="listed twice"):
        a.free([ids[2], ids[2]])
    assert state(a) == before


@pytest.mark.parametrize("bad", [-1, 6, 100, "3", 2.0, True, None])
def test_foreign_ids_are_refused_and_atomic(bad):
    a = PageAllocator(6, "stage 3 device")
    ids = a.alloc(2)
    before = state(a)
    with pytest.raises(ForeignPageError, match="stage 3 device"):
        a.free([ids[0], bad])
    assert state(a) == before
    assert isinstance(ForeignPageError("x"), StageCacheError)


@pytest.mark.parametrize("bad", [0, -3, 1.5, True])
def test_bad_sizes_and_counts(bad):
    with pytest.raises(AllocatorError):
        PageAllocator(bad, "p")
    a = PageAllocator(2, "p")
    if bad != 0:
        with pytest.raises(AllocatorError):
            a.alloc(bad if bad != -3 else -1)


def test_accepts_tensor_ids():
    torch = pytest.importorskip("torch")
    a = PageAllocator(4, "p")
    ids = a.alloc(3)
    a.free(torch.tensor(ids[:2]))
    assert a.num_used == 1 and allocated(a, 2)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 12)), max_size=40))
def test_random_ops_match_a_set_model(ops):
    """Whatever happens, the allocator agrees with a plain set of used ids."""
    a = PageAllocator(10, "model")
    used: set[int] = set()
    for is_alloc, k in ops:
        if is_alloc:
            if k > 10 - len(used):
                with pytest.raises(OutOfPagesError):
                    a.alloc(k)
            else:
                got = a.alloc(k)
                assert len(set(got)) == k and not used & set(got)
                used |= set(got)
        else:
            victims = sorted(used)[:k]
            if k > len(used):
                victims = victims + [10 + k]  # foreign id: whole call refused
                with pytest.raises(ForeignPageError):
                    a.free(victims)
            else:
                a.free(victims)
                used -= set(victims)
        assert a.num_used == len(used)
        assert {i for i in range(10) if allocated(a, i)} == used
