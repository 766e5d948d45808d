"""The live charts: windowed rates per stage over time, and each stage's pipeline timeline.

Built server-side with plotly and shipped as Plotly's own JSON; the page's
script then appends each poll's rates (``Plotly.extendTraces``) and redraws the
timeline bars (``Plotly.restyle``).  Every trace's ``meta`` names the stage and
the ``StageRates`` field (or timeline kind) it plots, so the script never
guesses from trace order.  Each stage keeps one colour, marker and dash in
every chart (``stage_style``): when stages take the same cache decisions their
hit-rate lines lie on top of each other, and the markers still tell them apart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go
from plotly.colors import qualitative

from .models import StageLive
from .rates import StageRates

NO_LIVE_TEXT = "no live data (preflight view)"
SYMBOLS = ("circle", "square", "diamond", "triangle-up", "x", "star", "hexagon", "cross")
DASHES = ("solid", "dash", "dot", "dashdot")
MARKERS_SHOWN = 30  # plotly thins the markers of long series to this many

#: Timeline span kinds (``StageLive.timeline``): legend text and colour.  Waits are bubbles.
TIMELINE_KINDS: dict[str, tuple[str, str]] = {
    "compute": ("own work", "#2ca02c"),
    "recv_wait": ("waiting for the activation (bubble)", "#d62728"),
    "credit_wait": ("waiting for a credit (bubble)", "#ff7f0e"),
    "send_wait": ("send back-pressure (bubble)", "#9467bd"),
    "idle": ("waiting for requests (idle)", "#c7c7c7"),
}


def stage_colour(stage: int) -> str:
    return qualitative.D3[stage % len(qualitative.D3)]


def stage_style(stage: int, dash: str | None = None) -> dict[str, Any]:
    """One stage's look in every chart: colour, marker symbol and line dash of its own."""
    colour = stage_colour(stage)
    return dict(line=dict(color=colour, width=2, dash=dash or DASHES[stage % len(DASHES)]),
                marker=dict(color=colour, symbol=SYMBOLS[stage % len(SYMBOLS)], size=7,
                            maxdisplayed=MARKERS_SHOWN))


def _layout(fig: go.Figure, title: str, ytitle: str, live: bool, **yaxis: Any) -> None:
    fig.update_layout(
        title=dict(text=title, font=dict(size=14)), height=300,
        margin=dict(l=60, r=10, t=40, b=40), legend=dict(orientation="h", y=-0.2),
        yaxis=dict(title=ytitle, rangemode="tozero", **yaxis), xaxis=dict(type="date"),
    )
    if not live:  # the empty state: a note instead of an axis of made-up dates (the script clears it)
        fig.update_xaxes(showticklabels=False)
        fig.add_annotation(text=NO_LIVE_TEXT, showarrow=False, xref="paper", yref="paper",
                           x=0.5, y=0.5, font=dict(size=16, color="#777"))


def rate_lines(stage_ids: Sequence[int], history: Mapping[int, Sequence[StageRates]],
               keys: Sequence[tuple[str, str, str | None]]) -> go.Figure:
    """One line per (stage, key): ``keys`` are (``StageRates`` field, legend suffix, dash)."""
    fig = go.Figure()
    for s in stage_ids:
        for key, suffix, dash in keys:
            series = history.get(s, ())
            fig.add_trace(go.Scatter(
                x=[r.time * 1000 for r in series], y=[getattr(r, key) for r in series],
                mode="lines+markers", name=f"stage {s}{suffix}",
                meta={"stage": s, "key": key}, connectgaps=False, **stage_style(s, dash)))
    return fig


_SHARE = {"range": [0, 1.05], "tickformat": ".0%"}
#: The rate line charts, by ``<div>`` id suffix: (lines, title, y title, y axis).
RATE_CHARTS: dict[str, tuple[tuple[tuple[str, str, str | None], ...], str, str, dict[str, Any]]] = {
    "hit-rate": ((("host_hit_rate", "", None),), "host hit rate per stage (last {window:g} s)",
                 "host hits / lookups", _SHARE),
    "transfer": ((("d2h_bytes_per_s", " d2h", "solid"), ("h2d_bytes_per_s", " h2d", "dot")),
                 "host<->device bytes/s (last {window:g} s; d2h solid, h2d dotted)", "bytes/s",
                 {"tickformat": "~s"}),
    "bubble": ((("bubble_fraction", "", None),), "pipeline bubble per stage (last {window:g} s)",
               "bubble / (busy + bubble)", _SHARE),
}


def rate_figure(chart: str, stage_ids: Sequence[int], history: Mapping[int, Sequence[StageRates]],
                window_s: float, live: bool) -> go.Figure:
    keys, title, ytitle, yaxis = RATE_CHARTS[chart]
    fig = rate_lines(stage_ids, history, keys)
    _layout(fig, title.format(window=window_s), ytitle, live, **yaxis)
    return fig


TOKEN_BARS = (("device_hit_tokens_per_s", "device hits", "#1f77b4"),
              ("host_hit_tokens_per_s", "host hits", "#2ca02c"),
              ("storage_hit_tokens_per_s", "L3 hits", "#9467bd"),
              ("miss_tokens_per_s", "misses", "#ff7f0e"))


def tokens_figure(stage_ids: Sequence[int], rates: Sequence[StageRates], window_s: float,
                  live: bool) -> go.Figure:
    """Looked-up tokens/s per stage by where they were found (the script restyles the bars)."""
    by_stage = {r.stage: r for r in rates}
    fig = go.Figure()
    for key, name, colour in TOKEN_BARS:
        ys = [getattr(by_stage[s], key) if s in by_stage else None for s in stage_ids]
        fig.add_trace(go.Bar(x=[f"stage {s}" for s in stage_ids], y=ys, name=name,
                             customdata=list(stage_ids), marker_color=colour, meta={"key": key}))
    _layout(fig, f"prefix-cache tokens/s by tier (last {window_s:g} s)", "tokens/s", live)
    fig.update_layout(barmode="stack", xaxis=dict(type="category"))
    return fig


# -- transfers: queue wait vs DMA time -----------------------------------------------------------
#: (``StageRates`` field suffix, legend, colour) of the split's stacked bars, bottom first.
SPLIT_BARS = (("queue_wait_s", "queue wait (call to copy start)", "#ff7f0e"),
              ("dma_s", "DMA (copy start to finish)", "#1f77b4"))


def transfer_split_figure(stage_ids: Sequence[int], rates: Sequence[StageRates], window_s: float,
                          live: bool) -> go.Figure:
    """Mean time of one transfer per stage and direction, stacked: its queue wait under its DMA.

    One bar per (stage, direction); each point names its ``StageRates`` field in the trace's
    ``meta.keys`` (the script restyles the bars from the polled rates).
    """
    by_stage = {r.stage: r for r in rates}
    points = [(s, d) for s in stage_ids for d in ("d2h", "h2d")]
    fig = go.Figure()
    for suffix, name, colour in SPLIT_BARS:
        keys = [f"{d}_{suffix}" for _, d in points]
        ys = [getattr(by_stage[s], k) if s in by_stage else None for (s, _), k in zip(points, keys, strict=True)]
        fig.add_trace(go.Bar(x=[f"stage {s} {d}" for s, d in points], y=ys, name=name,
                             customdata=[s for s, _ in points], marker_color=colour, meta={"keys": keys},
                             hovertemplate="%{x}: %{y:.3s}s<extra>" + name + "</extra>"))
    _layout(fig, f"transfer time: queue wait vs DMA, mean per transfer (last {window_s:g} s)",
            "seconds per transfer", live, tickformat="~s")
    fig.update_layout(barmode="stack", xaxis=dict(type="category"))
    return fig


def timeline_data(stages: Sequence[StageLive], kind: str) -> dict[str, list]:
    """Bars of one span kind over every stage: start (``base``, ms), length (``x``, ms), row."""
    base, length, rows, mbs = [], [], [], []
    for s in stages:
        for e in s.timeline:
            if e.kind == kind:
                base.append(e.start * 1000)
                length.append(e.seconds * 1000)
                rows.append(f"stage {s.stage}")
                mbs.append(e.micro_batch)
    return {"base": base, "x": length, "y": rows, "customdata": mbs}


def timeline_figure(stage_ids: Sequence[int], stages: Sequence[StageLive], live: bool) -> go.Figure:
    """Each stage's recent pipeline spans on one time axis: gaps in green are the bubbles."""
    fig = go.Figure()
    for kind, (name, colour) in TIMELINE_KINDS.items():
        fig.add_trace(go.Bar(
            orientation="h", name=name, marker_color=colour, meta={"kind": kind},
            hovertemplate="%{y} · micro-batch %{customdata}<br>%{x:.1f} ms<extra>" + name + "</extra>",
            **timeline_data(stages, kind)))
    rows = [f"stage {s}" for s in stage_ids]
    _layout(fig, "pipeline timeline: each stage's recent work and waits (bubbles)", "", live)
    fig.update_layout(barmode="overlay", height=120 + 40 * max(1, len(rows)),
                      yaxis=dict(type="category", categoryorder="array", categoryarray=rows,
                                 autorange="reversed", title=None, rangemode=None))
    return fig


def live_figures(stage_ids: Sequence[int], stages: Sequence[StageLive],
                 rates: Sequence[StageRates], history: Mapping[int, Sequence[StageRates]],
                 window_s: float) -> dict[str, go.Figure]:
    """Every live chart of the page, by the id suffix of its ``<div>``."""
    live = bool(stages)
    return {
        "hit-rate": rate_figure("hit-rate", stage_ids, history, window_s, live),
        "tokens": tokens_figure(stage_ids, rates, window_s, live),
        "transfer": rate_figure("transfer", stage_ids, history, window_s, live),
        "bubble": rate_figure("bubble", stage_ids, history, window_s, live),
        "transfer-split": transfer_split_figure(stage_ids, rates, window_s, live),
        "timeline": timeline_figure(stage_ids, stages, live),
    }
