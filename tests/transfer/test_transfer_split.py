"""Queue wait vs DMA time on CPU: real copies, per pool kind, through StageLive to /metrics."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from plans import pools as make_pools
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from stagecache.exporters.metrics import make_registry
from stagecache.runtime.live.numbers import StageLive
from stagecache.runtime.live.source import StaticSource
from stagecache.runtime.memory.host_pools import HostPools
from stagecache.runtime.model.families import load_spec
from stagecache.runtime.model.layer_map import build_layout
from stagecache.runtime.transfer import native
from stagecache.runtime.transfer import stats as stats_module
from stagecache.runtime.transfer.controller import TransferController
from stagecache.runtime.transfer.stats import TransferStats

TINY = load_spec("tiny-v4")
STAGE = build_layout(TINY, 2).stages[1]  # every host-cached pool kind


def make(pages: int = 24):
    dp = make_pools(TINY, STAGE, 128, pages, host_pages=pages)
    hp = HostPools(dp)
    dp.allocator.alloc(pages)
    hp.allocator.alloc(pages)
    for bufs in dp.buffers.values():
        for b in bufs:
            b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8))
    stats = TransferStats()
    return dp, hp, TransferController(dp, hp, stats), stats


def test_per_kind_bytes_and_dma_time_sum_to_what_moved():
    dp, hp, c, stats = make()
    results = [c.backup([0, 1, 2], [5, 6, 7]), c.backup([3], [8]), c.load([5, 6], [10, 11]),
               c.load([8], [12], pools=["c4_state"]),  # one kind alone: its own measured time
               c.load([5, 6, 7], [13, 14, 15], layers=[STAGE.start])]
    live = stats.live()
    for d in ("d2h", "h2d"):
        mine = [r for r in results if r.direction == d]
        kinds = getattr(live.transfer_split, d)
        assert sum(k.bytes for k in kinds.values()) == getattr(live.transfer_bytes, d) == \
            sum(r.nbytes for r in mine)
        assert sum(k.dma_seconds for k in kinds.values()) == pytest.approx(sum(r.seconds for r in mine))
        assert getattr(live.transfer_split.queue_seconds, d) == pytest.approx(
            sum(r.queue_seconds for r in mine))
        assert all(r.seconds > 0 and r.queue_seconds > 0 for r in mine)
        for name, k in kinds.items():  # each kind's histograms count the transfers that moved it
            assert k.queue_buckets[-1] == k.dma_buckets[-1] == k.moves, name
    plan = c.selection()
    per_page = dict(plan.kinds)
    assert live.transfer_split.d2h["swa"].bytes == 4 * per_page["swa"]
    assert live.transfer_split.d2h["swa"].dma_seconds == pytest.approx(
        sum(r.seconds for r in results[:2]) * per_page["swa"] / plan.page_bytes)
    alone = results[3]
    assert alone.nbytes == dp.page_bytes("c4_state") * len(dp.buffers["c4_state"])
    one_layer = dict(c.selection([STAGE.start]).kinds)
    assert live.transfer_split.h2d["c4_state"].moves == 2 + ("c4_state" in one_layer)
    assert live.transfer_split.h2d["swa"].moves == 2  # the c4_state-only load did not move swa
    # the c4_state-only load's whole DMA time is c4_state's; of the other loads, its byte share
    share = (results[2].seconds * per_page["c4_state"] / plan.page_bytes
             + results[4].seconds * one_layer.get("c4_state", 0) / sum(one_layer.values()))
    assert live.transfer_split.h2d["c4_state"].dma_seconds == pytest.approx(alone.seconds + share)


class _WatchedLock:
    """The controller's copy lock, saying when a second caller has to wait for it."""

    def __init__(self) -> None:
        self.lock, self.contended = threading.Lock(), threading.Event()

    def __enter__(self) -> None:
        if not self.lock.acquire(blocking=False):
            self.contended.set()
            self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()

    def locked(self) -> bool:
        return self.lock.locked()


def test_a_call_queued_behind_another_waits_for_its_copy():
    """Two threads, one copy at a time: the load called during a long backup starts when it ends.

    Deterministic: the backup's copy is held open until the load has been called and found the
    copy lock taken (a mover that waits on an event, a lock that says when it is contended), and
    the backup then takes a known 50 ms more -- no sleeps racing the OS scheduler."""
    dp, hp, c, stats = make(pages=200)
    loads = [c.load([190], [191]) for _ in range(3)]  # warm; the last has nothing ahead
    checked_copy, copy = c.mover.check_and_move, c.mover.move
    in_copy, release = threading.Event(), threading.Event()

    def hold(d2h):
        if d2h:  # the backup: inside the copy lock, wait until the load queues behind it
            in_copy.set()
            assert release.wait(10)
            time.sleep(0.05)

    def held_checked_copy(sel, dev, host, d2h):  # the compiled helper checks and copies in one call
        hold(d2h)
        return checked_copy(sel, dev, host, d2h)

    def held_copy(steps, ids, d2h, per_layer=False):  # without it: checked, then this copy
        hold(d2h)
        return copy(steps, ids, d2h, per_layer)

    if native.module() is not None:
        c.mover.check_and_move = held_checked_copy
    else:
        c.mover.move = held_copy
    c._copy_lock = _WatchedLock()
    out = {}
    backup = threading.Thread(target=lambda: out.update(a=c.backup(list(range(160)), list(range(160)))))
    backup.start()
    assert in_copy.wait(10)
    load = threading.Thread(target=lambda: out.update(b=c.load([190], [192])))
    load.start()
    assert c._copy_lock.contended.wait(10)  # the load was called and waits for the copy lock
    release.set()
    backup.join(10)
    load.join(10)
    a, b = out["a"], out["b"]
    loads.append(b)
    a_end = a.called + a.queue_seconds + a.seconds
    assert b.called < a_end  # called while the backup copied
    assert b.called + b.queue_seconds >= a_end  # its copy started after the backup's ended
    assert b.queue_seconds >= a_end - b.called > 0.05  # it waited out the backup's held 50 ms at least
    assert b.queue_seconds > 10 * loads[2].queue_seconds  # the same load with nothing ahead
    assert b.seconds < a.seconds  # its own DMA time is its own one-page copy
    split = stats.live().transfer_split
    assert split.queue_seconds.h2d == pytest.approx(sum(r.queue_seconds for r in loads))
    assert split.h2d["swa"].queue_seconds == pytest.approx(split.queue_seconds.h2d)


def test_fold_keeps_every_transfer(monkeypatch):
    """Pending transfers fold into the split in batches, grouped by the kinds they moved; none is lost."""
    monkeypatch.setattr(stats_module, "FOLD_EVERY", 7)
    stats = TransferStats()
    both, c4_only = (("swa", 3), ("c4", 1)), (("c4", 2),)
    for i in range(20):
        kinds = (both, c4_only, tuple(list(both)))[i % 3]  # an equal tuple that is another object too
        stats.record("h2d", sum(b for _, b in kinds) * (i + 1), 0.001, i + 1, queue_seconds=0.0001, kinds=kinds)
        if i == 11:
            stats.live()
    live = stats.live()
    swa, c4 = live.transfer_split.h2d["swa"], live.transfer_split.h2d["c4"]
    n_both = sum(1 for i in range(20) if i % 3 != 1)
    assert swa.moves == n_both and c4.moves == 20
    assert swa.bytes + c4.bytes == live.transfer_bytes.h2d
    assert swa.dma_seconds == pytest.approx(0.001 * 0.75 * n_both)
    assert c4.dma_seconds == pytest.approx(0.001 * (0.25 * n_both + 20 - n_both))
    assert c4.queue_buckets[-1] == 20 and c4.queue_seconds == pytest.approx(0.002)


def test_split_reaches_stage_live_and_metrics():
    dp, hp, c, stats = make()
    c.backup([0, 1], [2, 3])
    c.load([2, 3], [4, 5])
    live = StageLive(stage=1, model_name="tiny-v4", **dict(stats.live()))
    live = StageLive.model_validate_json(live.model_dump_json())  # the run-dir round trip
    assert set(live.transfer_split.d2h) == {k for k, _ in c.selection().kinds}
    text = generate_latest(make_registry(StaticSource(None, {1: live}))).decode()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]

    def total(name, **labels):
        return sum(s.value for s in samples if s.name == name
                   and all(s.labels.get(k) == v for k, v in labels.items()))

    for d in ("d2h", "h2d"):
        assert total("stagecache_transfer_bytes_total", direction=d) == getattr(live.transfer_bytes, d) > 0
        assert total("stagecache_transfer_dma_seconds_sum", direction=d) == pytest.approx(
            getattr(live.transfer_seconds, d))
        assert total("stagecache_transfers_total", direction=d) == 1
        assert total("stagecache_transfer_queue_wait_seconds_count", direction=d) == len(c.selection().kinds)


def test_bench_transfer_split_cpu_json(capsys):
    """``stagecache bench transfer-split``: the queued load waits, its DMA time does not grow, sums hold."""
    from stagecache.runtime.cli.main import main

    assert main(["bench", "transfer-split", "--device", "cpu", "--pp-size", "2", "--page-size", "128",
                 "--big-pages", "256", "--calls", "20"]) == 0
    report = json.loads(capsys.readouterr().out)
    split, acc = report["split"], report["accounting"]
    assert report["bench"] == "transfer-split" and split["path"] == "cpu"
    assert split["behind"]["queue_us"] > split["alone"]["queue_us"]  # the figures: bench, not test
    assert split["kind_bytes_sum"] == split["bytes"]
    assert set(split["kinds"]["d2h"]) == set(split["pool_kinds"])
    assert acc["kinds"] == len(split["pool_kinds"])
    assert {"record_split_us", "record_totals_us", "stamp_and_lock_us", "added_us", "call_with_stats_us",
            "call_without_stats_us", "stats_ratio"} <= set(acc)
