"""Plotly figures, built server-side and shipped to the browser as JSON.

Layer map: one heatmap per PP stage -- global layer ids across, pool kinds
down, a cell wherever a local layer needs a buffer in that pool; cell text is
the buffer index the stage uses (local id for SWA, compress id otherwise),
colour is the layer's compress ratio.  A pool that failed validation gets a red
band across its row (its label shows buffers/expected), a cell whose index is
out of range or shared gets a red frame and a cross.

Live charts are created here with one trace per stage and empty (or current)
data; the page's script appends points from ``/api/metrics/summary``.  Each
trace's ``meta`` says which stage/number it plots so the script never guesses
from trace order.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go
from stagecache.runtime.model.pool_kinds import KINDS, POOLS

from .models import LayerMapCell, PoolStatus, StageLive, StageReportModel

RATIO_CLASS = {0: 0, 4: 1, 128: 2}
RATIO_COLOURS = ("#a9bfdc", "#f4b26b", "#7cc79a")
ERROR_RED = "#d62728"
NO_LIVE_TEXT = "no live data (preflight view)"


def to_json_dict(fig: go.Figure) -> dict[str, Any]:
    """Plotly's own encoder (numpy, dates), then plain dicts for pydantic/Jinja."""
    return json.loads(fig.to_json())


def _discrete_scale(colours: Sequence[str]) -> list[list[Any]]:
    n = len(colours)
    scale: list[list[Any]] = []
    for i, c in enumerate(colours):
        scale += [[i / n, c], [(i + 1) / n, c]]
    return scale


def layer_map_figure(
    stage: StageReportModel, pools: Sequence[PoolStatus], cells: Sequence[LayerMapCell]
) -> go.Figure:
    xs = list(range(stage.start_layer, stage.end_layer))
    col = {g: i for i, g in enumerate(xs)}
    row = {p: i for i, p in enumerate(POOLS)}
    z: list[list[int | None]] = [[None] * len(xs) for _ in POOLS]
    text: list[list[str]] = [[""] * len(xs) for _ in POOLS]
    hover: list[list[str]] = [["no buffer in this pool"] * len(xs) for _ in POOLS]
    fig = go.Figure()
    shapes: list[dict[str, Any]] = []

    for c in cells:
        if c.global_id not in col:  # a layer outside [start, end): shown in the stage table
            continue
        r, x = row[c.pool], col[c.global_id]
        z[r][x] = RATIO_CLASS.get(c.compress_ratio, 0)
        idx = "?" if c.index is None else str(c.index)
        text[r][x] = idx + (" ✗" if c.error else "")
        hover[r][x] = (
            f"{KINDS[c.pool].label}<br>global layer {c.global_id} / local {c.local}"
            f"<br>compress ratio {c.compress_ratio}<br>buffer index {idx}"
            + (f"<br><b>{c.error}</b>" if c.error else "")
        )
        if c.error:
            shapes.append(dict(
                type="rect", xref="x", yref="y", x0=c.global_id - 0.5, x1=c.global_id + 0.5,
                y0=r - 0.5, y1=r + 0.5, line=dict(color=ERROR_RED, width=3),
            ))

    fig.add_trace(go.Heatmap(
        x=xs, y=list(range(len(POOLS))), z=z, text=text, texttemplate="%{text}",
        hovertext=hover, hovertemplate="%{hovertext}<extra></extra>",
        zmin=-0.5, zmax=len(RATIO_COLOURS) - 0.5, colorscale=_discrete_scale(RATIO_COLOURS),
        xgap=2, ygap=2, showscale=True,
        colorbar=dict(tickvals=[0, 1, 2], ticktext=["ratio 0", "ratio 4", "ratio 128"],
                      thickness=12, len=0.9, title=dict(text="compress")),
    ))

    ticktext = []
    for i, p in enumerate(pools):
        label = f"{p.label} {p.buffers}/{p.expected}"
        if p.ok:
            ticktext.append(label)
            continue
        ticktext.append(f"<span style='color:{ERROR_RED}'><b>✗ {label}</b></span>")
        if xs:
            shapes.append(dict(
                type="rect", xref="x", yref="y", x0=xs[0] - 0.5, x1=xs[-1] + 0.5,
                y0=i - 0.5, y1=i + 0.5, line=dict(color=ERROR_RED, width=3),
                fillcolor="rgba(214,39,40,0.12)",
            ))

    n_err = len(stage.errors)
    title = f"stage {stage.stage}: global layers [{stage.start_layer}, {stage.end_layer}) · {stage.local_layers} local"
    if n_err:
        title += f" · <span style='color:{ERROR_RED}'>{n_err} error(s)</span>"
    annotations = []
    if not xs:
        annotations.append(dict(text="this stage owns no layers", showarrow=False,
                                xref="paper", yref="paper", x=0.5, y=0.5))
    fig.update_layout(
        title=dict(text=title, font=dict(size=14)),
        height=350, margin=dict(l=10, r=10, t=40, b=60),
        xaxis=dict(title="global layer id", tickmode="array", tickvals=xs, showgrid=False, zeroline=False),
        yaxis=dict(tickmode="array", tickvals=list(range(len(POOLS))), ticktext=ticktext,
                   autorange="reversed", showgrid=False, zeroline=False),
        shapes=shapes, annotations=annotations,
        plot_bgcolor="#f7f7f7", meta={"stage": stage.stage, "ok": stage.ok},
    )
    return fig


def _no_live(fig: go.Figure, live: bool) -> None:
    """The empty state: a note instead of an axis of made-up dates (the script clears it)."""
    if not live:
        fig.update_xaxes(showticklabels=False)
        fig.add_annotation(text=NO_LIVE_TEXT, showarrow=False, xref="paper", yref="paper",
                           x=0.5, y=0.5, font=dict(size=16, color="#777"))


def _layout(fig: go.Figure, title: str, ytitle: str, **yaxis: Any) -> None:
    fig.update_layout(
        title=dict(text=title, font=dict(size=14)), height=300,
        margin=dict(l=50, r=10, t=40, b=40), legend=dict(orientation="h", y=-0.2),
        yaxis=dict(title=ytitle, rangemode="tozero", **yaxis),
    )


def hit_ratio_figure(stage_ids: Sequence[int], now_ms: float, live: Sequence[StageLive]) -> go.Figure:
    """Host hit ratio per stage over time (the script extends every trace each poll)."""
    by_stage = {s.stage: s for s in live}
    fig = go.Figure()
    for s in stage_ids:
        point = by_stage.get(s)
        fig.add_trace(go.Scatter(
            x=[now_ms] if point else [], y=[point.host_hit_ratio] if point else [],
            mode="lines+markers", name=f"stage {s}", meta={"stage": s, "key": "host_hit_ratio"},
        ))
    _layout(fig, "host hit ratio", "host hits / lookups", range=[0, 1.05], tickformat=".0%")
    fig.update_xaxes(type="date")
    _no_live(fig, bool(live))
    return fig


def tokens_figure(stage_ids: Sequence[int], live: Sequence[StageLive]) -> go.Figure:
    """Cumulative device/host/miss tokens per stage (the script restyles the bars)."""
    by_stage = {s.stage: s for s in live}
    labels = [f"stage {s}" for s in stage_ids]
    fig = go.Figure()
    for key, colour in (("device", "#1f77b4"), ("host", "#2ca02c"), ("miss", "#ff7f0e")):
        ys = [getattr(by_stage[s].cache_tokens, key) if s in by_stage else 0 for s in stage_ids]
        fig.add_trace(go.Bar(x=labels, y=ys, name=f"{key} tokens", customdata=list(stage_ids),
                             marker_color=colour, meta={"key": key}))
    _layout(fig, "cache tokens: device hit / host hit / miss", "tokens")
    fig.update_layout(barmode="stack")
    _no_live(fig, bool(live))
    return fig


def bandwidth_figure(stage_ids: Sequence[int], now_ms: float, live: Sequence[StageLive]) -> go.Figure:
    """Host<->device transfer bandwidth per stage and direction over time, in GB/s."""
    by_stage = {s.stage: s for s in live}
    fig = go.Figure()
    for s in stage_ids:
        point = by_stage.get(s)
        for direction, dash in (("d2h", "solid"), ("h2d", "dot")):
            value = getattr(point.bandwidth_bytes_per_second, direction) / 1e9 if point else None
            fig.add_trace(go.Scatter(
                x=[now_ms] if point else [], y=[value] if point else [], mode="lines",
                name=f"stage {s} {direction}", line=dict(dash=dash),
                meta={"stage": s, "key": direction},
            ))
    _layout(fig, "transfer bandwidth (d2h solid, h2d dotted)", "GB/s")
    fig.update_xaxes(type="date")
    _no_live(fig, bool(live))
    return fig
