"""Rank 0's compare of the PP ranks' agreement records (``live.divergence``): pure, bounded, linear."""

from __future__ import annotations

import time

import pytest
from stagecache.runtime.live.divergence import (
    MAX_BATCH,
    DivergenceTracker,
    IncompleteBackup,
    RankBatch,
    readiness_lines,
)
from stagecache.runtime.live.liveness import liveness_of
from stagecache.runtime.live.source import StaticSource


def _batch(requests=(), steps=(), prefetch=()):
    return RankBatch(requests=list(requests), steps=list(steps), prefetch=list(prefetch))


def test_agreeing_ranks_count_agreement_and_no_divergence():
    t = DivergenceTracker(4)
    for rank in range(4):
        assert t.add(rank, _batch([("a", 512, 256), ("b", 0, 0)], [(1, 1, 0, 1, 0)])) == []
    d = t.live()
    assert d.total == 0 and d.first is None
    assert d.compared["device_prefix_len"] == 2 and d.compared["host_hit_length"] == 2
    assert d.compared["load_pending"] == 1 and d.compared["write_acks"] == 1


def test_the_first_divergence_names_request_ranks_quantity_and_values():
    t = DivergenceTracker(4)
    for rank in (0, 1, 3):
        assert t.add(rank, _batch([("r7", 512, 256)])) == []  # waits for rank 2
    found = t.add(2, _batch([("r7", 512, 0)]))
    assert len(found) == 1
    d = found[0]
    assert (d.request, d.quantity, d.ranks, d.agreed, d.values) == ("r7", "host_hit_length", [2], 256,
                                                                    [256, 256, 0, 256])
    assert d.text().startswith("request r7: host_hit_length differs across PP ranks: rank 2 = 0; "
                               "the other ranks = 256")
    live = t.live()
    assert live.first == d and live.divergent["host_hit_length"] == 1 and live.per_rank == {2: {"host_hit_length": 1}}
    assert live.compared["device_prefix_len"] == 1 and live.divergent["device_prefix_len"] == 0


def test_a_step_divergence_names_the_step():
    t = DivergenceTracker(2)
    t.add(0, _batch(steps=[(5, 0, 1, 0, 1)]))
    (d,) = t.add(1, _batch(steps=[(5, 0, 0, 0, 0)]))[:1]
    assert d.step == 5 and d.request is None and d.quantity == "load_pending" and d.ranks == [1]
    assert t.live().divergent["load_acks"] == 1  # both quantities of the step differ


def test_a_tie_goes_to_the_larger_value():
    t = DivergenceTracker(2)
    t.add(0, _batch(prefetch=[("p", 512)]))
    (d,) = t.add(1, _batch(prefetch=[("p", 256)]))
    assert d.quantity == "l3_prefetch_tokens" and d.agreed == 512 and d.ranks == [1]


def test_the_window_is_bounded_and_late_keys_are_unmatched_not_compared():
    t = DivergenceTracker(2, window=10)
    t.add(0, _batch([(f"r{i}", 1, 0) for i in range(25)]))
    assert t.live().unmatched == 15
    assert t.add(1, _batch([("r0", 2, 0)])) == []  # r0 fell out of the window: never compared
    assert t.add(1, _batch([("r24", 2, 0)]))[0].request == "r24"
    # a key compared once is not compared again when a duplicate arrives
    assert t.add(1, _batch([("r24", 3, 0)])) == []


def test_a_pushed_batch_is_validated_with_size_limits():
    ok = RankBatch.parse({"requests": [["a" * 500, 1, 2]], "steps": [[1, 0, 0, 0, 0]], "dropped": 3})
    assert ok.requests[0][0] == "a" * 128 and ok.dropped == 3
    for bad, words in (([1, 2], "JSON object"), ({"requests": [["a", 1]]}, "3 items"),
                       ({"requests": [[1, 1, 1]]}, "request id"), ({"steps": [[1, "x", 0, 0, 0]]}, "integer"),
                       ({"requests": [["a", 1, 1]] * (MAX_BATCH + 1)}, "at most"),
                       ({"evil": 1}, "unknown"), ({"steps": [[1, True, 0, 0, 0]]}, "integer")):
        with pytest.raises(ValueError, match=words):
            RankBatch.parse(bad)
    wire = ok.wire()
    assert RankBatch.parse(wire) == ok


def test_a_compare_is_linear():
    """10 x the records take about 10 x the CPU time (a quadratic compare would take 100 x; the
    bound leaves room for a loaded machine)."""
    def run(n: int) -> float:
        t = DivergenceTracker(4, window=n)
        batches = [_batch([(f"r{i}", i, 0) for i in range(n)], [(i, 0, 0, 0, 0) for i in range(n)])
                   for _ in range(4)]
        t0 = time.process_time()
        for rank, b in enumerate(batches):
            t.add(rank, b)
        return time.process_time() - t0

    small = min(run(400) for _ in range(5))
    big = min(run(4000) for _ in range(5))
    assert big < 40 * small, (small, big)


def test_readyz_warns_and_strict_makes_the_deployment_not_ready():
    t = DivergenceTracker(2)
    t.add(0, _batch([("r1", 256, 256)]))
    t.add(1, _batch([("r1", 256, 0)]))
    bad = IncompleteBackup(time=1.0, stage=1, direction="d2h", page=4, pages=1, missing=["indexer"],
                           expected_bytes=12189696, got_bytes=10027008)
    t.add(1, RankBatch(backups=[bad]))
    lines = readiness_lines(t.live())
    assert lines[0].startswith("PP ranks diverged 1 time(s); first at request r1: host_hit_length")
    assert lines[1] == ("1 incomplete HiCache transfer(s); first: stage 1: backup of host page 4 (1 page(s)) "
                        "lacks pool kind(s) indexer: 10027008 bytes moved, the stage's plan says 12189696")
    source = StaticSource(None)
    source.divergence = t.live  # the sglang endpoint's source compares the ranks
    verdict = liveness_of(source, time.time())
    assert verdict.warnings[-2:] == lines and not any(r.startswith("PP ranks") for r in verdict.reasons)
    source.strict_agreement = True
    verdict = liveness_of(source, time.time())
    assert not verdict.ready and verdict.reasons[-2:] == lines
