"""The queue/DMA split on the dashboard: windowed means per transfer, and the stacked bars."""

from __future__ import annotations

import pytest
from live_helpers import blank_live
from stagecache.dashboard import figures, live_figures
from stagecache.dashboard.rates import History
from stagecache.runtime.live.numbers import StageLive


def live(stage: int, transfers: int, queue_s: float, dma_s: float) -> StageLive:
    d = blank_live(stage)
    d.update(transfer_count={"d2h": transfers, "h2d": 0}, transfer_seconds={"d2h": dma_s, "h2d": 0.0},
             transfer_split={"queue_seconds": {"d2h": queue_s, "h2d": 0.0}})
    return StageLive.model_validate(d)


def test_window_means_are_per_transfer_and_follow_the_window():
    h = History(min_spacing_s=0)
    # 10 s of 100 transfers/s at 1 ms queue + 2 ms DMA, then 10 s at 5 ms queue + 2 ms DMA
    for t in range(21):
        n1, n2 = min(t, 10) * 100, max(0, t - 10) * 100
        h.observe([live(0, n1 + n2, n1 * 0.001 + n2 * 0.005, (n1 + n2) * 0.002)], float(t))
    (r,) = h.rates(window_s=5)
    assert r.d2h_queue_wait_s == pytest.approx(0.005) and r.d2h_dma_s == pytest.approx(0.002)
    (r,) = h.rates(window_s=20)
    assert r.d2h_queue_wait_s == pytest.approx(0.003) and r.d2h_dma_s == pytest.approx(0.002)
    assert r.h2d_queue_wait_s is None and r.h2d_dma_s is None  # no loads: no mean, not 0


def test_split_bars_stack_queue_under_dma_per_stage_and_direction():
    h = History(min_spacing_s=0)
    for t in range(3):
        h.observe([live(s, 10 * t, 0.001 * (s + 1) * 10 * t, 0.002 * 10 * t) for s in range(2)], float(t))
    fig = figures.to_json_dict(live_figures.live_figures([0, 1], [], h.rates(10), {}, 10)["transfer-split"])
    assert fig["layout"]["barmode"] == "stack"
    queue, dma = fig["data"]
    assert queue["x"] == ["stage 0 d2h", "stage 0 h2d", "stage 1 d2h", "stage 1 h2d"]
    assert queue["customdata"] == [0, 0, 1, 1]
    assert queue["meta"]["keys"] == ["d2h_queue_wait_s", "h2d_queue_wait_s"] * 2
    assert dma["meta"]["keys"] == ["d2h_dma_s", "h2d_dma_s"] * 2
    assert queue["y"] == pytest.approx([0.001, None, 0.002, None])
    assert dma["y"] == pytest.approx([0.002, None, 0.002, None])
