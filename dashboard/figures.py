"""Plotly figures, built server-side and shipped to the browser as JSON.

Layer map: one heatmap per PP stage -- global layer ids across, pool kinds
down, a cell wherever a local layer needs a buffer in that pool; cell text is
the buffer index the stage uses (the layer's id in the pool kind's numbering),
colour is the layer's cache kind, with its family's legend (DeepSeek V4: the
compress ratio).  A pool that failed validation gets a red
band across its row (its label shows buffers/expected), a cell whose index is
out of range or shared gets a red frame and a cross.

The live charts are in ``live_figures.py``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go
from stagecache.runtime.model.family import Family
from stagecache.runtime.validation.report import StageReport

from .models import LayerMapCell, PoolStatus

#: Colours of a family's layer kinds, in its legend order.
KIND_COLOURS = ("#a9bfdc", "#f4b26b", "#7cc79a", "#c9a0dc", "#e6d36b")
ERROR_RED = "#d62728"


def to_json_dict(fig: go.Figure) -> dict[str, Any]:
    """Plotly's own encoder (numpy, dates), then plain dicts for pydantic/Jinja."""
    return json.loads(fig.to_json())


def _discrete_scale(colours: Sequence[str]) -> list[list[Any]]:
    n = len(colours)
    scale: list[list[Any]] = []
    for i, c in enumerate(colours):
        scale += [[i / n, c], [(i + 1) / n, c]]
    return scale


def _cell_grid(xs: list[int], pools: Sequence[PoolStatus], cells: Sequence[LayerMapCell], family: Family
               ) -> tuple[list[list[int | None]], list[list[str]], list[list[str]], list[dict[str, Any]]]:
    """Heatmap z (the layer kind's place in the legend), cell text, hover text, and a red frame per
    wrong cell."""
    names = [p.pool for p in pools]
    labels = {p.pool: p.label for p in pools}
    col = {g: i for i, g in enumerate(xs)}
    row = {p: i for i, p in enumerate(names)}
    legend = {k.name: (i, k.text) for i, k in enumerate(family.layer_kinds)}
    z: list[list[int | None]] = [[None] * len(xs) for _ in names]
    text: list[list[str]] = [[""] * len(xs) for _ in names]
    hover: list[list[str]] = [["no buffer in this pool"] * len(xs) for _ in names]
    frames: list[dict[str, Any]] = []
    for c in cells:
        if c.global_id not in col or c.pool not in row:  # outside [start, end): in the stage table
            continue
        r, x = row[c.pool], col[c.global_id]
        klass, kind_text = legend.get(c.kind, (0, c.kind))
        z[r][x] = klass
        idx = "?" if c.index is None else str(c.index)
        text[r][x] = idx + (" ✗" if c.error else "")
        hover[r][x] = (
            f"{labels[c.pool]}<br>global layer {c.global_id} / local {c.local}"
            f"<br>{family.legend_title} {kind_text}<br>buffer index {idx}"
            + (f"<br><b>{c.error}</b>" if c.error else "")
        )
        if c.error:
            frames.append(dict(
                type="rect", xref="x", yref="y", x0=c.global_id - 0.5, x1=c.global_id + 0.5,
                y0=r - 0.5, y1=r + 0.5, line=dict(color=ERROR_RED, width=3),
            ))
    return z, text, hover, frames


def _pool_labels(xs: list[int], pools: Sequence[PoolStatus]) -> tuple[list[str], list[dict[str, Any]]]:
    """Row labels ``label buffers/expected`` (red with a cross when wrong) and a red band per wrong pool."""
    ticktext, bands = [], []
    for i, p in enumerate(pools):
        label = f"{p.label} {p.buffers}/{p.expected}"
        if p.ok:
            ticktext.append(label)
            continue
        ticktext.append(f"<span style='color:{ERROR_RED}'><b>✗ {label}</b></span>")
        if xs:
            bands.append(dict(
                type="rect", xref="x", yref="y", x0=xs[0] - 0.5, x1=xs[-1] + 0.5,
                y0=i - 0.5, y1=i + 0.5, line=dict(color=ERROR_RED, width=3),
                fillcolor="rgba(214,39,40,0.12)",
            ))
    return ticktext, bands


def layer_map_figure(stage: StageReport, pools: Sequence[PoolStatus], cells: Sequence[LayerMapCell],
                     family: Family) -> go.Figure:
    xs = list(range(stage.start, stage.end))
    names = [p.pool for p in pools]
    z, text, hover, frames = _cell_grid(xs, pools, cells, family)
    ticktext, bands = _pool_labels(xs, pools)
    colours = KIND_COLOURS[:len(family.layer_kinds)]
    fig = go.Figure(go.Heatmap(
        x=xs, y=list(range(len(names))), z=z, text=text, texttemplate="%{text}",
        hovertext=hover, hovertemplate="%{hovertext}<extra></extra>",
        zmin=-0.5, zmax=len(colours) - 0.5, colorscale=_discrete_scale(colours),
        xgap=2, ygap=2, showscale=True,
        colorbar=dict(tickvals=list(range(len(colours))), ticktext=[k.text for k in family.layer_kinds],
                      thickness=12, len=0.9, title=dict(text=family.legend_title)),
    ))
    n_err = len(stage.errors)
    title = f"stage {stage.stage}: global layers [{stage.start}, {stage.end}) · {stage.local_layers} local"
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
        yaxis=dict(tickmode="array", tickvals=list(range(len(names))), ticktext=ticktext,
                   autorange="reversed", showgrid=False, zeroline=False),
        shapes=frames + bands, annotations=annotations,
        plot_bgcolor="#f7f7f7", meta={"stage": stage.stage, "ok": stage.ok},
    )
    return fig
