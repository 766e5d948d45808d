"""Pipeline schedule pieces: micro-batching, digests, and StagePipe over real gloo processes."""

from __future__ import annotations

import datetime
import multiprocessing as mp

import pytest
from stagecache.runtime.serve.pipeline import (
    MicroBatch,
    PipelineClock,
    decision_digest,
    ideal_bubble_fraction,
    split_micro_batches,
)


def test_split_keeps_order_and_never_drops():
    mbs = split_micro_batches(range(10), 4)
    assert [mb.requests for mb in mbs] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9)]
    assert [mb.index for mb in mbs] == [0, 1, 2]
    by_tokens = split_micro_batches([5, 5, 20, 1], 10, token_len=lambda n: n, max_tokens=10)
    assert [mb.requests for mb in by_tokens] == [(5, 5), (20,), (1,)]  # oversized request kept whole
    with pytest.raises(ValueError):
        split_micro_batches([1], 0)


def test_ideal_bubble_fraction():
    assert ideal_bubble_fraction(1, 10) == 0
    assert ideal_bubble_fraction(4, 1) == pytest.approx(3 / 4)
    assert ideal_bubble_fraction(4, 60) == pytest.approx(3 / 63)


def test_decision_digest_is_stable_and_sensitive():
    a = [("s1", 0, 2, 1, 3), ("s2", 1, 0, 0, 4)]
    assert decision_digest(a) == decision_digest(list(a))
    assert decision_digest(a) != decision_digest([("s1", 0, 2, 0, 4), ("s2", 1, 0, 0, 4)])
    assert 0 <= decision_digest(a) < 2**31


def test_clock_rebooks_arrival_idle():
    c = PipelineClock()
    c.waited(1.0)
    c.rebook_as_idle(waited=1.0, idle=0.25)
    assert c.bubble_seconds == pytest.approx(0.75) and c.idle_seconds == pytest.approx(0.25)
    c.rebook_as_idle(waited=0.1, idle=5.0)  # never more than was waited
    assert c.bubble_seconds == pytest.approx(0.65)


def test_clock_timeline_is_a_bounded_ring_of_spans():
    import time

    from stagecache.runtime.live.numbers import TIMELINE_EVENTS

    c = PipelineClock()
    before = time.time()
    c.micro_batch = 7
    c.busy(0.5)
    c.waited(1.0, "recv_wait")
    c.rebook_as_idle(waited=1.0, idle=0.25)  # the wait's first 0.25 s become idle
    ev = c.timeline()
    assert [(e.kind, e.seconds, e.micro_batch) for e in ev] == [
        ("compute", 0.5, 7), ("idle", 0.25, 7), ("recv_wait", 0.75, 7)]
    assert ev[2].start == pytest.approx(ev[1].start + 0.25)
    assert before - 2 < ev[0].start <= time.time()  # wall-clock starts, comparable across stages
    for i in range(TIMELINE_EVENTS + 5):
        c.micro_batch = i
        c.busy(0.001)
    ev = c.timeline()
    assert len(ev) == TIMELINE_EVENTS and ev[-1].micro_batch == TIMELINE_EVENTS + 4


def _stage(rank: int, world: int, port: int, diverge: bool, q) -> None:
    import torch
    import torch.distributed as dist
    from stagecache.runtime.serve.pipeline import PipelineError, StagePipe

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    pipe = StagePipe(rank, world, hidden=8, device="cpu")
    seen = []

    def work(mb: MicroBatch, act):
        if act is None:
            act = torch.full((len(mb.requests), 8), float(mb.index))
        seen.append(float(act[0, 0]))
        digest = 1 if diverge and rank == 2 and mb.index == 3 else 0
        return act + 1, digest

    try:
        for mb in split_micro_batches(range(12), 2):
            pipe.step(mb, work)
        pipe.drain()
        kinds = {e.kind: e.micro_batch for e in pipe.clock.timeline()}  # last micro-batch per kind
        q.put((rank, "ok", seen, pipe.clock.micro_batches, (pipe.clock.activation_bytes_sent, kinds)))
    except PipelineError as exc:
        q.put((rank, "error", str(exc), 0, 0))
    dist.destroy_process_group() if not diverge else None


def _run(world: int, diverge: bool, free_port: int):
    ctx = mp.get_context("forkserver")  # torch imported once by the server, as serve does
    ctx.set_forkserver_preload(["torch", "torch.distributed", "stagecache.runtime.serve.pipeline"])
    q = ctx.Queue()
    procs = [ctx.Process(target=_stage, args=(r, world, free_port, diverge, q)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        # all stages, or (diverging) until the last stage reported: the others then block on it
        while len(results) < world and not (diverge and world - 1 in results):
            rank, status, payload, n, sent = q.get(timeout=90)
            results[rank] = (status, payload, n, sent)
    finally:
        for p in procs:
            p.join(5 if not diverge else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    return results


def test_activations_flow_through_every_stage_in_order(free_port):
    res = _run(3, False, free_port)
    assert all(r[0] == "ok" and r[2] == 6 for r in res.values())
    # stage k sees micro-batch i's activation after k increments: i + k
    for rank, (_, seen, _, _) in res.items():
        assert seen == [float(i + rank) for i in range(6)]
    assert res[0][3][0] > 0 and res[2][3][0] == 0  # the last stage sends only credits, not activations
    # every stage's timeline shows its own work; downstream stages waited for activations
    assert all(res[r][3][1]["compute"] == 5 for r in res)
    assert "recv_wait" in res[1][3][1] and "recv_wait" in res[2][3][1]
    assert "recv_wait" not in res[0][3][1]


def test_diverged_cache_decisions_are_reported_with_both_stages(free_port):
    res = _run(3, True, free_port)
    status, msg, _, _ = res[2]
    assert status == "error"
    assert "stage 2" in msg and "micro-batch 3" in msg and "stage 1" in msg and "diverged" in msg
