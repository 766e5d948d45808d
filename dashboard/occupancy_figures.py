"""Host-tier status and pool occupancy: a row per stage, and a heatmap of pool kind x tier by stage.

Pure functions of the stages' ``StageLive``.  The heatmap has one row per
(pool kind, tier) any stage holds -- the state and indexer pools included, and
``c128_state`` in request slots -- and one column per stage; a cell is the
kind's used / capacity (of its own page space) and reads ``used/capacity``.
The figure's ``meta`` lists the rows and stages, so the page's script
(``static/occupancy.js``) refills the cells from each poll without guessing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go
from stagecache.runtime.memory.host_tier import fmt_bytes
from stagecache.runtime.model.pool_kinds import PoolKind

from .models import StageLive

TIERS = ("device", "host")
#: green while there is room, orange from 80 %, red when full
OCCUPANCY_SCALE = [[0.0, "#e8f5e9"], [0.5, "#66bb6a"], [0.8, "#ffa726"], [1.0, "#d62728"]]
#: CSS class of a host-tier status cell: the worst status decides
STATUS_CLASS = {"exceeds_ram": "bad", "smaller_than_device": "warn", "pin_refused": "warn", "ok": "ok"}


def occupancy_rows(stages: Sequence[StageLive], kinds: Sequence[PoolKind] = ()) -> list[tuple[str, str]]:
    """(pool, tier) rows any stage reports, kinds in display order, device before host."""
    have = {(o.pool, o.tier) for s in stages for o in s.pool_occupancy}
    known = [(k.name, t) for k in kinds for t in TIERS if (k.name, t) in have]
    return known + sorted(have - set(known))


def row_label(pool: str, tier: str, kinds: Sequence[PoolKind] = ()) -> str:
    label = next((k.label for k in kinds if k.name == pool), pool)
    return f"{label} · {tier}"


def occupancy_cells(stage_ids: Sequence[int], stages: Sequence[StageLive],
                    rows: Sequence[tuple[str, str]]) -> tuple[list[list[float | None]], list[list[str]]]:
    """z (used / capacity, None where the stage has no such pool) and cell text, row by row."""
    by_stage = {s.stage: {(o.pool, o.tier): o for o in s.pool_occupancy} for s in stages}
    z: list[list[float | None]] = []
    text: list[list[str]] = []
    for row in rows:
        zs, ts = [], []
        for k in stage_ids:
            o = by_stage.get(k, {}).get(row)
            if o is None:
                zs.append(None)
                ts.append("")
                continue
            zs.append(o.used / o.capacity if o.capacity else 0.0)
            ts.append(f"{o.used}/{o.capacity}" + (" slots" if o.unit == "slot" else ""))
        z.append(zs)
        text.append(ts)
    return z, text


def occupancy_figure(stage_ids: Sequence[int], stages: Sequence[StageLive],
                     kinds: Sequence[PoolKind] = ()) -> go.Figure:
    """``kinds``: the family's pool kinds (their order and labels; a pool not among them is shown
    by its name)."""
    rows = occupancy_rows(stages, kinds)
    z, text = occupancy_cells(stage_ids, stages, rows)
    fig = go.Figure(go.Heatmap(
        x=[f"stage {k}" for k in stage_ids], y=[row_label(*r, kinds) for r in rows], z=z, text=text,
        texttemplate="%{text}", zmin=0, zmax=1, colorscale=OCCUPANCY_SCALE, xgap=2, ygap=2,
        hovertemplate="%{y}, %{x}<br>%{text} (%{z:.0%})<extra></extra>",
        colorbar=dict(title=dict(text="used"), tickformat=".0%", thickness=12)))
    fig.update_layout(
        title=dict(text="pool occupancy: used / capacity of each kind's own space "
                        "(pages; per-request kinds: request slots)", font=dict(size=14)),
        height=140 + 26 * max(1, len(rows)), margin=dict(l=10, r=10, t=40, b=30),
        yaxis=dict(autorange="reversed", automargin=True), xaxis=dict(type="category"),
        plot_bgcolor="#f7f7f7",
        meta={"rows": [list(r) for r in rows], "stages": list(stage_ids),
              # for a page drawn before any stage reported: the script builds the rows itself
              "order": [[k.name, t] for k in kinds for t in TIERS],
              "labels": {k.name: k.label for k in kinds}})
    if not rows:
        fig.add_annotation(text="no live data", showarrow=False, xref="paper", yref="paper",
                           x=0.5, y=0.5, font=dict(size=16, color="#777"))
    return fig


def status_class(status: Sequence[str]) -> str:
    """The worst status's class (``bad`` over ``warn`` over ``ok``); ``unknown`` when unchecked."""
    classes = [STATUS_CLASS.get(s, "warn") for s in status]
    for c in ("bad", "warn", "ok"):
        if c in classes:
            return c
    return "unknown"


def host_tier_rows(stage_ids: Sequence[int], stages: Sequence[StageLive]) -> list[dict[str, Any]]:
    """One row per stage for the host-tier table (the script refreshes the same cells)."""
    by_stage = {s.stage: s.host_tier for s in stages}
    out = []
    for k in stage_ids:
        t = by_stage.get(k)
        status = list(t.status) if t else []
        avail, reserve = (t.mem_available_bytes, t.reserve_bytes) if t else (None, None)
        out.append({"stage": k, "status": status, "cls": status_class(status),
                    "pinned": t.pinned if t and status else None,
                    "available": fmt_bytes(avail) if avail is not None else "?",
                    "reserve": fmt_bytes(reserve) if reserve is not None else "?",
                    "reasons": [r for r, s in zip(t.reasons, t.status, strict=False) if s != "ok"]
                    if t else []})
    return out
